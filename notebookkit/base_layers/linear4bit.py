"""bitsandbytes 4-bit layers on the CPU: decoded by notebookkit, never by bitsandbytes' CPU kernels.

Every ``bitsandbytes.nn.Linear4bit`` instance of a model gets a forward that, for CPU tensors, is

    y = x W^T + b,   W = dequantize_nf4(weight)   (notebookkit.kernels.nf4, in the compute dtype)

in the layer's compute dtype, cast back to the input's dtype, as bitsandbytes' own forward does.
Autograd differentiates it as usual (``dL/dx = dL/dy W``; ``W`` is frozen). CUDA tensors keep
bitsandbytes' forward, which is correct there.

Why (bitsandbytes 0.50.2 on the CPU):

* its CPU ``dequantize_4bit``, which its forward uses for training and for batched inputs, decodes
  wrongly on AVX-512 CPUs whenever the rows are not whole quantisation blocks (a weight of 80 or 96
  columns with blocks of 64: most values get another block's scale);
* in eval mode without gradients, on CPUs with AVX512-BF16, its forward rewrites the weight in
  place into a CPU-only layout with the scales rounded to bf16: the model's weights change, and the
  bytes are no longer NF4 as everything else (notebookkit's fused path, merging, saving) reads them.

The fused LoRA path already decodes with ``dequantize_nf4``; this covers every other way a 4-bit
layer runs: ``fast_path=False``, layers left on stock PEFT code (LoRA dropout, trainable biases,
DoRA...), and plain Hugging Face models (the calibration's baseline). Merging LoRA into a 4-bit
layer is PEFT's code, which decodes with bitsandbytes: on a CPU it is checked first, layer by layer,
and refused with an explanation where bitsandbytes' decode is wrong (:func:`guard_lora_merges`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from notebookkit.marks import MERGE_GUARD, MERGE_ROOT

from .kernel_ops import require
from .rebinding import WeakBoundMethod, WeakOwner, rebind

TAG = "nf4_cpu"
_MERGE_GUARD = MERGE_GUARD
_MERGE_ROOT = MERGE_ROOT


def is_linear4bit(module: nn.Module) -> bool:
    """True for a bitsandbytes ``Linear4bit`` (or subclass) holding a quantised weight; not for PEFT's
    LoRA wrapper of one, which has the same class name and shows its base layer's weight."""
    is_bnb = any(c.__name__ == "Linear4bit" and c.__module__.startswith("bitsandbytes") for c in type(module).__mro__)
    return is_bnb and getattr(getattr(module, "weight", None), "quant_state", None) is not None


def linear4bit_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``Linear4bit.forward`` with notebookkit's NF4 decode for CPU tensors (module docstring)."""
    weight = self.weight
    if x.device.type != "cpu" or weight.device.type != "cpu":
        return type(self).forward(self, x)
    if not self.compute_type_is_set:  # bitsandbytes' own rule: fp32/bf16 inputs set the compute dtype
        self.set_compute_type(x)
        self.compute_type_is_set = True
    dtype = self.compute_dtype if self.compute_dtype is not None else x.dtype
    w = require("nf4", "dequantize_nf4")(weight, weight.quant_state, out_dtype=dtype)
    bias = None if self.bias is None else self.bias.to(dtype)
    return F.linear(x.to(dtype), w, bias).to(x.dtype)


def patch_linear4bit(model: nn.Module) -> int:
    """Give every bitsandbytes ``Linear4bit`` of ``model`` the CPU-safe forward; returns how many.

    Idempotent; :func:`notebookkit.models.unpatch_model` keeps it unless asked to restore it too.
    """
    count = 0
    for module in model.modules():
        if is_linear4bit(module):
            rebind(module, linear4bit_forward, TAG)
            count += 1
    return count


def describe_linear4bit(model: nn.Module, banner: Any, count: int) -> None:
    """The banner line for :func:`patch_linear4bit` (nothing for a model without 4-bit layers)."""
    if count:
        banner.feature(
            "NF4 on CPU", True,
            f"{count} 4-bit layers decode with notebookkit's NF4 kernel on CPU tensors (bitsandbytes' CPU "
            "dequantisation is wrong on AVX-512 CPUs for some shapes); CUDA tensors use bitsandbytes",
        )


