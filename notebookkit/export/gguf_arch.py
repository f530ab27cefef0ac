"""How each supported family is laid out in GGUF for llama.cpp: one row per ``model_type``, read from
the family record (``Family.gguf``, :class:`notebookkit.families.GGUFLayout`).

Facts of the format (from the ``gguf`` package's name tables and llama.cpp's model loader):

* Tensor names follow llama.cpp's scheme (``token_embd``, ``blk.N.attn_q``, ``output_norm`` ...),
  mapped from Hugging Face names by ``gguf.get_tensor_name_map``. A tied LM head is not written
  (llama.cpp reuses ``token_embd``).
* ``permute_qk``: llama.cpp's ``llama`` architecture applies RoPE to *adjacent* pairs
  ``(x[2i], x[2i+1])`` while Hugging Face's Llama/Mistral rotate *halves* ``(x[i], x[i + d/2])``.
  The rows of ``q_proj`` / ``k_proj`` are reordered per head so the two agree: for a head of size
  ``d``, output row ``2i`` takes row ``i`` and row ``2i + 1`` takes row ``i + d/2``
  (``W.reshape(heads, 2, d/2, in).transpose(1, 2)``; K uses the KV head count). Qwen and Gemma run
  llama.cpp's NeoX-style rotation, which already rotates halves: no permutation.
* ``norm_shift``: Gemma's RMSNorm multiplies by ``(1 + w)``; llama.cpp multiplies by the stored
  weight, so every ``*norm.weight`` is written as ``1 + w`` (in fp32).
* Llama 3's RoPE scaling (``rope_type = "llama3"``) is a per-frequency divisor ``f_i`` that llama.cpp
  reads from a ``rope_freqs.weight`` tensor: with ``theta_i = base^(-2i/d)``, wavelength
  ``lambda_i = 2*pi / theta_i``, ``lambda_hi = L0 / high_freq_factor``, ``lambda_lo = L0 / low_freq_factor``
  (``L0`` = original context):  ``f_i = 1`` if ``lambda_i < lambda_hi``, ``f_i = factor`` if
  ``lambda_i > lambda_lo``, else ``1 / ((1 - s) / factor + s)`` with ``s = (L0 / lambda_i - low) / (high - low)``.
* Mixture-of-experts families (``Family.moe``: ``qwen3moe``, ``gpt-oss``): the experts' tensors, metadata
  and what llama.cpp fixes for them are in :mod:`.gguf_experts`.
* YaRN (``rope_type = "yarn"``, gpt-oss): ``rope.scaling.type = yarn``, its factor, original context and
  betas; transformers' ``truncate=False`` (gpt-oss) has no llama.cpp key (:func:`add_yarn_metadata` warns).
* Gemma 2/3 interleave sliding-window and full-attention layers; llama.cpp reads the per-layer
  pattern from ``sliding_window_pattern`` (an array of booleans, true = sliding) and Gemma 3's local
  RoPE base from ``rope.freq_base_swa``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from notebookkit.families import FAMILIES, MoE

from .checks import ExportError

__all__ = ["GGUFFamily", "GGUF_FAMILIES", "gguf_family", "add_yarn_metadata", "permute_for_llama_rope", "unpermute_for_llama_rope", "llama3_rope_factors"]


@dataclass(frozen=True)
class GGUFFamily:
    """One supported family: llama.cpp's architecture name and the conversions its tensors need."""

    arch: str  # gguf.MODEL_ARCH_NAMES value
    permute_qk: bool = False
    norm_shift: float = 0.0
    softcaps: bool = False  # Gemma 2: attention and final logit soft-caps
    sliding_pattern: bool = False  # Gemma 2/3: per-layer sliding-window pattern
    moe: Optional[MoE] = None  # a mixture of experts: the family's layout of them (gguf_experts)
    family: str = ""  # the family record's name


