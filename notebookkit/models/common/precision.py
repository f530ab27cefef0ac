"""Does this machine compute in bfloat16 natively?

bf16 tensor-core math arrived with compute capability 8.0 (Ampere: A100, RTX 30xx, L4, H100...).
A T4 (7.5) or V100 (7.0) has none, so fp16 is their 16-bit dtype. ``torch.cuda.is_bf16_supported()``
alone does not say this: by default (``including_emulation=True``) it also answers ``True`` on a T4,
where a bf16 tensor can be created but every bf16 matmul is emulated, slowly.
"""

from __future__ import annotations

from typing import Optional, Union

import torch


def is_bfloat16_supported(device: Optional[Union[int, torch.device]] = None) -> bool:
    """``True`` when the current (or given) CUDA GPU has native bf16, i.e. compute capability >= 8.0.

    ``False`` on a T4 or V100 (use fp16 there) and on a machine without a GPU (notebookkit trains
    in fp32 on a CPU). The usual notebook line, on a GPU::

        SFTConfig(..., fp16=not is_bfloat16_supported(), bf16=is_bfloat16_supported())
    """
    if torch.version.hip:  # ROCm GPUs that run PyTorch compute in bf16
        return torch.cuda.is_available()
    if not torch.cuda.is_available():
        return False
    if isinstance(device, torch.device):
        device = device.index
    index = torch.cuda.current_device() if device is None else int(device)
    return torch.cuda.get_device_capability(index)[0] >= 8


#: Same function, under the shorter name some notebooks import.
is_bf16_supported = is_bfloat16_supported


def family_dtype(config: object, dtype: torch.dtype, requested: object, banner: Optional[object] = None) -> torch.dtype:
    """The compute dtype for a model of ``config``'s family: ``dtype`` unless it is fp16 and the family's
    activations overflow fp16 (its record's ``fp16_overflow``: Gemma 2 and 3).

    Then ``requested=None`` (the automatic choice on a GPU without bf16, a T4) becomes fp32, with a
    banner note; an explicit ``float16`` raises a ``ValueError`` that says why and what to use.
    """
    from notebookkit.families import for_model_type

    model_type = getattr(config, "model_type", None)
    row = for_model_type(model_type, multimodal=True)
    if dtype != torch.float16 or row is None or row.fp16_overflow is None:
        return dtype
    if requested is None:
        if banner is not None:
            banner.note(f"{row.name} computes in float32 on this GPU (no bf16): {row.fp16_overflow}")
        return torch.float32
    raise ValueError(
        f"dtype=float16 cannot train or run {model_type} ({row.name}): {row.fp16_overflow}. "
        "On a GPU with bf16 (compute capability 8.0+: L4, A10, A100, RTX 30xx and newer) use dtype=None or "
        "'bfloat16'; on a T4 use dtype=None or 'float32' (4-bit weights still apply: load_in_4bit=True "
        "keeps the weights small, the arithmetic runs in fp32)."
    )
