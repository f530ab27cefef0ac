"""The state of one model forward: a :class:`ForwardPass` object per call of a patched backbone.

The fused layers of one forward share a little state that no single layer owns:

* ``id``: which LoRA views this pass may reuse. :func:`notebookkit.models.patching.lora_fast_path.views`
  builds a module group's views (and adapter casts) once per pass; the recompute of a checkpointed
  layer reuses them.
* ``owner`` and ``casts``: the module that opened the pass, and the adapter casts the pass makes in one batch
  from what the owner's previous pass cast (:mod:`.adapter_casts`).
* ``positions_are_defaults``: the caller passed no ``position_ids``, so the ones Hugging Face makes
  are ``arange`` (plus the cache offset), one segment per row. The first positions the attention
  layers see are then taken as unpacked without reading them on the host (a read that waits for the
  GPU to finish the previous step).
* the block-diagonal mask of packed rows (:meth:`ForwardPass.packed_mask`), built once for all the
  layers: every layer of a forward receives the same ``position_ids`` tensor;
* the boolean form of Hugging Face's attention masks (:meth:`ForwardPass.boolean_mask`), made once for each
  mask tensor: Hugging Face hands every layer of one attention type the same one (gpt-oss: one for its full
  layers, one for its sliding-window layers), and the attention with sinks saves it for its backward, so
  the layers share two masks instead of saving one each.

The pass running now is held per thread (``threading.local``, as :mod:`notebookkit.kernels.runtime`
holds its kernel choice), never in a process-wide variable: two threads forwarding at once (one
model or two) each see their own pass, and a forward called inside another (a reference model run
from a hook) opens its own pass and gives the outer one back on exit, also when it raises.

The recompute of a checkpointed layer runs in the backward pass, after its forward returned and
possibly on another thread (PyTorch runs CUDA backward passes on its own worker threads). The
checkpoint keeps the :class:`ForwardPass` object and re-enters it with :func:`resumed`, which can also
name a module whose output that recompute does not read (:func:`unread_output`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

_ids = itertools.count(1)


class ForwardPass:
    """One model forward (and the checkpointing recomputes of its layers); see the module docstring."""

    __slots__ = ("id", "positions_are_defaults", "owner", "casts", "_positions", "_positions_version", "_packed",
                 "_tables", "_masks", "__weakref__")

    def __init__(self, positions_are_defaults: bool = False, owner: Any = None) -> None:
        self.id = next(_ids)  # never reused, so nothing kept for one pass is taken for another
        self.positions_are_defaults = bool(positions_are_defaults)
        self.owner = owner  # the patched backbone running it: whose previous pass's adapter casts it batches
        self.casts: Optional[Any] = None  # its adapter_casts.PassCasts, made at its first fused layer
        self._positions: Optional[weakref.ref] = None
        self._positions_version = -1
        self._packed: Optional[torch.Tensor] = None
        self._tables: Optional[tuple] = None
        self._masks: dict = {}

    def rope_tables(self, cos: torch.Tensor, sin: torch.Tensor,
                    build: Callable[[torch.Tensor, torch.Tensor], tuple]) -> tuple:
        """``build(cos, sin)``, once for the ``cos`` tensor the layers of this pass share (its recomputes too)."""
        if self._tables is not None and self._tables[0]() is cos:
            return self._tables[1]
        tables = build(cos, sin)
        self._tables = (weakref.ref(cos), tables)
        return tables

    def boolean_mask(self, mask: torch.Tensor, lengths: tuple[int, int],
                     build: Callable[[], Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        """``build()``, once for each ``mask`` tensor and ``(query, key) lengths`` the layers of this pass share
        (its recomputes too); the same tensor changed in place is built anew."""
        key = (id(mask), *lengths)
        held = self._masks.get(key)
        if held is not None and held[0]() is mask and held[1] == mask._version:
            return held[2]
        made = build()
        self._masks[key] = (weakref.ref(mask), mask._version, made)
        return made

    def packed_mask(
        self, position_ids: torch.Tensor, build: Callable[[torch.Tensor], Optional[torch.Tensor]]
    ) -> Optional[torch.Tensor]:
        """``build(position_ids)``, once for the ``position_ids`` tensor the layers of this pass share.

        When the caller passed no positions, the first ones seen are Hugging Face's defaults:
        ``None`` (not packed) without calling ``build``. Another tensor, or the same one changed in
        place, is built anew.
        """
        if (self._positions is not None and self._positions() is position_ids
                and self._positions_version == position_ids._version):
            return self._packed
        self._packed = None if self.positions_are_defaults else build(position_ids)
        self.positions_are_defaults = False
        self._positions = weakref.ref(position_ids)
        self._positions_version = position_ids._version
        return self._packed


class _Now(threading.local):
    """What this thread runs now: a pass (or None), a module whose output nobody reads, and where the running
    layer parks its MLP's gate/up outputs (or None)."""

    forward: Optional[ForwardPass] = None
    output_unused: Optional[Any] = None
    parked_mlp: Optional[Any] = None


_now = _Now()


def current() -> Optional[ForwardPass]:
    """The forward pass this thread is running, or ``None`` outside a patched backbone's forward."""
    return _now.forward


def unread_output() -> Optional[Any]:
    """The module whose output value the running recompute does not read (a patched MLP), or ``None``."""
    return _now.output_unused


def parked_mlp() -> Optional[Any]:
    """Where the running decoder layer's fused MLP parks its gate/up outputs for the layer's backward
    (a ``kernels.lora_mlp.ParkedTiles``: the checkpointing's ``"offload_mlp"`` mode), or ``None``."""
    return _now.parked_mlp


@contextlib.contextmanager
def parking(store: Optional[Any]) -> Iterator[None]:
    """Scope of one decoder layer's forward (its first pass, or its recompute) whose MLP parks in ``store``."""
    previous, _now.parked_mlp = _now.parked_mlp, store
    try:
        yield
    finally:
        _now.parked_mlp = previous


@contextlib.contextmanager
def _entered(forward: Optional[ForwardPass], unused: Optional[Any]) -> Iterator[Optional[ForwardPass]]:
    previous = _now.forward, _now.output_unused
    _now.forward, _now.output_unused = forward, unused
    try:
        yield forward
    finally:
        _now.forward, _now.output_unused = previous


def forward_pass(default_positions: bool = False, owner: Any = None) -> contextlib.AbstractContextManager[ForwardPass]:
    """Scope of one new model forward on this thread; ``default_positions``: the caller passed no
    ``position_ids``; ``owner``: the module running it (:mod:`.adapter_casts` batches its adapter casts). The
    enclosing pass (if any) is restored on exit."""
    return _entered(ForwardPass(default_positions, owner), None)


def resumed(
    forward: Optional[ForwardPass], output_unused: Optional[Any] = None
) -> contextlib.AbstractContextManager[Optional[ForwardPass]]:
    """Re-enter ``forward`` (the recompute of one of its checkpointed layers) on this thread;
    ``output_unused``: a module whose output that recompute does not read (or ``None``)."""
    return _entered(forward, output_unused)