# --------------------------------------------------------------------------------------------------
# Merging LoRA into a 4-bit base (PEFT's merge decodes with bitsandbytes)
# --------------------------------------------------------------------------------------------------


# Weights whose bitsandbytes CPU decode was checked and found right (a merge writes new ones), by id;
# the weak reference tells a live weight from a later object that reuses its id.
_CHECKED: dict[int, "weakref.ref[torch.Tensor]"] = {}


def _checked(weight: torch.Tensor) -> bool:
    ref = _CHECKED.get(id(weight))
    return ref is not None and ref() is weight


def _mark_checked(weight: torch.Tensor) -> None:
    for key in [k for k, r in _CHECKED.items() if r() is None]:
        del _CHECKED[key]
    _CHECKED[id(weight)] = weakref.ref(weight)


def _lora_layers_on_4bit(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m) for name, m in model.named_modules()
        if hasattr(m, "get_base_layer") and hasattr(m, "lora_A") and is_linear4bit(m.get_base_layer())
    ]


def _wrong_cpu_decodes(model: nn.Module) -> list[tuple[str, tuple[int, ...], int, int]]:
    """``(layer, shape, values that differ, values)`` for every 4-bit base on the CPU whose
    bitsandbytes CPU decode differs from notebookkit's (the NF4 format)."""
    import bitsandbytes.functional as bnbF

    dequantize_nf4 = require("nf4", "dequantize_nf4")
    wrong = []
    for name, layer in _lora_layers_on_4bit(model):
        weight = layer.get_base_layer().weight
        if weight.device.type != "cpu" or _checked(weight):
            continue
        ours = dequantize_nf4(weight)
        theirs = bnbF.dequantize_4bit(weight.data, weight.quant_state)
        differ = int((theirs != ours).sum())
        if differ:
            wrong.append((name, tuple(int(s) for s in weight.quant_state.shape), differ, ours.numel()))
        else:
            _mark_checked(weight)
    return wrong


def _guarded(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    def guarded(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        root = self.__dict__[_MERGE_ROOT]()
        wrong = _wrong_cpu_decodes(root if root is not None else self)
        if wrong:
            name, shape, differ, total = wrong[0]
            raise RuntimeError(
                f"Cannot {what} LoRA into the 4-bit base weights on this CPU: PEFT's {what} decodes them with "
                f"bitsandbytes' CPU dequantize_4bit, and on this CPU that decode is wrong for {len(wrong)} "
                f"layer(s), for example {name} (shape {shape}: {differ:,} of {total:,} values differ from the "
                "NF4 format). Nothing was merged. To merge: move the model to a GPU first "
                "(model.to('cuda')), or reload the base model in 16-bit (load_in_4bit=False), load the saved "
                "adapter onto it, and merge there."
            )
        return original(self, *args, **kwargs)

    return guarded


def guard_lora_merges(model: nn.Module) -> int:
    """Check PEFT's ``merge`` / ``unmerge`` of the LoRA layers on 4-bit bases before they run.

    On a CPU they decode the base with bitsandbytes' ``dequantize_4bit``. Before the first layer is
    touched, every 4-bit base of ``model`` on the CPU is decoded by bitsandbytes and by notebookkit;
    if any differs, the call raises (naming the layer) and nothing is merged. Returns how many layers
    are guarded (idempotent; ``copy.deepcopy`` keeps the guard on the copy).
    """
    layers = _lora_layers_on_4bit(model)
    for _, module in layers:
        object.__setattr__(module, _MERGE_ROOT, WeakOwner(model))
        if not module.__dict__.get(_MERGE_GUARD, False):
            for name in ("merge", "unmerge"):
                object.__setattr__(module, name, WeakBoundMethod(_guarded(getattr(type(module), name), name), module))
            object.__setattr__(module, _MERGE_GUARD, True)
    return len(layers)
