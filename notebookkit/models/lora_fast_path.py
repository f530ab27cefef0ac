"""Which linear layers can run on the fused LoRA kernels, and their ``LoRAProjection`` views.

A projection ``y = x W^T + b + s * (x A^T) B^T`` is handed to the fused kernels
(``lora_qkv``, ``lora_o``, ``lora_mlp``) as a ``LoRAProjection(weight, quant_state, lora_A, lora_B,
scaling)``: ``W`` is the frozen base weight (16-bit, or NF4-packed with its bitsandbytes quant
state), ``A``/``B`` are the PEFT parameters themselves (their ``.grad`` lands on PEFT's tensors) and
``s`` is PEFT's scaling (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA). A frozen base bias is
added by the caller after the kernel.

The check is made on every call (it is a few attribute reads), so the same patched forward serves
a model before and after ``get_peft_model``, inside ``disable_adapter()``, and after merging.
A layer stays on stock PEFT code, and the banner says why, when it has: LoRA dropout > 0 while
training, a trainable bias (``bias="all"``/``"lora_only"``), DoRA, a LoRA bias, several active
adapters, 8-bit base weights, or a base weight that requires grad (full fine-tuning).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from .kernel_ops import kernel


@dataclass
class ProjectionView:
    """A linear layer seen by the fused path: the kernel's projection plus a base bias to add."""

    projection: Any
    bias: Optional[torch.Tensor]
    has_lora: bool


def _is_linear4bit(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Linear4bit" and getattr(weight, "quant_state", None) is not None


def _base_parts(base: nn.Module) -> tuple[Optional[tuple[torch.Tensor, Any, Optional[torch.Tensor]]], Optional[str]]:
    """(weight, quant_state, bias) of a frozen base linear, or a reason it cannot be used."""
    if _is_linear4bit(base):
        weight = base.weight
        return (weight, weight.quant_state, base.bias), None
    if type(base).__name__ in ("Linear8bitLt",):
        return None, "8-bit base weights have no fused kernel"
    if isinstance(base, nn.Linear):
        if base.weight.requires_grad:
            return None, "base weight is trainable (full fine-tuning)"
        return (base.weight, None, base.bias), None
    return None, f"unsupported layer type {type(base).__name__}"


def _lora_parts(module: nn.Module, training: Optional[bool] = None) -> tuple[Optional[tuple[torch.Tensor, torch.Tensor, float]], Optional[str]]:
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


def projection_view(module: nn.Module, training: Optional[bool] = None) -> tuple[Optional[ProjectionView], Optional[str]]:
    """A :class:`ProjectionView` for ``module`` (plain, 4-bit or PEFT-LoRA linear), or a reason why not.

    ``training`` overrides the module's own mode when judging LoRA dropout (the banner asks about
    training even while the model is still in eval mode).
    """
    make = kernel("lora_projection", "LoRAProjection")
    if make is None:
        return None, "notebookkit.kernels.lora_projection is unavailable"
    lora = None
    base = module
    if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
        lora, reason = _lora_parts(module, training)
        if reason is not None:
            return None, reason
        base = module.base_layer
    parts, reason = _base_parts(base)
    if reason is not None:
        return None, reason
    weight, quant_state, bias = parts
    if bias is not None and bias.requires_grad:
        return None, "trainable bias (bias='all' or 'lora_only')"
    if lora is None:
        proj = make(weight, quant_state, None, None, 1.0)
        return ProjectionView(proj, bias, False), None
    lora_a, lora_b, scaling = lora
    proj = make(weight, quant_state, lora_a, lora_b, scaling)
    return ProjectionView(proj, bias, True), None


def views(*modules: nn.Module, training: Optional[bool] = None) -> tuple[Optional[list[ProjectionView]], Optional[str]]:
    """Views of all ``modules``, or ``(None, reason)`` for the first that cannot be fused."""
    out = []
    for module in modules:
        view, reason = projection_view(module, training)
        if view is None:
            return None, f"{type(module).__name__}: {reason}"
        out.append(view)
    return out, None


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = []
    for module in model.modules():
        if hasattr(module, "self_attn") and hasattr(module, "mlp"):
            layers.append(module)
    return layers


def lora_fast_path_status(model: nn.Module) -> tuple[int, int, list[str]]:
    """(#decoder layers whose attention and MLP run the fused LoRA kernels, #layers, reasons otherwise)."""
    layers = _decoder_layers(model)
    fast = 0
    reasons: list[str] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        mods = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        mods += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(m is None for m in mods):
            reasons.append(f"{type(layer).__name__}: projections not found")
            continue
        _, reason = views(*mods, training=True)
        if reason is None and getattr(mlp, "_notebookkit_patch", None) and getattr(attn, "_notebookkit_patch", None):
            fast += 1
        elif reason is not None:
            reasons.append(reason)
        else:
            reasons.append("attention/MLP not patched")
    return fast, len(layers), sorted(set(reasons))


def describe_lora(model: nn.Module, banner) -> None:
    """Write the LoRA fast-path line of the banner for a PEFT-wrapped model."""
    fast, total, reasons = lora_fast_path_status(model)
    if total == 0:
        banner.feature("LoRA fast path", False, "no decoder layers found: stock PEFT code")
    elif fast == total:
        banner.feature("LoRA fast path", True, f"{fast}/{total} layers run fused QKV, O and MLP LoRA kernels")
    else:
        why = "; ".join(reasons[:3]) or "unknown"
        banner.feature(
            "LoRA fast path", fast > 0, f"{fast}/{total} layers fused; the rest run stock PEFT code because: {why}"
        )
