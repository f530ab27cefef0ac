"""Reversible rebinding of ``forward`` on module instances.

``rebind(module, fn, tag)`` makes ``module.forward`` the bound method ``fn.__get__(module)`` and keeps
whatever the instance had before (usually nothing: the class's ``forward`` applies). ``restore(module)``
puts it back. Nothing is changed on any class, so other models in the same process, and models
loaded later, are untouched; there is no import-order dependence.

Models placed with ``device_map`` (``"balanced"``, ``"auto"``...) carry accelerate hooks: accelerate
replaces ``module.forward`` by a wrapper that moves the inputs to the module's device and then calls
``module._old_forward``. On such a module the patched forward takes the place of ``_old_forward``,
so the hook keeps running around it. The patched forward also runs with the CUDA device of its
first tensor argument current, so Triton kernels launch on the device that holds that layer.
"""

from __future__ import annotations

import functools
import types
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

_ORIGINAL = "_notebookkit_original_forward"
_PATCHED = "_notebookkit_patched_forward"
_TAG = "_notebookkit_patch"
_ABSENT = object()
_HOOK_SLOT = "_old_forward"  # what accelerate's forward wrapper calls


def _hooked(module: nn.Module) -> bool:
    """True when accelerate wrapped ``module.forward`` (``device_map`` placement / offload hooks)."""
    return "_hf_hook" in module.__dict__ and _HOOK_SLOT in module.__dict__


def _first_tensor(args: tuple, kwargs: dict) -> Any:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _on_tensor_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with the CUDA device of its first tensor argument current (Triton launches there)."""

    @functools.wraps(fn)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        t = _first_tensor(args, kwargs)
        if t is not None and t.is_cuda and t.device.index != torch.cuda.current_device():
            with torch.cuda.device(t.device):
                return fn(self, *args, **kwargs)
        return fn(self, *args, **kwargs)

    return forward


def rebind(module: nn.Module, fn: Callable[..., Any], tag: str) -> None:
    """Rebind ``module.forward`` to ``fn`` (called as ``fn(module, *args, **kwargs)``).

    On a module wrapped by accelerate's hooks the wrapper stays and ``fn`` replaces the forward
    it calls, so inputs are still moved to the module's device first.
    """
    slot = _HOOK_SLOT if _hooked(module) else "forward"
    if _ORIGINAL not in module.__dict__:
        object.__setattr__(module, _ORIGINAL, (slot, module.__dict__.get(slot, _ABSENT)))
    bound = types.MethodType(_on_tensor_device(fn), module)
    object.__setattr__(module, slot, bound)
    object.__setattr__(module, _PATCHED, bound)
    object.__setattr__(module, _TAG, tag)


def is_patched(module: nn.Module) -> bool:
    """True when notebookkit rebound this module's forward."""
    return _ORIGINAL in module.__dict__


def patch_tag(module: nn.Module) -> str | None:
    """The tag given at :func:`rebind` time (``"rms_norm"``, ``"attention"``...), or ``None``."""
    return module.__dict__.get(_TAG)


def restore(module: nn.Module) -> bool:
    """Undo :func:`rebind` on one module. Returns True when something was restored."""
    if _ORIGINAL not in module.__dict__:
        return False
    slot, original = module.__dict__.pop(_ORIGINAL)
    patched = module.__dict__.pop(_PATCHED, None)
    module.__dict__.pop(_TAG, None)
    current = module.__dict__.get(slot, _ABSENT)
    if current is not patched:
        warnings.warn(
            f"{type(module).__name__}.forward was wrapped again after notebookkit patched it (for example by a "
            "trainer); restoring the stock forward drops that wrapper too.",
            stacklevel=3,
        )
    if original is _ABSENT:
        module.__dict__.pop(slot, None)
    else:
        object.__setattr__(module, slot, original)
    return True


def patched_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` for every module of ``model`` whose forward notebookkit rebound."""
    for name, module in model.named_modules():
        if is_patched(module):
            yield name, module
