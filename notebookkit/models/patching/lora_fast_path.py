"""Which linear layers can run on the fused LoRA kernels, and their ``LoRAProjection`` views.

A projection ``y = x W^T + b + s * (x A^T) B^T`` is handed to the fused kernels
(``lora_qkv``, ``lora_o``, ``lora_mlp``) as a ``LoRAProjection(weight, quant_state, lora_A, lora_B,
scaling)``: ``W`` is the frozen base weight (16-bit, or NF4-packed with its bitsandbytes quant
state), ``A``/``B`` are the PEFT parameters themselves (their ``.grad`` lands on PEFT's tensors) and
``s`` is PEFT's scaling (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA). A frozen base bias is
added by the caller after the kernel.

The check is made on every call (it is a few attribute reads), so the same patched forward serves
a model before and after ``get_peft_model``, inside ``disable_adapter()``, and after merging.
A 2-bit or ternary base (``Q2Linear`` / ``TernaryLinear``, :mod:`notebookkit.base_layers.low_bit_linear`) is
handed over as its packed codes with its ``Q2Weight`` / ``TernaryWeight`` in the ``quant_state`` slot; the kernels then
run its products through the dequantise-in-the-GEMM kernels, never a dense weight.
A layer stays on stock PEFT code, and the banner says why, when it has: LoRA dropout > 0 while
training, a trainable bias (``bias="all"``/``"lora_only"``), DoRA, a LoRA bias, several active
adapters, 8-bit base weights, or a base weight that requires grad (full fine-tuning).

FP8 forward (``get_peft_model(..., fp8_base_matmul=True)``, or :func:`set_fp8_base_matmul`): a flag
on each frozen base linear of the decoder layers (the module PEFT keeps as ``base_layer``, so it
holds for a plain, a 4-bit and a LoRA-wrapped projection alike, inside ``disable_adapter()`` and
after ``merge_and_unload``). :func:`projection_view` hands it to the kernels as
``LoRAProjection.fp8_forward`` while the model is in training mode; only the fused path reads it, and
generation or evaluation (eval mode) stays 16-bit.

Reuse within one forward pass: building the views reads a few dozen module attributes, and the
kernels cast fp32 adapters to the compute dtype. Inside a :class:`~.forward_state.ForwardPass` (the
patched backbone opens one per model forward; checkpointing resumes it for the recompute)
:func:`views` builds the views of a group of modules once and hands the same objects to the
recompute, so the recompute and the backward reuse the forward's adapter casts. Outside a pass,
views are built on every call.
A pass id is never reused, so nothing outlives the pass it was built for: a model changed between
two steps (merged, another adapter, eval mode, new weights) gets new views at its next forward. ``generate`` runs
every call in one pass of its generation state, which a new one replaces when the model's signature changes
(:mod:`notebookkit.models.generation.state`), so its views last from call to call. The views'
adapter casts of a pass opened by a patched backbone are made in one batch (:mod:`.adapter_casts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from notebookkit.base_layers.kernel_ops import kernel
from notebookkit.base_layers.low_bit_linear import is_low_bit_linear
from notebookkit.base_layers.rebinding import DroppedOnCopy
from notebookkit.marks import LORA_VIEWS, PATCH_TAG
from notebookkit.memory.model_setup import fp8_forward, set_fp8_forward

from . import forward_state
from .adapter_casts import pass_casts, reuse_latest_copies
from .lora_parts import lora_parts
from ..common.decoder_layers import decoder_layers as _decoder_layers

PROJECTION_NAMES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


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
    if is_low_bit_linear(base):  # 2-bit / ternary: the packed codes and their Q2Weight / TernaryWeight
        return (base.qweight, base.packed_weight(), base.bias), None
    if type(base).__name__ in ("Linear8bitLt",):
        return None, "8-bit base weights have no fused kernel"
    if isinstance(base, nn.Linear):
        if base.weight.requires_grad:
            return None, "base weight is trainable (full fine-tuning)"
        return (base.weight, None, base.bias), None
    return None, f"unsupported layer type {type(base).__name__}"


def projection_view(module: nn.Module, training: Optional[bool] = None) -> tuple[Optional[ProjectionView], Optional[str]]:
    """A :class:`ProjectionView` for ``module`` (plain, 4-bit or PEFT-LoRA linear), or a reason why not.

    ``training`` overrides the module's own mode when judging LoRA dropout and the FP8 forward (the
    banner asks about training even while the model is still in eval mode). The FP8 forward is a
    training-step speed-up: in eval mode (generation, evaluation) the base GEMMs stay 16-bit, since
    quantising every weight for a few decode tokens costs more than it saves.
    """
    make = kernel("lora_projection", "LoRAProjection")
    if make is None:
        return None, "notebookkit.kernels.lora_projection is unavailable"
    lora = None
    base = module
    if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
        lora, reason = lora_parts(module, training)
        if reason is not None:
            return None, reason
        base = module.base_layer
    parts, reason = _base_parts(base)
    if reason is not None:
        return None, reason
    weight, quant_state, bias = parts
    if bias is not None and bias.requires_grad:
        return None, "trainable bias (bias='all' or 'lora_only')"
    fp8 = fp8_forward(base) and (module.training if training is None else training)
    if lora is None:
        proj = make(weight, quant_state, None, None, 1.0, fp8_forward=fp8)
        return ProjectionView(proj, bias, False), None
    lora_a, lora_b, scaling = lora
    proj = make(weight, quant_state, lora_a, lora_b, scaling, fp8_forward=fp8)
    return ProjectionView(proj, bias, True), None


def _base_linears(model: nn.Module) -> list[nn.Module]:
    """The frozen base linear of every q/k/v/o and gate/up/down projection of the decoder layers."""
    out = []
    for layer in _decoder_layers(model):
        for owner_name, names in PROJECTION_NAMES.items():
            owner = getattr(layer, owner_name)
            for name in names:
                module = getattr(owner, name, None)
                if module is None:
                    continue
                out.append(module.base_layer if hasattr(module, "base_layer") else module)
    return out


def set_fp8_base_matmul(model: nn.Module, enabled: bool = True) -> int:
    """Switch the FP8 forward of the base-weight GEMMs on (or off) for a whole model.

    With it on, the fused LoRA kernels compute ``x W^T`` of the forward pass (and of the
    checkpointing recompute) with FP8 e4m3 operands and rowwise scales
    (:mod:`notebookkit.kernels.fp8_matmul`): about twice the bf16 GEMM throughput on sm_89+ GPUs,
    at a relative error of a few percent per product. The LoRA path and the whole backward stay
    in the 16-bit compute dtype. It applies to every q/k/v/o/gate/up/down projection of the decoder
    layers (adapted or not) that runs the fused path; layers on stock PEFT code are unaffected.

    Raises:
        ValueError: ``enabled`` on a GPU without FP8 tensor cores (before sm_89: T4, A100) or a
            device other than CUDA/CPU. CPU is accepted (the product is emulated, for tests).

    Returns:
        the number of projections flagged.
    """
    linears = _base_linears(model)
    if enabled:
        supported = kernel("fp8_matmul", "fp8_supported")
        if supported is None:
            from notebookkit.base_layers.kernel_ops import why_missing

            raise ValueError(f"fp8_base_matmul=True needs notebookkit.kernels.fp8_matmul: {why_missing('fp8_matmul', 'fp8_supported')}")
        devices = {m.weight.device for m in linears if getattr(m, "weight", None) is not None}
        for device in sorted(devices, key=str):
            ok, reason = supported(device)
            if not ok:
                raise ValueError(
                    f"fp8_base_matmul=True cannot run on {device}: {reason} "
                    "Call get_peft_model with fp8_base_matmul=False (the default)."
                )
    for module in linears:
        set_fp8_forward(module, enabled)
    return len(linears) if enabled else 0


def fp8_base_matmul_count(model: nn.Module) -> int:
    """How many decoder projections of ``model`` have the FP8 forward switched on."""
    return sum(1 for m in _base_linears(model) if fp8_forward(m))


_VIEWS_KEPT = LORA_VIEWS


class _KeptViews(DroppedOnCopy):
    """Views of one module group in one pass, kept on the group's first module (never copied or
    pickled with it: a copy gets none)."""

    __slots__ = ("pass_id", "training", "ids", "result")

    def __init__(self, pass_id: int, training: Optional[bool], ids: tuple, result: tuple) -> None:
        self.pass_id, self.training, self.ids, self.result = pass_id, training, ids, result


def views(*modules: nn.Module, training: Optional[bool] = None) -> tuple[Optional[list[ProjectionView]], Optional[str]]:
    """Views of all ``modules``, or ``(None, reason)`` for the first that cannot be fused.

    Inside a forward pass (:mod:`.forward_state`), the result for this group is built once per pass
    and the same objects are returned again (the recompute of a checkpointed layer reuses them and
    their casts). Two passes using one module group at once (two threads) each find the other's
    views, not theirs, and build their own: slower, never wrong.
    """
    forward = forward_state.current()
    if forward is None:  # e.g. Hugging Face's checkpointing recomputing a vision block in the backward
        result = _build_views(modules, training)
        reuse_latest_copies(result[0])  # the latest pass's adapter copies, where still valid
        return result
    kept = modules[0].__dict__.get(_VIEWS_KEPT)
    if (kept is not None and kept.pass_id == forward.id and kept.training == training
            and kept.ids == tuple(map(id, modules))):
        return kept.result
    result = _build_views(modules, training)
    casts = pass_casts(forward)
    if casts is not None:
        casts.fill(result[0])  # this pass's adapter casts, made in one batch (adapter_casts)
    modules[0].__dict__[_VIEWS_KEPT] = _KeptViews(forward.id, training, tuple(map(id, modules)), result)
    return result


def _build_views(modules: tuple, training: Optional[bool]) -> tuple[Optional[list[ProjectionView]], Optional[str]]:
    out = []
    for module in modules:
        view, reason = projection_view(module, training)
        if view is None:
            return None, f"{type(module).__name__}: {reason}"
        out.append(view)
    return out, None


def lora_fast_path_status(model: nn.Module) -> tuple[int, int, list[str]]:
    """(#decoder layers whose attention and MLP run the fused LoRA kernels, #layers, reasons otherwise)."""
    layers = _decoder_layers(model)
    fast = 0
    reasons: list[str] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        mods = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        moe = getattr(mlp, PATCH_TAG, None) == "moe"
        if not moe:
            mods += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(m is None for m in mods):
            reasons.append(f"{type(layer).__name__}: projections not found")
            continue
        _, reason = views(*mods, training=True)
        if reason is None and moe:  # a sparse block: its experts' adapters (patch_moe)
            reason = _moe_experts_reason(model, mlp)
        if reason is None and getattr(mlp, PATCH_TAG, None) and getattr(attn, PATCH_TAG, None):
            fast += 1
        elif reason is not None:
            reasons.append(reason)
        else:
            stock = [what for what, m in (("attention", attn), ("MLP", mlp)) if not getattr(m, PATCH_TAG, None)]
            reasons.append(f"{' and '.join(stock)} not patched (the banner's line above says why)")
    return fast, len(layers), sorted(set(reasons))


def _moe_experts_reason(model: nn.Module, block: nn.Module) -> Optional[str]:
    """Why a patched sparse MoE block runs its experts on stock code, or None (:mod:`.patch_moe`)."""
    from notebookkit.families import for_model_type

    from .patch_moe import experts_status

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    family = for_model_type(getattr(getattr(base, "config", None), "model_type", None))
    if family is None or family.moe is None:
        return None
    reason = experts_status(block, family.moe)
    return None if reason is None else f"experts: {reason}"


def describe_lora(model: nn.Module, banner) -> None:
    """Write the LoRA fast-path line (and the FP8 forward line, when on) of the banner."""
    fast, total, reasons = lora_fast_path_status(model)
    n_fp8 = fp8_base_matmul_count(model)
    if n_fp8:
        banner.feature(
            "FP8 forward", fast > 0,
            f"{n_fp8} base projections compute x W^T in FP8 e4m3 (rowwise scales) in the forward and the "
            "recompute of fused layers; LoRA path and backward stay 16-bit",
        )
    if total == 0:
        banner.feature("LoRA fast path", False, "no decoder layers found: stock PEFT code")
    elif fast == total:
        banner.feature("LoRA fast path", True, f"{fast}/{total} layers run fused QKV, O and MLP LoRA kernels")
    else:
        why = "; ".join(reasons[:3]) or "unknown"
        banner.feature(
            "LoRA fast path", fast > 0, f"{fast}/{total} layers fused; the rest run stock PEFT code because: {why}"
        )
