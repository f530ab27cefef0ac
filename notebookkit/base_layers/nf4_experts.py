"""A mixture of experts' stacked expert weight (``experts.gate_up_proj`` / ``down_proj``, 3-D) held in NF4.

bitsandbytes quantises ``nn.Linear`` only, so under ``load_in_4bit`` the stacked experts, most of a MoE
model, would stay 16-bit. :func:`quantize_expert_param` quantises one such parameter in the format of the
project's 4-bit linears (:mod:`notebookkit.export.nf4_quantize`: NF4, blocks of 64 over the parameter's flat
order, nested absmax in blocks of 256, as bitsandbytes' ``Params4bit`` with double quantisation)::

    W.flat[i] ~ NF4[code(i)] * absmax[i // 64],   absmax[b] = code2[q[b]] * absmax2[b // 256] + offset

and returns an :class:`NF4ExpertParam`: an ``nn.Parameter`` (so PEFT's ``target_parameters`` finds it among
the experts module's parameters and wraps it in its ``ParamWrapper``) whose data is the packed codes
(``uint8 [ceil(n / 2), 1]``, as ``Params4bit``) and whose ``quant_state`` holds the scales. PEFT reads a
targeted parameter's shape as ``getattr(param, "ds_shape", param.shape)`` (peft 0.21,
``ParamWrapper._get_in_out_features``; ``ds_shape`` is where DeepSpeed ZeRO-3 keeps a partitioned
parameter's real shape): the parameter sets ``ds_shape`` to the 16-bit weight's shape, so PEFT makes the
same ``lora_A [r E, in]`` / ``lora_B [out, r E]`` as on the 16-bit weight, and adapters save and load as
PEFT's. Being uint8, the parameter leaves PEFT's adapters in fp32 (PEFT casts them to a floating base's dtype).

The grouped expert kernel reads it through :func:`notebookkit.kernels.nf4_stacked.nf4_stacked` (the tiles
decoded in the kernel's weight loads); any code that would use it as a dense tensor (Hugging Face's own
experts forward, PEFT's ``W + s B A``) cannot, and the patched block says so.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

__all__ = ["NF4ExpertParam", "quantize_expert_param", "is_nf4_expert_param"]


def _move_state(state: Any, device: torch.device) -> None:
    """Move every tensor of an ``NF4Weight`` quant state to ``device``, in place."""
    for name in ("packed", "absmax", "offset", "code"):
        setattr(state, name, getattr(state, name).to(device))
    state.state2.absmax = state.state2.absmax.to(device)
    state.state2.code = state.state2.code.to(device)


class NF4ExpertParam(nn.Parameter):
    """A frozen stacked expert weight in NF4 (module docstring): ``data`` the packed codes, ``quant_state`` the
    ``NF4Weight`` (its ``shape`` and ``dtype`` those of the 16-bit weight), ``ds_shape`` that shape for PEFT."""

    def __new__(cls, packed: torch.Tensor, quant_state: Any):
        self = torch.Tensor._make_subclass(cls, packed, False)
        self.quant_state = quant_state
        self.ds_shape = torch.Size(quant_state.shape)
        return self

    def to(self, *args: Any, **kwargs: Any):  # nn.Module.to / .cuda() move the scales with the codes
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is None or device == self.device:
            return self
        _move_state(self.quant_state, device)
        self.quant_state.packed = self.data.to(device)
        return NF4ExpertParam(self.quant_state.packed, self.quant_state)

    def __deepcopy__(self, memo: dict) -> "NF4ExpertParam":
        state = copy.deepcopy(self.quant_state, memo)
        state.packed = self.data.clone()
        return NF4ExpertParam(state.packed, state)

    def __reduce_ex__(self, protocol: int):
        return NF4ExpertParam, (self.data, self.quant_state)

    def __repr__(self) -> str:
        return (f"NF4ExpertParam(shape={tuple(self.ds_shape)}, {self.quant_state.dtype} in NF4, "
                f"{self.numel()} bytes of codes)")


def is_nf4_expert_param(t: Any) -> bool:
    return isinstance(t, NF4ExpertParam)


@torch.no_grad()
def quantize_expert_param(weight: torch.Tensor) -> NF4ExpertParam:
    """``weight`` (a stacked 3-D expert weight, 16-bit or fp32) in NF4 on its own device; decodes to its dtype.
    The caller drops its last reference to ``weight`` to release the 16-bit copy."""
    from notebookkit.export.nf4_quantize import quantize_nf4

    if weight.dim() != 3 or not weight.is_floating_point():
        raise ValueError(f"quantize_expert_param: a stacked expert weight is a floating-point [experts, a, b] tensor, "
                         f"got {weight.dtype} {tuple(weight.shape)}.")
    state = quantize_nf4(weight.detach(), dtype=weight.dtype)
    return NF4ExpertParam(state.packed, state)

