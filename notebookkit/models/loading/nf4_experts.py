"""The load step that puts a mixture of experts' stacked expert weights in NF4 under ``load_in_4bit``.

transformers' bitsandbytes integration quantises ``nn.Linear`` layers only; the experts' stacked
``gate_up_proj`` / ``down_proj`` are 3-D parameters (and the routers bare ``[E, H]`` weights) that it leaves in
the compute dtype. The routers are small and stay so. Each stacked weight becomes an
:class:`~notebookkit.base_layers.nf4_experts.NF4ExpertParam` (NF4, blocks of 64, nested absmax: the format of
the model's 4-bit linears):

* as it is read, by :mod:`.stream_nf4_experts` around transformers' ``from_pretrained`` (the loader's path):
  the 16-bit experts never all exist, on the device or the host;
* after the load, by :func:`quantize_moe_experts`, for whatever is still in 16 bits (none on the loader's path
  with transformers 5; the whole set was then in memory first), layer by layer on the device the weight is
  on, dropping the 16-bit tensor before the next one is quantised.

:func:`quantize_moe_experts` writes the banner line for both: how many, how, and the bytes before and after.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from notebookkit.base_layers.nf4_experts import is_nf4_expert_param, quantize_expert_param
from notebookkit.families import Family

from ..common.banner import Banner
from .stream_nf4_experts import STACKED, ExpertTally

__all__ = ["STACKED", "quantize_moe_experts"]


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


def quantize_moe_experts(model: nn.Module, family: Family, banner: Banner, read: Optional[ExpertTally] = None) -> int:
    """Quantise every sparse block's stacked expert weight of ``model`` still in 16 bits to NF4 in place;
    ``read``: those :func:`.stream_nf4_experts.quantize_experts_as_read` already put in NF4 as they were read.
    Returns how many weights are in NF4 in all; the banner says how, and their bytes before and after."""
    read = read if read is not None else ExpertTally()
    late = ExpertTally()
    for experts in _experts_modules(model, family):
        for name in STACKED:
            weight = getattr(experts, name)
            if is_nf4_expert_param(weight):
                continue
            packed = quantize_expert_param(weight)
            late.add(weight, packed)
            del weight
            setattr(experts, name, packed)  # the module's reference to the 16-bit tensor was the last one
    count = read.count + late.count
    if count:
        if late.count == 0:
            how = "each quantised as it was read (the 16-bit experts never all in memory)"
        elif read.count == 0:
            how = "quantised after the load (all 16-bit experts were in memory first)"
        else:
            how = (f"{read.count} quantised as read, {late.count} after the load (those were all in memory in "
                   "16 bits first)")
        banner.feature("NF4 experts", True, f"{count} stacked expert weights of {family.name} in NF4 (blocks of 64, "
                       f"double quantisation), {how}: {_size(read.before + late.before)} -> "
                       f"{_size(read.after + late.after)}; the grouped expert kernel decodes their tiles as it "
                       "reads them")
    return count
