"""Where each timed step's host time goes: waits on the GPU, and Python's garbage collector.

The T4 row's steps swing between two modes (session 35: 0.30-0.31 s and 0.33-0.36 s in one call, both layouts;
Unsloth's steps stay within 3%). The GPU is busy ~99% of an unprofiled step (session 32), so a slow step is either
GPU work that ran slower (clocks, the host link under the parked copies) or a GPU that waited for a host that was
itself held up. The host is kept close behind the GPU (offloaded checkpointing paces its parked copies with
``Event.synchronize``; the fp16 scaler reads its overflow flag every step), so a host pause of a few
milliseconds at the wrong moment idles the GPU. This records, per step:

* ``host_s``: the step's host time (``time.perf_counter`` around the call);
* ``sync_s`` / ``syncs``: the time in and the number of host waits on the GPU (``torch.cuda.Event.synchronize``,
  ``torch.cuda.Stream.synchronize``, ``torch.cuda.synchronize``; ``.item()`` is not counted, and the scaler's
  read is counted apart, below);
* ``gc_s`` / ``gcs``: the time in and the number of collections of Python's cyclic garbage collector
  (``gc.callbacks``), by generation;
* ``read_s``: the time in the step's reads of a value the GPU computes (``GradScaler.get_scale``: the fp16 step's
  end waits there for the GPU to finish the step);
* ``counts``: what the step added to the caching allocators' counters (``torch.cuda.memory_stats``:
  ``num_alloc_retries``, a request that found no free block under the cap and freed the cache with a synchronising
  ``cudaFree``; ``num_device_alloc`` / ``num_device_free``, ``cudaMalloc`` / ``cudaFree`` calls; ``num_sync_all_streams``;
  ``torch.cuda.host_memory_stats``: ``num_host_alloc`` / ``num_host_free``, pinned blocks made or given back), only
  those that moved.

* ``cpu_s``, ``preempted``, ``steal_s`` (:func:`host_contention`): the CPU time the process used in the step (every
  thread; a CUDA wait that spins counts too), how often the kernel took a CPU from it against its will
  (involuntary context switches), and the time the machine's virtual CPUs waited for their host's physical ones
  (``steal`` of ``/proc/stat``, all CPUs, in ticks of 10 ms). A host-bound step that runs slower while ``steal_s``
  or ``preempted`` rise was slowed by a machine shared with others, not by its own code (session 41: Qwen3-30B-A3B's
  four-layer step took 37 ms in one process and 55-63 ms in the next, on one H200).

Session 36 read the first three in call 4: the slow steps had no host wait at any of the 30 pacing points, so
either the host issued the step slower, or it waited somewhere these do not see (a ``cudaFree`` of the allocator,
the end of the step). ``read_s`` and ``counts`` tell those apart.

    waits = HostWaits()
    with waits:                      # patches the three waits and adds the gc callback; both undone on exit
        for ids in batches:
            with waits.step():
                step(ids)
    waits.steps  # [{'host_s': 0.31, 'sync_s': 0.012, 'syncs': 30, 'gc_s': 0.0, 'gcs': [0, 0, 0], 'read_s': 0.0,
                 #   'counts': {}}, ...]

Plain Python; tested on the CPU with stand-in wait functions.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import resource
import time
from typing import Any, Callable, Iterator

#: torch.cuda.memory_stats() counters a step's ``counts`` reports, then torch.cuda.host_memory_stats()'s
DEVICE_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
HOST_COUNTERS = ("num_host_alloc", "num_host_free")


def cuda_counters() -> dict[str, int]:
    """The allocators' cumulative counters of :data:`DEVICE_COUNTERS` and :data:`HOST_COUNTERS` (absent ones
    left out: older PyTorch)."""
    import torch

    device = torch.cuda.memory_stats()
    try:
        host = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):  # older PyTorch, or no pinned allocator: a diagnostic, never a failure
        host = {}
    out = {k: int(device[k]) for k in DEVICE_COUNTERS if k in device}
    out.update({k: int(host[k]) for k in HOST_COUNTERS if k in host})
    return out


def _steal_seconds() -> float | None:
    """Seconds the machine's virtual CPUs have waited for a physical one since boot (``steal`` of ``/proc/stat``,
    summed over the CPUs), or None where there is no such file (not Linux)."""
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def host_contention() -> dict[str, float]:
    """Cumulative counters of how much CPU the process had: ``cpu_s`` (its CPU time, every thread),
    ``preempted`` (involuntary context switches), ``steal_s`` (the machine's, where Linux reports it)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out = {"cpu_s": usage.ru_utime + usage.ru_stime, "preempted": float(usage.ru_nivcsw)}
    steal = _steal_seconds()
    if steal is not None:
        out["steal_s"] = steal
    return out


class HostWaits:
    """Per-step host time, host waits on the GPU, reads at the step's end, garbage-collector pauses and the
    allocators' counters (module docstring)."""

    def __init__(self, waits: list[tuple[Any, str]] | None = None, reads: list[tuple[Any, str]] | None = None,
                 counters: Callable[[], dict[str, int]] | None = None,
                 contention: Callable[[], dict[str, float]] | None = host_contention) -> None:
        """``waits``: (owner, attribute name) of each wait function to time; ``reads``: the same for the reads of
        a GPU value; ``counters``: a function giving cumulative counters. Without ``waits``: the three CUDA waits,
        ``GradScaler.get_scale`` (unless ``reads`` is given) and :func:`cuda_counters` (unless ``counters`` is).
        ``contention``: cumulative host counters whose per-step change each step records as it is
        (:func:`host_contention`; None: none)."""
        self.waits = waits
        self.reads = reads
        self.counters = counters
        self.contention = contention
        self.steps: list[dict[str, Any]] = []
        self._current: dict[str, Any] | None = None
        self._undo: list[tuple[Any, str, Any]] = []
        self._gc_started: float | None = None

    def _timed(self, wait: Any, seconds: str, count: str | None) -> Any:
        @functools.wraps(wait)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return wait(*args, **kwargs)
            finally:
                if self._current is not None:
                    self._current[seconds] += time.perf_counter() - start
                    if count:
                        self._current[count] += 1

        return timed

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._current is not None and self._gc_started is not None:
            self._current["gc_s"] += time.perf_counter() - self._gc_started
            self._current["gcs"][info.get("generation", 2)] += 1

    def __enter__(self) -> "HostWaits":
        waits, reads = self.waits, self.reads or []
        if waits is None:  # the CUDA defaults
            import torch

            waits = [(torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda, "synchronize")]
            reads = self.reads if self.reads is not None else [(torch.amp.GradScaler, "get_scale")]
            self.counters = self.counters or cuda_counters
        for patched, seconds, count in ((waits, "sync_s", "syncs"), (reads, "read_s", None)):
            for owner, name in patched:
                original = getattr(owner, name)
                self._undo.append((owner, name, original))
                setattr(owner, name, self._timed(original, seconds, count))
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._on_gc)
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Record one step's host time, waits, reads, collections and counters (read outside the timed part)."""
        before = self.counters() if self.counters else {}
        host_before = self.contention() if self.contention else {}
        self._current = dict(host_s=0.0, sync_s=0.0, syncs=0, gc_s=0.0, gcs=[0, 0, 0], read_s=0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._current["host_s"] = time.perf_counter() - start
            host_after = self.contention() if self.contention else {}
            self._current.update({k: v - host_before[k] for k, v in host_after.items() if k in host_before})
            after = self.counters() if self.counters else {}
            self._current["counts"] = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
            self.steps.append({k: (round(v, 4) if isinstance(v, float) else v) for k, v in self._current.items()})
            self._current = None
