"""Where each timed step's host time goes: waits on the GPU, and Python's garbage collector.

The T4 row's steps swing between two modes (session 35: 0.30-0.31 s and 0.33-0.36 s in one call, both layouts;
Unsloth's steps stay within 3%). The GPU is busy ~99% of an unprofiled step (session 32), so a slow step is either
GPU work that ran slower (clocks, the host link under the parked copies) or a GPU that waited for a host that was
itself held up. The host is kept close behind the GPU (offloaded checkpointing paces its parked copies with
``Event.synchronize``; the fp16 scaler reads its overflow flag every step), so a host pause of a few
milliseconds at the wrong moment idles the GPU. This records, per step:

* ``host_s``: the step's host time (``time.perf_counter`` around the call);
* ``sync_s`` / ``syncs``: the time in and the number of host waits on the GPU (``torch.cuda.Event.synchronize``,
  ``torch.cuda.Stream.synchronize``, ``torch.cuda.synchronize``; ``.item()`` and the scaler's read are not
  counted, they are one a step in every system);
* ``gc_s`` / ``gcs``: the time in and the number of collections of Python's cyclic garbage collector
  (``gc.callbacks``), by generation.

    waits = HostWaits()
    with waits:                      # patches the three waits and adds the gc callback; both undone on exit
        for ids in batches:
            with waits.step():
                step(ids)
    waits.steps  # [{'host_s': 0.31, 'sync_s': 0.012, 'syncs': 30, 'gc_s': 0.0, 'gcs': [0, 0, 0]}, ...]

Plain Python; tested on the CPU with stand-in wait functions.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from typing import Any, Iterator


class HostWaits:
    """Per-step host time, host waits on the GPU and garbage-collector pauses (module docstring)."""

    def __init__(self, waits: list[tuple[Any, str]] | None = None) -> None:
        """``waits``: (owner, attribute name) of each wait function to time; default the three CUDA waits."""
        self.waits = waits
        self.steps: list[dict[str, Any]] = []
        self._current: dict[str, Any] | None = None
        self._undo: list[tuple[Any, str, Any]] = []
        self._gc_started: float | None = None

    def _timed(self, wait: Any) -> Any:
        @functools.wraps(wait)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return wait(*args, **kwargs)
            finally:
                if self._current is not None:
                    self._current["sync_s"] += time.perf_counter() - start
                    self._current["syncs"] += 1

        return timed

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._current is not None and self._gc_started is not None:
            self._current["gc_s"] += time.perf_counter() - self._gc_started
            self._current["gcs"][info.get("generation", 2)] += 1

    def __enter__(self) -> "HostWaits":
        waits = self.waits
        if waits is None:
            import torch

            waits = [(torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda, "synchronize")]
        for owner, name in waits:
            original = getattr(owner, name)
            self._undo.append((owner, name, original))
            setattr(owner, name, self._timed(original))
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._on_gc)
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Record one step's host time, waits and collections."""
        self._current = dict(host_s=0.0, sync_s=0.0, syncs=0, gc_s=0.0, gcs=[0, 0, 0])
        start = time.perf_counter()
        try:
            yield
        finally:
            self._current["host_s"] = time.perf_counter() - start
            self.steps.append({k: (round(v, 4) if isinstance(v, float) else v) for k, v in self._current.items()})
            self._current = None
