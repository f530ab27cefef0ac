"""Late-bound access to the fused kernels of ``notebookkit.kernels``.

The model layer looks kernels up when it patches a model, not at import time, so importing
``notebookkit.models`` never fails because one kernel file is missing or broken; the feature that
needs it is switched off instead, with the import error in the banner.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable, Optional

_cache: dict[tuple[str, str], Any] = {}


def kernel(module: str, name: str) -> Optional[Callable[..., Any]]:
    """``notebookkit.kernels.<module>.<name>``, or ``None`` when it cannot be imported."""
    if module in disabled():
        return None
    key = (module, name)
    if key in _cache:
        return _cache[key]
    try:
        obj = getattr(importlib.import_module(f"notebookkit.kernels.{module}"), name)
    except Exception:
        return None
    _cache[key] = obj
    return obj


_DISABLED_ENV = "NOTEBOOKKIT_DISABLE_KERNELS"
# (the variable's text, its modules) as last read: a forward looks kernels up hundreds of times (an 8B model's
# prefill about 700), and the text is parsed again only when it changed
_disabled_read: tuple[str, frozenset[str]] = ("", frozenset())


def disabled() -> frozenset[str]:
    """Kernel modules switched off by ``NOTEBOOKKIT_DISABLE_KERNELS=lora_mlp,rope`` (debugging aid)."""
    global _disabled_read
    text = os.environ.get(_DISABLED_ENV, "")
    if text != _disabled_read[0]:
        _disabled_read = (text, frozenset(m.strip() for m in text.split(",") if m.strip()))
    return _disabled_read[1]


def why_missing(module: str, name: str) -> Optional[str]:
    """A short reason why ``kernel(module, name)`` is ``None`` (``None`` when it is available)."""
    if module in disabled():
        return f"notebookkit.kernels.{module} disabled by NOTEBOOKKIT_DISABLE_KERNELS"
    if kernel(module, name) is not None:
        return None
    try:
        mod = importlib.import_module(f"notebookkit.kernels.{module}")
    except Exception as exc:  # noqa: BLE001 - reported to the user verbatim
        return f"notebookkit.kernels.{module} does not import ({type(exc).__name__}: {exc})"
    if not hasattr(mod, name):
        return f"notebookkit.kernels.{module} has no {name}"
    return None



def require(module: str, name: str) -> Callable[..., Any]:
    """Like :func:`kernel` but raises a readable ``ImportError`` when the kernel is missing."""
    fn = kernel(module, name)
    if fn is None:
        raise ImportError(why_missing(module, name) or f"notebookkit.kernels.{module}.{name} is unavailable")
    return fn
