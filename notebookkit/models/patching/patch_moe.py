"""Sparse mixture-of-experts blocks (Qwen3-MoE, gpt-oss) -> ``kernels.moe_experts``.

A block computes, for the tokens ``x [T, H]`` of a batch (its family's :class:`notebookkit.families.MoE`)::

    z, w, idx = router(x)                                   fp32 routing (:mod:`.moe_routing`)
    y_t = sum_j w[t, j] expert_{idx[t, j]}(x_t)             one grouped call (kernels.moe_experts)

The router is rebound to :func:`.moe_routing.route`; the block's forward calls it (so Hugging Face's
hooks still record the logits for the load-balancing loss) and hands the experts to
:func:`notebookkit.kernels.moe_experts.moe_expert_mlp`. The experts' LoRA is PEFT's own:
``LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])`` wraps the
experts module in one ``ParamWrapper`` per stacked weight; the forward reads their factors through
:func:`~notebookkit.kernels.moe_experts.peft_expert_lora` (views, so gradients land in PEFT's
parameters and adapters save and load as PEFT's) and never lets PEFT fold ``W + s B A``.

The block falls back to the experts' own forward (stock Hugging Face and PEFT code, same result)
when the adapters are not one plain LoRA a stacked weight (several active adapters, DoRA, an adapter
on another parameter) or the expert weights are trainable; :func:`experts_status` says why. NF4 expert
weights (``load_in_4bit``, :mod:`notebookkit.base_layers.nf4_experts`) go to the kernel as
:class:`~notebookkit.kernels.nf4_stacked.NF4Stacked` views; stock code cannot read them, so there the block
raises, saying why and what to change (:func:`check_stock_experts`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn as nn

from notebookkit.base_layers.kernel_ops import kernel
from notebookkit.base_layers.nf4_experts import is_nf4_expert_param
from notebookkit.base_layers.rebinding import rebind
from notebookkit.expert_chunks import chunk_budget
from notebookkit.families import MoE
from notebookkit.memory.model_setup import record_expert_chunk_budget, recorded_expert_chunk_budget

from ..common.architectures import lookup
from .lora_parts import lora_parts
from .moe_routing import patch_router, router_ready

STACKED = ("gate_up_proj", "down_proj")


class ExpertsView(NamedTuple):
    """The tensors of one experts module as ``moe_expert_mlp`` takes them (``[E, 2I, H]``, ``[E, H, I]``)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: Optional[torch.Tensor]
    down_bias: Optional[torch.Tensor]
    gate_up_lora: Any
    down_lora: Any
    alpha: float
    limit: float


def unwrap_experts(experts: nn.Module) -> tuple[nn.Module, dict[str, nn.Module]]:
    """(the Hugging Face experts module, PEFT's ``ParamWrapper`` of each adapted parameter by name).

    PEFT nests one wrapper a parameter: ``ParamWrapper(ParamWrapper(experts))``."""
    wrappers: dict[str, nn.Module] = {}
    module = experts
    while hasattr(module, "parameter_name") and hasattr(module, "lora_A") and hasattr(module, "base_layer"):
        wrappers[module.parameter_name] = module
        module = module.base_layer
    return module, wrappers