GGUF_FAMILIES: dict[str, GGUFFamily] = {
    model_type: GGUFFamily(f.gguf.arch, permute_qk=f.gguf.permute_qk, norm_shift=1.0 if f.gemma_norm else 0.0,
                           softcaps=f.gguf.attn_softcap, sliding_pattern=f.gguf.sliding_pattern, moe=f.moe, family=f.name)
    for f in FAMILIES.values() if f.gguf is not None for model_type in f.model_types
}


def gguf_family(config: Any) -> GGUFFamily:
    """The table row for a Hugging Face config; raises naming the supported ones otherwise."""
    model_type = getattr(config, "model_type", None)
    row = GGUF_FAMILIES.get(model_type)
    if row is None:
        supported = ", ".join(sorted(GGUF_FAMILIES))
        raise ExportError(
            f"GGUF export does not support model_type={model_type!r}. Supported: {supported}. "
            "You can still save it with model.save_pretrained_merged(folder, tokenizer) and convert that "
            "folder with llama.cpp's convert_hf_to_gguf.py."
        )
    if row.moe is not None:
        from .gguf_experts import check_llama_cpp_moe

        check_llama_cpp_moe(config, row.family, row.moe)
    return row


def permute_for_llama_rope(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of a q/k projection (or bias) from rotate-half to adjacent-pair RoPE order."""
    rows = weight.shape[0]
    head = rows // n_heads
    return weight.reshape(n_heads, 2, head // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def unpermute_for_llama_rope(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`permute_for_llama_rope`: adjacent-pair rows back to rotate-half order."""
    rows = weight.shape[0]
    head = rows // n_heads
    return weight.reshape(n_heads, head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def llama3_rope_factors(head_dim: int, rope: dict) -> torch.Tensor:
    """The ``rope_freqs`` divisors of Llama 3's RoPE scaling (fp32, ``head_dim / 2`` values)."""
    base = float(rope.get("rope_theta", 10000.0))
    factor = float(rope.get("factor", 8.0))
    low = float(rope.get("low_freq_factor", 1.0))
    high = float(rope.get("high_freq_factor", 4.0))
    original = float(rope.get("original_max_position_embeddings", 8192))
    lambda_lo, lambda_hi = original / low, original / high
    factors = []
    for i in range(0, head_dim, 2):
        theta = base ** (-i / head_dim)
        wavelength = 2 * math.pi / theta
        if wavelength < lambda_hi:
            factors.append(1.0)
        elif wavelength > lambda_lo:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def rope_parameters(config: Any, layer_type: Optional[str] = None) -> dict:
    """The RoPE settings of a config (transformers 5's ``rope_parameters``, or 4.x's fields)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        params.setdefault("rope_type", params.get("type", "default"))
    if layer_type is not None and layer_type in params:
        return dict(params[layer_type])
    if "full_attention" in params:
        return dict(params["full_attention"])
    return dict(params)


def add_yarn_metadata(writer: Any, rope: dict) -> None:
    """YaRN RoPE scaling (gpt-oss): llama.cpp's ``rope.scaling`` keys (type, factor, original context, the
    two betas). Both scale attention by ``0.1 ln(factor) + 1``; llama.cpp always rounds the ramp's
    correction range outwards (``floor`` / ``ceil``), transformers only with ``truncate=True``."""
    import warnings

    import gguf

    if rope.get("truncate", True) is False:
        warnings.warn(
            "This model's YaRN RoPE has truncate=False (gpt-oss): transformers keeps the ramp's correction range "
            "unrounded, llama.cpp rounds it outwards, so llama.cpp's positions differ slightly from transformers' "
            "(measured on tiny gpt-oss with gpt-oss's YaRN settings, f32 file, short prompts: 2e-4 of the largest "
            "logit, against 4e-7 with truncate=True). The GGUF is what llama.cpp's own converter writes.",
            stacklevel=3)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    writer.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast", 32.0)))
    writer.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow", 1.0)))
