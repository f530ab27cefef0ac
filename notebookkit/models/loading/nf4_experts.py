"""The load step that puts a mixture of experts' stacked expert weights in NF4 under ``load_in_4bit``.

transformers' bitsandbytes integration quantises ``nn.Linear`` layers only; the experts' stacked
``gate_up_proj`` / ``down_proj`` are 3-D parameters (and the routers bare ``[E, H]`` weights) that it leaves in
the compute dtype. The routers are small and stay so. After
the weights are loaded, :func:`quantize_moe_experts` replaces each by an
:class:`~notebookkit.base_layers.nf4_experts.NF4ExpertParam` (NF4, blocks of 64, nested absmax: the format of
the model's 4-bit linears), layer by layer, on the device the weight is on, dropping the 16-bit tensor
before the next one is quantised: the load's peak grows by one stacked weight's quantisation temporaries.

Not done yet: the load itself still places the whole 16-bit model first (transformers' ``from_pretrained``),
so a model whose 16-bit experts do not fit the device does not load; a streamed load that quantises each
stacked weight as it is read (as :mod:`notebookkit.models.low_bit.stream_load` does for 2-bit bases) is the
next step.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from notebookkit.base_layers.nf4_experts import is_nf4_expert_param, quantize_expert_param
from notebookkit.families import Family

from ..common.banner import Banner

__all__ = ["STACKED", "quantize_moe_experts"]

STACKED = ("gate_up_proj", "down_proj")


def _experts_modules(model: nn.Module, family: Family) -> list[nn.Module]:
    moe = family.moe
    found = []
    for module in model.modules():
        if hasattr(module, moe.router) and hasattr(module, moe.experts):
            experts = getattr(module, moe.experts)
            if all(isinstance(getattr(experts, n, None), nn.Parameter) for n in STACKED):
                found.append(experts)
    return found


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def quantize_moe_experts(model: nn.Module, family: Family, banner: Banner) -> int:
    """Quantise every sparse block's stacked expert weights of ``model`` to NF4 in place; returns how many
    weights were quantised (the banner says how many bytes the experts now take)."""
    count = before = after = 0
    for experts in _experts_modules(model, family):
        for name in STACKED:
            weight = getattr(experts, name)
            if is_nf4_expert_param(weight):
                continue
            before += weight.numel() * weight.element_size()
            packed = quantize_expert_param(weight)
            del weight
            setattr(experts, name, packed)  # the module's reference to the 16-bit tensor was the last one
            state = packed.quant_state
            after += sum(t.numel() * t.element_size() for t in (packed.data, state.absmax, state.state2.absmax))
            count += 1
    if count:
        banner.feature("NF4 experts", True, f"{count} stacked expert weights of {family.name} in NF4 (blocks of 64, "
                       f"double quantisation): {_size(before)} -> {_size(after)}; the grouped "
                       "expert kernel decodes their tiles as it reads them")
    return count
