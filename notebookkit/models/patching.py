"""Reversible rebinding of ``forward`` on module instances.

``rebind(module, fn, tag)`` makes ``module.forward`` the bound method ``fn.__get__(module)`` and keeps
whatever the instance had before (usually nothing: the class's ``forward`` applies). ``restore(module)``
puts it back. Nothing is changed on any class, so other models in the same process, and models
loaded later, are untouched; there is no import-order dependence.
"""

from __future__ import annotations

import types
import warnings
from typing import Any, Callable, Iterator

import torch.nn as nn

_ORIGINAL = "_notebookkit_original_forward"
_PATCHED = "_notebookkit_patched_forward"
_TAG = "_notebookkit_patch"
_ABSENT = object()


def rebind(module: nn.Module, fn: Callable[..., Any], tag: str) -> None:
    """Rebind ``module.forward`` to ``fn`` (called as ``fn(module, *args, **kwargs)``)."""
    if _ORIGINAL not in module.__dict__:
        object.__setattr__(module, _ORIGINAL, module.__dict__.get("forward", _ABSENT))
    bound = types.MethodType(fn, module)
    object.__setattr__(module, "forward", bound)
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
    original = module.__dict__.pop(_ORIGINAL)
    patched = module.__dict__.pop(_PATCHED, None)
    module.__dict__.pop(_TAG, None)
    current = module.__dict__.get("forward", _ABSENT)
    if current is not patched:
        warnings.warn(
            f"{type(module).__name__}.forward was wrapped again after notebookkit patched it (for example by a "
            "trainer); restoring the stock forward drops that wrapper too.",
            stacklevel=3,
        )
    if original is _ABSENT:
        module.__dict__.pop("forward", None)
    else:
        object.__setattr__(module, "forward", original)
    return True


def patched_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` for every module of ``model`` whose forward notebookkit rebound."""
    for name, module in model.named_modules():
        if is_patched(module):
            yield name, module
