"""Reversible rebinding of ``forward`` on module instances.

``rebind(module, fn, tag)`` makes ``module.forward`` call ``fn(module, ...)`` and keeps whatever the
instance had before (usually nothing: the class's ``forward`` applies). ``restore(module)`` puts it
back. Nothing is changed on any class, so other models in the same process, and models loaded
later, are untouched; there is no import-order dependence.

The rebound forward is a :class:`WeakBoundMethod`: it behaves like the bound method
``fn.__get__(module)`` (``__self__``, ``__func__``, the signature without ``self``, ``copy.deepcopy``
rebinding it to the copy) but holds its module through a weak reference. A bound method stored in
the module's own ``__dict__`` would make a reference cycle (module -> method -> module), so
``del model`` would not free the weights (GPU memory included) until Python's cycle collector
happens to run; with the weak reference, dropping the last reference frees the model at once, as
with stock Hugging Face models. The other values notebookkit keeps on an instance follow the same
care: :class:`WeakOwner` (a weak reference that a deep copy maps to the copy) and :class:`DroppedOnCopy`
(caches and views that a copy or a pickle of the module leaves behind).

Models placed with ``device_map`` (``"balanced"``, ``"auto"``...) carry accelerate hooks: accelerate
replaces ``module.forward`` by a wrapper that moves the inputs to the module's device and then calls
``module._old_forward`` (:mod:`notebookkit.compat`). On such a module the patched forward takes the place of
``_old_forward``, so the hook keeps running around it. The patched forward also runs with the CUDA
device of its first tensor argument current, so Triton kernels launch on the device that holds that
layer.
"""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from notebookkit.compat import ACCELERATE_FORWARD, accelerate_wrapped
from notebookkit.marks import ORIGINAL_FORWARD, PATCHED_FORWARD, PATCH_TAG

_ORIGINAL = ORIGINAL_FORWARD
_PATCHED = PATCHED_FORWARD
_TAG = PATCH_TAG


class _Absent:
    """Marks "the instance had no forward of its own"; one object, kept by copy and deepcopy (a copied
    model restored later must recognise it)."""

    def __copy__(self) -> "_Absent":
        return self

    def __deepcopy__(self, memo: dict) -> "_Absent":
        return self

    def __reduce__(self) -> str:
        return "_ABSENT"


_ABSENT = _Absent()


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


class WeakBoundMethod:
    """``fn`` bound to ``owner`` like a method, through a weak reference to ``owner``.

    Calling it calls ``fn(owner, *args, **kwargs)``. ``__self__`` is the owner (``None`` once it is
    gone), ``__func__`` the function, and ``inspect.signature`` shows the parameters after ``self``.
    ``copy.deepcopy`` binds the copy to the copied owner (when the owner is being copied too).
    """

    def __init__(self, fn: Callable[..., Any], owner: Any) -> None:
        self.__func__ = fn
        self._owner = weakref.ref(owner)
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            value = getattr(fn, attr, None)
            if value is not None:
                object.__setattr__(self, attr, value)

    @property
    def __self__(self) -> Any:
        return self._owner()

    @property
    def __signature__(self) -> inspect.Signature:
        sig = inspect.signature(self.__func__)
        return sig.replace(parameters=list(sig.parameters.values())[1:])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner()
        if owner is None:
            raise ReferenceError(
                f"{getattr(self.__func__, '__qualname__', 'this forward')} belongs to a module that no longer exists."
            )
        return self.__func__(owner, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "WeakBoundMethod":
        owner = self._owner()
        return self if owner is None else WeakBoundMethod(self.__func__, copy.deepcopy(owner, memo))

    def __repr__(self) -> str:
        owner = self._owner()
        return f"<notebookkit forward {getattr(self.__func__, '__qualname__', '?')} of {type(owner).__name__}>"


class WeakOwner:
    """A weak reference to ``owner`` that ``copy.deepcopy`` maps to the copied owner.

    Call it to get the owner (``None`` once it is gone). Used where a submodule must find the
    module that holds it without a reference cycle (the backbone finding its causal LM).
    """

    def __init__(self, owner: Any) -> None:
        self._ref = weakref.ref(owner)

    def __call__(self) -> Any:
        return self._ref()

    def __deepcopy__(self, memo: dict) -> "WeakOwner":
        owner = self._ref()
        return self if owner is None else WeakOwner(copy.deepcopy(owner, memo))



class DroppedOnCopy:
    """Base of a value notebookkit keeps on a module instance that stays with that instance only:
    ``copy.deepcopy`` of the module gives the copy ``None`` in its place (a fresh one is built on first
    use), and pickling stores ``None``. For caches and views that point into the module they belong to."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self):
        return (_dropped, ())


def _dropped() -> None:
    return None

def rebind(module: nn.Module, fn: Callable[..., Any], tag: str) -> None:
    """Rebind ``module.forward`` to ``fn`` (called as ``fn(module, *args, **kwargs)``).

    On a module wrapped by accelerate's hooks the wrapper stays and ``fn`` replaces the forward
    it calls, so inputs are still moved to the module's device first.
    """
    slot = ACCELERATE_FORWARD if accelerate_wrapped(module) else "forward"
    if _ORIGINAL not in module.__dict__:
        object.__setattr__(module, _ORIGINAL, (slot, module.__dict__.get(slot, _ABSENT)))
    bound = WeakBoundMethod(_on_tensor_device(fn), module)
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
