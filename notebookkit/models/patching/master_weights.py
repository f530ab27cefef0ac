"""fp16 training: every trainable parameter is an fp32 master weight (one rule, applied in the forward).

fp16 mixed precision (the T4's only 16-bit type) trains under a loss scaler: the loss is multiplied
by ``S`` (65536 at first), the gradients come out scaled, and before the optimizer step
``torch.amp.GradScaler.unscale_`` divides them by ``S`` and checks them for inf/NaN. It refuses
16-bit gradients ("Attempting to unscale FP16 gradients"; there is no bf16 kernel either), and an
fp16 weight could not take an update ``lr * m / sqrt(v)`` much smaller than its own rounding step
anyway. So in a model that computes in fp16, the trainable parameters must be fp32; the fused
kernels cast them to fp16 where they are used (LoRA ``A``/``B`` once per step).

Many things make a parameter trainable after the model was prepared, and not all leave it fp32:
TRL's trainers cast a quantised model's adapters to bf16 at construction (the QLoRA paper's choice,
for bf16 cards), :func:`notebookkit.train.train_token_rows` makes the fp16 embedding trainable
inside a ``with`` block, a user sets ``requires_grad`` by hand. Rather than one fix per trainer,
:func:`keep_trainable_fp32` runs at the start of every training forward of a patched model (the
backbone's forward, which every trainer calls, TRL's own LM-head path included; the vision
wrapper's forward): each trainable fp16/bf16 parameter becomes fp32 in place (``param.data``, so
an optimizer already built keeps the same object; its state is created at the first step, after
this first forward). Values are kept exactly (a bf16 or fp16 value is an fp32 value).

A module whose weight became an fp32 master keeps taking and giving fp16: an embedding's rows are
handed back in fp16 (else an fp32 residual stream would reach fp16 layers and double what the memory
model counts), and any other module (a tied or trainable LM head) casts its input up and its output
back down. The layers around it, and the decode path's KV cache, keep the model's fp16.

A model notebookkit did not patch (the plain-PEFT side of :func:`notebookkit.train.calibrate`) gets
the same function as a forward pre-hook: :func:`hold_fp32_masters`.

Models that compute in bf16 or fp32 are left alone (bf16 trains without a scaler; TRL's bf16
adapters are its choice there).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn as nn

from notebookkit.marks import FP32_MASTER_HOOKS

__all__ = ["computes_in_fp16", "hold_fp32_masters", "keep_trainable_fp32"]

_HALF = (torch.float16, torch.bfloat16)


def _frozen_float_dtypes(model: nn.Module) -> Iterator[torch.dtype]:
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point():
            yield param.dtype


def computes_in_fp16(model: nn.Module) -> bool:
    """Whether ``model``'s frozen weights (norms, embeddings, 16-bit or 4-bit linears' companions) are fp16.

    4-bit weights are stored as ``uint8`` and not counted; a model with nothing frozen (full
    fine-tuning) is not an fp16 LoRA model and returns ``False``.
    """
    return next(_frozen_float_dtypes(model), None) == torch.float16


def _fp16_out(module: nn.Module, args: tuple, output: Any) -> Any:
    """Forward hook: floating outputs back to fp16 (what the layers around the module compute in)."""
    return output.half() if isinstance(output, torch.Tensor) and output.is_floating_point() else output


def _weight_dtype_in(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: floating inputs to the dtype of the module's weight (outside autocast a 16-bit input
    and an fp32 master weight cannot meet in one product; once the weight is 16-bit again, nothing changes)."""
    dtype = module.weight.dtype
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


_HOOKS = FP32_MASTER_HOOKS


def _island(module: nn.Module) -> None:
    """Make ``module``, whose weight is now an fp32 master, take and give fp16 like the rest of the model (once).

    An embedding only needs its rows handed back in fp16; any other module (a tied or trainable LM head, a
    ``modules_to_save`` copy) computes in fp32 and hands back fp16. A tied table is held by two modules: each
    gets its hook.
    """
    if _HOOKS in module.__dict__:
        return
    handles = [module.register_forward_hook(_fp16_out)]
    if not isinstance(module, nn.Embedding) and isinstance(getattr(module, "weight", None), torch.Tensor):
        handles.append(module.register_forward_pre_hook(_weight_dtype_in))
    object.__setattr__(module, _HOOKS, handles)


def keep_trainable_fp32(model: nn.Module) -> int:
    """In a model that computes in fp16, cast every trainable fp16/bf16 parameter to fp32 in place.

    Returns how many parameters were cast (0 when the model computes in bf16/fp32, or when all its
    trainable parameters already are fp32). A module whose weight is cast (an embedding made trainable, a
    tied LM head) still takes and gives fp16 (forward hooks), so the layers around it compute as before and
    the decode cache keeps its dtype.
    """
    if not computes_in_fp16(model) or not any(p.requires_grad and p.dtype in _HALF for p in model.parameters()):
        return 0
    cast = {}
    for param in model.parameters():
        if param.requires_grad and param.dtype in _HALF:
            param.data = param.data.float()
            cast[id(param)] = param
    for name, module in model.named_modules():
        if any(id(p) in cast for p in module.parameters(recurse=False)) and not _ADAPTER_PARTS & set(name.split(".")):
            _island(module)
    return len(cast)


#: LoRA's own modules: PEFT casts their input to the adapter's dtype itself (fp32 adapters under a 16-bit
#: model are PEFT's default), and the fused kernels cast the adapters once per step; they need no hooks
_ADAPTER_PARTS = {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"}


def _before_training_forward(module: nn.Module, args: tuple) -> None:
    if module.training and torch.is_grad_enabled():
        keep_trainable_fp32(module)


def hold_fp32_masters(model: nn.Module) -> torch.utils.hooks.RemovableHandle:
    """Apply :func:`keep_trainable_fp32` before every training forward of a model notebookkit did not
    patch (patched models do it in their own forward). Returns the hook's handle."""
    return model.register_forward_pre_hook(_before_training_forward)
