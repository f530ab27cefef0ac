"""``from_pretrained(..., offload_embedding=True)``: the input embedding table kept in host memory.

A frozen input embedding is only gathered from: ``h = E[ids]`` reads ``N`` rows of ``H`` values per
forward (``N * H * s`` bytes: 16 MiB for 2,048 tokens of Llama-3.1-8B), while its table is ``V * H * s``
(0.98 GiB there; 1.02 GiB for Qwen2.5-7B). So the table moves to page-locked host memory and the weight
becomes a CUDA view of it (:func:`~notebookkit.memory.host_mapped.host_mapped_cuda_tensor`): the same
``nn.Embedding``, the same parameter object and state-dict key, still ``device="cuda"`` for every
caller (the training forward, the decode path's CUDA graphs, ``model.device``, export), while the GPU
reads the gathered rows over the bus. It saves ``V * H * s`` of GPU memory for a bus read of
``N * H * s`` per forward (under a millisecond for a training batch; a few microseconds per decoded
token).

Not applied, and the banner says why:

* no CUDA device (the model already lives in host memory);
* the embedding is tied to the LM head (Llama 3.2 1B/3B, Gemma): the LM head streams the whole
  table every step, which over the bus would be slow, and the memory is needed on the GPU anyway;
* the embedding is trainable (``full_finetuning``), the model is spread over devices by a
  ``device_map``, or the process is one of a distributed launch (not validated on several GPUs yet);
* this CUDA setup cannot map host memory into the GPU's address space.

Host memory: PyTorch's pinned-memory allocator rounds each block up to a power of two, so the table
takes up to twice its size there (1 GiB for Llama-3.1-8B's 0.98 GiB, 2 GiB for Qwen2.5-7B's 1.02 GiB);
the memory model counts the rounded size.

Training the embedding later (PEFT ``modules_to_save=["embed_tokens"]``) is unaffected: PEFT trains a
copy, which lives in GPU memory, and the frozen original stays in host memory.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.nn as nn

from notebookkit.memory.host_mapped import host_mapped_cuda_tensor
from notebookkit.memory.model_setup import record_host_embedding

from ..common.banner import Banner

__all__ = ["offload_input_embedding", "offload_embedding_value"]

FEATURE = "offload_embedding"


def offload_embedding_value(value: Any) -> bool:
    """``True`` / ``False`` from the keyword; ``"auto"`` (Unsloth's default spelling) is ``False``:
    notebookkit's planner sizes activations to the card and leaves this choice to you."""
    if value in (None, "auto"):
        return False
    if isinstance(value, bool):
        return value
    raise ValueError(
        f"offload_embedding={value!r} is not True or False. offload_embedding=True keeps the input embedding "
        "table in host memory (saving its size on the GPU); the default False keeps it on the GPU."
    )


def offload_input_embedding(model: nn.Module, banner: Optional[Banner] = None) -> int:
    """Move ``model``'s input embedding table to host memory, read in place by the GPU (module docstring).

    Returns the GPU bytes freed (0 when not applied; the banner, when given, says why).
    """
    reason = _why_not(model)
    embed = model.get_input_embeddings() if reason is None else None
    freed = 0
    if embed is not None:
        weight = embed.weight
        host = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=True)
        host.copy_(weight.detach())
        try:
            view = host_mapped_cuda_tensor(host, weight.device)
        except Exception as exc:  # noqa: BLE001 - any refusal leaves the table where it was, said in the banner
            reason = f"this CUDA setup cannot read host memory from the GPU ({type(exc).__name__}: {exc})"
        else:
            freed = weight.numel() * weight.element_size()
            weight.data = view
            record_host_embedding(embed, True)
            torch.cuda.empty_cache()  # hand the table's old block back to the driver (nvidia-smi shows it free)
    if banner is not None:
        if freed:
            banner.feature(FEATURE, True, f"input embedding ({_gib(freed)}) in pinned host memory, "
                                          "read by the GPU in place")
        else:
            banner.feature(FEATURE, False, reason or "not applied")
    return freed


def _why_not(model: nn.Module) -> Optional[str]:
    """Why the input embedding of ``model`` cannot move to host memory (``None``: it can)."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return "the model has no input embedding table"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None and \
            head.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
        return ("the input embedding is tied to the LM head, which reads the whole table every step: "
                "it stays on the GPU")
    if weight.requires_grad:
        return "the input embedding is trainable (full_finetuning): it stays on the GPU"
    devices = set(getattr(model, "hf_device_map", {}).values() or ())
    if len(devices) > 1:
        return "device_map spreads the model over several devices: the embedding stays where it was placed"
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        return (f"a distributed launch (WORLD_SIZE={world}): data parallelism with a host-side table is not "
                "validated yet, so the embedding stays on each GPU")
    if weight.device.type != "cuda":
        return f"the model is on {weight.device.type}, not a CUDA GPU: nothing to save"
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
