"""The active adapter of one PEFT LoRA layer as the fused kernels take it: ``(A, B, scaling)``.

Shared by the fused linears (:mod:`.lora_fast_path`: ``lora.Linear``, ``y = x W^T + s (x A^T) B^T``) and the
fused experts (:mod:`.patch_moe`: ``ParamWrapper``, whose ``A``/``B`` hold every expert's factors). A layer
qualifies with one active adapter, unmerged, without DoRA, LoRA bias or active dropout.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn


def lora_parts(module: nn.Module, training: Optional[bool] = None) -> tuple[Optional[tuple[torch.Tensor, torch.Tensor, float]], Optional[str]]:
    """(A, B, scaling) of a PEFT LoRA layer's active adapter, None when inactive, or a reason."""
    if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return None, None
    active = list(getattr(module, "active_adapters", None) or [])
    active = [a for a in active if a in module.lora_A]
    if not active:
        return None, None
    if len(active) > 1:
        return None, "several active adapters"
    name = active[0]
    if getattr(module, "use_dora", {}).get(name, False):
        return None, "DoRA"
    if getattr(module, "lora_bias", {}).get(name, False):
        return None, "lora_bias=True"
    dropout = module.lora_dropout[name] if name in getattr(module, "lora_dropout", {}) else None
    active_dropout = dropout.training if training is None else training
    if isinstance(dropout, nn.Dropout) and dropout.p > 0 and active_dropout:
        return None, f"lora_dropout={dropout.p}"
    lora_a, lora_b = module.lora_A[name], module.lora_B[name]
    if not (isinstance(lora_a, nn.Linear) and isinstance(lora_b, nn.Linear)):
        return None, f"LoRA layer type {type(lora_a).__name__}"
    if lora_a.bias is not None or lora_b.bias is not None:
        return None, "LoRA bias"
    return (lora_a.weight, lora_b.weight, float(module.scaling[name])), None