def experts_view(
    experts: nn.Module, moe: MoE, cast: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> tuple[Optional[ExpertsView], Optional[str]]:
    """An :class:`ExpertsView` of ``experts`` (PEFT-wrapped or not), or the reason the block runs stock code.

    ``cast``: applied to PEFT's ``lora_A.weight`` / ``lora_B.weight`` before their expert views are taken
    (the decode path passes its kept adapter casts, :class:`notebookkit.models.generation.projections.AdapterCasts`);
    ``None`` views the parameters themselves (training: the gradients land in them)."""
    peft_expert_lora = kernel("moe_experts", "peft_expert_lora")
    expert_lora = kernel("moe_experts", "expert_lora")
    if peft_expert_lora is None or expert_lora is None:
        return None, "notebookkit.kernels.moe_experts is unavailable"
    base, wrappers = unwrap_experts(experts)
    loras: dict[str, Any] = {}
    for name, wrapper in wrappers.items():
        if name not in STACKED:
            return None, f"LoRA on the experts' {name} (the fused experts adapt gate_up_proj and down_proj only)"
        parts, reason = lora_parts(wrapper)
        if reason is not None:
            return None, reason
        if parts is not None:
            active = [a for a in wrapper.active_adapters if a in wrapper.lora_A][0]
            if cast is None:
                loras[name] = peft_expert_lora(wrapper, active)
            else:
                loras[name] = expert_lora(cast(wrapper.lora_A[active].weight), cast(wrapper.lora_B[active].weight),
                                          wrapper.num_experts, wrapper.scaling[active])
    gate_up, down = base.gate_up_proj, base.down_proj
    if gate_up.requires_grad or down.requires_grad:
        return None, "the expert weights are trainable (full fine-tuning)"
    if is_nf4_expert_param(gate_up) or is_nf4_expert_param(down):
        nf4_stacked = kernel("nf4_stacked", "nf4_stacked")
        if nf4_stacked is None:
            return None, "notebookkit.kernels.nf4_stacked is unavailable"
        # stored [E, in, out] (gpt-oss) is seen as [E, out, in] through the view's element strides; a
        # training-sized call decodes chunks of experts as large as the activation plan allows (else this card)
        chunk = chunk_budget(gate_up.device, recorded_expert_chunk_budget(base))
        gate_up, down = (nf4_stacked(w.data, w.quant_state, transposed=moe.transposed, chunk_bytes=chunk)
                         if is_nf4_expert_param(w) else (w.transpose(1, 2) if moe.transposed else w)
                         for w in (gate_up, down))
    elif moe.transposed:  # stored [E, in, out]: the kernel reads the transposed views through their strides
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    biases = (base.gate_up_proj_bias, base.down_proj_bias) if moe.expert_bias else (None, None)
    if any(b is not None and b.requires_grad for b in biases):
        return None, "the expert biases are trainable"
    return ExpertsView(gate_up, down, *biases, loras.get("gate_up_proj"), loras.get("down_proj"),
                       float(getattr(base, "alpha", 1.702)), float(getattr(base, "limit", 7.0))), None


def make_moe_forward(moe: MoE):
    """The patched forward of a sparse MoE block of family layout ``moe``."""
    moe_expert_mlp = kernel("moe_experts", "moe_expert_mlp")

    def moe_forward(self: nn.Module, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, idx = getattr(self, moe.router)(x)
        experts = getattr(self, moe.experts)
        view, reason = experts_view(experts, moe)
        if view is None:
            check_stock_experts(experts, reason)
            y = experts(x, idx, weights)
        else:
            y = moe_expert_mlp(x, idx, weights, view.gate_up, view.down, view.gate_up_bias, view.down_bias,
                               view.gate_up_lora, view.down_lora, activation=moe.activation,
                               alpha=view.alpha, limit=view.limit)
        y = y.reshape(shape)
        return (y, weights) if moe.returns_scores else y

    return moe_forward


def check_stock_experts(experts: nn.Module, reason: Optional[str]) -> None:
    """Refuse to run the experts' own (Hugging Face / PEFT) forward on NF4 expert weights, which it would read
    as dense tensors: say why the fused kernel was not used and what to change."""
    base, _ = unwrap_experts(experts)
    if any(is_nf4_expert_param(getattr(base, n, None)) for n in STACKED):
        raise RuntimeError(
            f"This model's expert weights were loaded in NF4 (load_in_4bit=True), which only notebookkit's fused "
            f"experts kernel reads, but this block cannot use it: {reason}. Either change that (one plain LoRA "
            "adapter a stacked weight, on gate_up_proj / down_proj, frozen experts), or reload the model with "
            "load_in_4bit=False to run the experts in 16-bit on Hugging Face's code.")


def moe_ready(block: nn.Module, moe: MoE) -> Optional[str]:
    """None when ``block`` is a sparse MoE block of layout ``moe`` that can be patched, else the reason."""
    if kernel("moe_experts", "moe_expert_mlp") is None:
        return "notebookkit.kernels.moe_experts is unavailable"
    reason = router_ready(getattr(block, moe.router, None), moe.router_bias)
    if reason is not None:
        return reason
    base, _ = unwrap_experts(getattr(block, moe.experts, nn.Module()))
    missing = [n for n in STACKED if not isinstance(getattr(base, n, None), torch.Tensor)]
    if missing:
        return f"{type(base).__name__} has no stacked {', '.join(missing)}"
    return None


def is_moe_block(block: Optional[nn.Module], moe: MoE) -> bool:
    """Whether ``block`` (a decoder layer's ``mlp``) is the family's sparse block, not a dense MLP."""
    return block is not None and hasattr(block, moe.router) and hasattr(block, moe.experts)


def patch_moe(block: nn.Module, moe: MoE) -> None:
    """Rebind one sparse MoE block and its router."""
    patch_router(getattr(block, moe.router), moe.routing)
    rebind(block, make_moe_forward(moe), "moe")


def record_chunk_budgets(model: nn.Module, layers: list[nn.Module], budget: Optional[int]) -> None:
    """Record ``budget`` (bytes of NF4 experts decoded at a time, the one an ``"auto"`` activation plan counted;
    ``None``: the card's own) on the experts of each sparse block among ``model``'s decoder ``layers``."""
    spec = lookup(getattr(model, "config", None))
    if spec is None or spec.moe is None:
        return
    for layer in layers:
        block = getattr(layer, "mlp", None)
        if is_moe_block(block, spec.moe):
            record_expert_chunk_budget(unwrap_experts(getattr(block, spec.moe.experts))[0], budget)


def experts_status(block: nn.Module, moe: MoE) -> Optional[str]:
    """None when the patched block runs its experts on the fused kernel, else why it runs stock code."""
    _, reason = experts_view(getattr(block, moe.experts), moe)
    return reason
