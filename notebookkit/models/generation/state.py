"""What a model keeps between ``generate`` calls: its decoder plan, static KV cache, buffers, graphs,
adapter casts and LoRA views.

One :class:`GenerationState` per causal LM, in the instance's ``__dict__`` (never on a class). It
survives ``for_training`` / ``for_inference`` switches, so a GRPO loop that alternates them every
step reuses the cache and the captured graphs; :func:`release` frees them all, :func:`drop_cache` the
cache and what was captured against it.

The captured graphs read the weights, the adapters and the cache in place. They stay valid while
the model's structure and parameter storage stay the same (an optimizer step updates parameters in
place; the graphs then read the new values). :func:`model_signature` notices anything else (an
adapter merged, disabled or swapped, parameters moved or replaced): the plan is rebuilt, the
graphs are captured again and the LoRA views built again (each call's forwards run in the state's
:class:`~notebookkit.models.patching.forward_state.ForwardPass`, whose views
:func:`~notebookkit.models.patching.lora_fast_path.views` keeps: an 8B model's prefill builds about 160 of them,
some 15 ms of host time, on its first call only).

The state holds the model's submodules but nothing holds the model itself, so there is no reference
cycle (``del model`` frees everything at once); ``copy.deepcopy`` of the model gives the copy no state
(a fresh one is built on its first use), and pickling drops it.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch.nn as nn

from notebookkit.base_layers.rebinding import DroppedOnCopy
from notebookkit.marks import GENERATION_STATE

from ..patching.forward_state import ForwardPass
from .decoder_plan import DecoderPlan, causal_lm_of, plan_for
from .graph_runner import GraphRunner
from .projections import AdapterCasts
from .static_cache import StaticKVCache

__all__ = ["GenerationState", "generation_state", "decoder_plan", "model_signature", "release", "drop_cache"]

_STATE = GENERATION_STATE


class GenerationState(DroppedOnCopy):
    """The per-model generation state (see the module docstring)."""

    def __init__(self) -> None:
        self.plan: Union[DecoderPlan, str, None] = None
        self.signature: Optional[tuple] = None
        self.devices: frozenset = frozenset()  # the devices of the parameters, read with the signature
        # the forward pass a generate call's forwards run in (_decode): the LoRA views its prefill and captures build
        # are kept from call to call (lora_fast_path.views) and a new pass starts when the signature changes
        self.views_pass = ForwardPass()
        self.cache: Optional[StaticKVCache] = None
        self.buffers: dict[int, Any] = {}  # batch size -> the decode loop's buffers (generate.DecodeBuffers)
        self.runner = GraphRunner()
        self.casts = AdapterCasts()  # adapters in the compute dtype, read by the captured steps
        self.warned: set[str] = set()
        # drop_cache freed the cache after a call: the next call, which starts without one, captures one graph
        # for its whole request instead of every bucket's (generate's module docstring)
        self.dropped = False

    def refresh(self, causal_lm: nn.Module) -> Union[DecoderPlan, str]:
        """The current plan of ``causal_lm`` (or why it has none), rebuilt and with the graphs dropped
        when :func:`model_signature` changed."""
        signature = model_signature(causal_lm)
        self.devices = frozenset(device for *_, device in signature[1])
        if signature != self.signature or self.plan is None:
            self.plan = plan_for(causal_lm)
            self.runner.clear()
            self.casts.clear()
            self.views_pass = ForwardPass()
            self.signature = signature
        return self.plan

    def drop_cache(self) -> None:
        """Free the KV cache and everything captured against it (buffers, graphs)."""
        self.runner.clear()
        self.buffers.clear()
        if self.cache is not None:
            self.cache.release()
        self.cache = None

    def release(self) -> None:
        """Free the cache, buffers, graphs and RoPE tables (rebuilt on the next ``generate``)."""
        self.drop_cache()
        self.casts.clear()
        if isinstance(self.plan, DecoderPlan):
            self.plan.rope.release()
        self.plan, self.signature = None, None
        self.views_pass = ForwardPass()



def generation_state(model: nn.Module) -> GenerationState:
    """The :class:`GenerationState` of ``model`` (PEFT-wrapped or not), created on first use."""
    causal_lm = causal_lm_of(model)
    state = causal_lm.__dict__.get(_STATE)
    if state is None:
        state = GenerationState()
        object.__setattr__(causal_lm, _STATE, state)
    return state


def decoder_plan(model: nn.Module) -> DecoderPlan:
    """The :class:`~.decoder_plan.DecoderPlan` of ``model``; a readable ``ValueError`` when it has none."""
    state = generation_state(model)
    plan = state.plan if isinstance(state.plan, DecoderPlan) else state.refresh(causal_lm_of(model))
    if not isinstance(plan, DecoderPlan):
        raise ValueError(f"notebookkit's decode path cannot run this model: {plan}.")
    return plan


def release(model: nn.Module) -> int:
    """Free the generation cache, buffers and CUDA graphs of ``model``; returns the KV-cache bytes freed.

    The next ``model.generate`` allocates them again. Useful before training a large model in the
    same notebook when you will not generate again soon (``for_training`` keeps them, for GRPO).
    """
    return _free(model, GenerationState.release)


def drop_cache(model: nn.Module) -> int:
    """Free the KV cache, the decode buffers and the CUDA graphs of ``model`` (the plan, the adapter casts
    and the RoPE tables stay); returns the KV-cache bytes freed. The next ``generate`` allocates them again
    and captures one decode graph for its whole request (not one a cache-length bucket: their graphs would
    not outlive the call). FastGRPOTrainer calls it after each generation when memory is short."""
    return _free(model, GenerationState.drop_cache, dropped=True)


def _free(model: nn.Module, how, dropped: bool = False) -> int:
    """Apply ``how`` (a :class:`GenerationState` method) to ``model``'s state; the KV-cache bytes it held.
    ``dropped``: mark the state for one graph at the next call (:func:`drop_cache`)."""
    state = causal_lm_of(model).__dict__.get(_STATE)
    if state is None:
        return 0
    freed = state.cache.nbytes if state.cache is not None else 0
    how(state)
    state.dropped = dropped and freed > 0
    return freed


_ADAPTER_FLAGS = ("merged", "disable_adapters")


def model_signature(causal_lm: nn.Module) -> tuple:
    """What the plan, the captured graphs and the kept LoRA views depend on: every module's identity and adapter
    state (merged, disabled, active adapters, scaling) and every parameter's storage, dtype, shape and device.

    One walk of the ``_modules`` dictionaries in ``causal_lm.modules()``'s order (not ``modules()`` and then
    ``parameters()``, whose generators walk the tree twice): ``generate`` reads an 8B model with LoRA, about 2,700
    modules and 740 parameters, on every call."""
    modules, params, seen, stack = [], [], set(), [causal_lm]
    while stack:
        module = stack.pop()
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        children = module._modules
        entry: tuple = (id(module),)
        if "lora_A" in children or "lora_A" in module._parameters or "lora_A" in module.__dict__:
            flags = tuple(bool(getattr(module, name, False)) for name in _ADAPTER_FLAGS)
            active = tuple(getattr(module, "active_adapters", None) or ())
            scaling = tuple(sorted((getattr(module, "scaling", None) or {}).items()))
            entry += (flags, active, scaling)
        modules.append(entry)
        if module._parameters:
            for p in module._parameters.values():
                if p is not None and id(p) not in seen:  # a tied weight once
                    seen.add(id(p))
                    params.append((p.data_ptr(), p.dtype, tuple(p.shape), p.device))
        if children:
            stack.extend(reversed(children.values()))
    return tuple(modules), tuple(params)
