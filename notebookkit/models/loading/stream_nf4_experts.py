"""Put a mixture of experts' stacked expert weights in NF4 while transformers loads them, one weight at a time.

Why: under ``load_in_4bit`` bitsandbytes quantises the ``nn.Linear`` layers as they load, but the experts'
stacked ``gate_up_proj`` / ``down_proj`` (3-D, most of the model) are loaded in the compute dtype. Quantised
only after the load, they would all exist in 16 bits first: gpt-oss-20b's are ~38 GB, more than a T4 and its
host hold together.

How: transformers 5 (checked: 5.17, 5.24) builds the model on the meta device and, under a quantisation config
applied on the fly, loads the checkpoint one target parameter at a time, in key order, with no reading threads:
read from its safetensors file, put on its device (Qwen3-MoE's per-expert ``experts.{e}.gate_proj`` /
``up_proj`` / ``down_proj`` stacked into the parameter first, by transformers' conversion mapping of the family),
then ``setattr`` on its module, which goes through ``nn.Module.register_parameter``. Inside
:func:`quantize_experts_as_read` a global parameter-registration hook (torch's public
``register_module_parameter_registration_hook``) sees each registration; a floating-point 3-D ``gate_up_proj``
/ ``down_proj`` of an experts module (one holding both) is replaced by
:func:`~notebookkit.base_layers.nf4_experts.quantize_expert_param` of it before the module keeps it. Nothing
else holds the 16-bit weight once transformers moves on to the next parameter, so::

    peak = the NF4 model so far + one stacked weight (+ its per-expert pieces while stacked) + its quantisation
           temporaries

instead of the NF4 model + every 16-bit stacked weight. The codes are those of quantising after the load (same
function, same tensor, same device); the meta-device registrations of the model's construction are left alone.
Anything the hook did not see (another loader, an older transformers that sets parameters otherwise) stays in
16 bits and is quantised after the load by :func:`.nf4_experts.quantize_moe_experts`, which says so.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn

from notebookkit.base_layers.nf4_experts import NF4ExpertParam, is_nf4_expert_param, quantize_expert_param
from notebookkit.compat import carry_loaded_mark

__all__ = ["STACKED", "ExpertTally", "quantize_experts_as_read", "nf4_param_bytes"]

#: the stacked expert weights of a sparse block's experts module
STACKED = ("gate_up_proj", "down_proj")


def nf4_param_bytes(param: NF4ExpertParam) -> int:
    """Bytes of an NF4 expert weight's codes, absmax codes and second-level scales."""
    state = param.quant_state
    return sum(t.numel() * t.element_size() for t in (param.data, state.absmax, state.state2.absmax))


@dataclass
class ExpertTally:
    """How many stacked expert weights were put in NF4, and their bytes before and after."""

    count: int = 0
    before: int = 0
    after: int = 0

    def add(self, weight: torch.Tensor, packed: NF4ExpertParam) -> None:
        self.count += 1
        self.before += weight.numel() * weight.element_size()
        self.after += nf4_param_bytes(packed)


def is_incoming_expert_weight(module: nn.Module, name: str, param: Any) -> bool:
    """Whether registering ``param`` as ``module.<name>`` puts a loaded, not yet quantised stacked expert weight
    on an experts module (one holding both :data:`STACKED` parameters); meta tensors (the model's construction)
    are not loaded weights."""
    return (name in STACKED and isinstance(param, torch.Tensor) and not is_nf4_expert_param(param)
            and param.dim() == 3 and param.is_floating_point() and not param.is_meta
            and all(n in module._parameters for n in STACKED))


def _out_of_memory(module: nn.Module, name: str, param: torch.Tensor, tally: ExpertTally) -> RuntimeError:
    done = f"{tally.count} stacked expert weights were already in NF4 ({tally.after / 2**30:.2f} GiB)"
    return RuntimeError(
        f"from_pretrained(load_in_4bit=True) ran out of memory on {param.device} while putting a stacked expert "
        f"weight ({type(module).__name__}.{name}, {tuple(param.shape)} {param.dtype}, "
        f"{param.numel() * param.element_size() / 2**30:.2f} GiB) in NF4; {done}. The model does not fit this "
        "device in 4-bit: check notebookkit.memory.estimate_training_memory for it, or pick a smaller model / "
        "a larger GPU.")


@contextmanager
def quantize_experts_as_read(tally: Optional[ExpertTally] = None) -> Iterator[ExpertTally]:
    """While open, every stacked expert weight a model loads is registered in NF4 instead (module docstring);
    yields the :class:`ExpertTally` it fills. The hook is torch-global: open it around one load only."""
    tally = tally if tally is not None else ExpertTally()

    def quantize_on_registration(module: nn.Module, name: str, param: Any) -> Optional[NF4ExpertParam]:
        if not is_incoming_expert_weight(module, name, param):
            return None
        try:
            packed = quantize_expert_param(param.detach())
        except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError on torch >= 2.5
            raise _out_of_memory(module, name, param, tally) from None
        carry_loaded_mark(param, packed)  # else transformers re-initialises the codes after the load
        tally.add(param, packed)
        return packed

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(quantize_on_registration)
    try:
        yield tally
    finally:
        handle.remove()
