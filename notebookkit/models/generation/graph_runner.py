"""Run the one-token decode step: captured once per key as a CUDA graph and replayed, or eagerly.

The step is a function of no arguments that reads and writes static tensors only (the input token,
the slot, the generated ids, the KV cache, ...): the model forward over the cache, the choice of the
next token and the slot increment all happen inside it, so a replay is one launch from the host
however many layers and kernels the step has.

On CUDA, :meth:`GraphRunner.run` captures the step the first time it sees a key (batch size, cache
length bucket, sampling settings, stop ids; the caller builds the key):

1. warm-up: the step runs once on the device's capture stream (Triton compiles, cuBLAS and the SDPA
   backend initialise), then the small state tensors it advanced are put back (the KV cache write of
   the warm-up is the one the real step makes again);
2. capture on that same stream into a memory pool shared by this runner's graphs (their temporaries
   never outlive a replay, and graphs are replayed one at a time, so they can share it);
3. replay, now and for every later step with that key.

One capture stream a device (:func:`capture_stream`), for every runner and every capture: PyTorch gives
each (cuBLAS handle, stream) pair its own cuBLAS workspace from the caching allocator and keeps it for the
life of the process (32 MiB on an H100 or H200, about 8 MiB on a T4). A new stream a capture (PyTorch's pool
hands out 32 in turn) left one more workspace allocated at every capture: a GRPO run that frees the cache
captures again every step, so its allocated memory grew by a workspace a step, up to 32 of them. With one
stream the decode path holds one workspace beside the default stream's, however often it captures.

A step that cannot be captured (an operation the installed PyTorch does not allow in a graph) runs
eagerly for that key from then on, and a warning says why, once: slower, never wrong.

Sampling draws its uniforms with ``torch.rand`` on the default CUDA generator inside the graph;
PyTorch advances the generator's offset at each replay, so ``torch.manual_seed`` before
``generate`` makes a run reproducible; the generator's state from before the warm-up run is put back
after a capture, so the call that captures draws the same numbers as a later one that only replays.
A replay reads the generator's seed and offset from two device tensors that it fills first, on the stream
it runs on; a capture also fills them (seed, offset 0), for real, on the capture stream, just before the
capture begins. The current stream therefore waits for the capture stream after each capture: without that
wait, on a busy GPU the capture stream's late "offset 0" could land after the first replay's own fill, and
that replay drew other numbers than the same seed draws later (session 48: under load, 10 to 24 of 24
seeded runs that captured differed from the runs that only replayed; none once the wait was added).
Elsewhere (CPU), or with ``NOTEBOOKKIT_CUDA_GRAPHS=0``, the step runs eagerly.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Hashable, Sequence

import torch

__all__ = ["GraphRunner", "capture_stream", "graphs_enabled"]

_EAGER = object()  # a key whose step could not be captured
_CAPTURE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def graphs_enabled(device: torch.device) -> bool:
    """Whether steps on ``device`` are captured (CUDA, unless ``NOTEBOOKKIT_CUDA_GRAPHS=0``)."""
    return device.type == "cuda" and os.environ.get("NOTEBOOKKIT_CUDA_GRAPHS", "1") not in ("0", "false", "False")


def capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """The stream every decode-step warm-up and capture on ``device`` runs on, made once a device (see the
    module docstring: a stream of its own each capture would leave a cuBLAS workspace allocated each time)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(index)
    if stream is None:
        stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


class GraphRunner:
    """Captured decode steps by key (see the module docstring)."""

    def __init__(self) -> None:
        self.graphs: dict[Hashable, "torch.cuda.CUDAGraph"] = {}
        self.captures = 0  # how many graphs were captured (tests count recaptures)
        self.replays = 0
        self.failures = 0  # keys whose capture failed (they run eagerly)
        self._pool = None

    def run(self, key: Hashable, step: Callable[[], None], device: torch.device,
            state_tensors: Sequence[torch.Tensor]) -> None:
        """Run ``step`` once: replay its graph for ``key`` (capturing it first if new) on CUDA, else eagerly.

        ``state_tensors``: the tensors ``step`` advances in place (slot, token, flags, ...), restored
        after the warm-up run that precedes a capture.
        """
        if not graphs_enabled(device):
            step()
            return
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture_or_none(step, device, state_tensors)
            self.graphs[key] = graph
        if graph is _EAGER:
            step()
            return
        graph.replay()
        self.replays += 1

    def _capture_or_none(self, step: Callable[[], None], device: torch.device,
                         state_tensors: Sequence[torch.Tensor]):
        try:
            return self._capture(step, device, state_tensors)
        except Exception as exc:  # noqa: BLE001 - any capture failure: run this key eagerly, say why
            torch.cuda.synchronize(device)
            if not self.failures:
                warnings.warn(f"notebookkit could not capture the decode step as a CUDA graph ({type(exc).__name__}: "
                              f"{exc}); it runs eagerly instead (correct, but with the host's launch overhead).",
                              UserWarning, stacklevel=4)
            self.failures += 1
            return _EAGER

    def _capture(self, step: Callable[[], None], device: torch.device,
                 state_tensors: Sequence[torch.Tensor]) -> "torch.cuda.CUDAGraph":
        saved = [t.clone() for t in state_tensors]
        rng = torch.cuda.get_rng_state(device)  # the warm-up's draws must not shift the seeded sequence
        side = capture_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        for tensor, value in zip(state_tensors, saved):
            tensor.copy_(value)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
            step()
        # the generator's capture prologue ran for real on the capture stream (module docstring): the replays
        # on the current stream must not start before it has
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.set_rng_state(rng, device)
        self.captures += 1
        return graph

    def clear(self) -> None:
        """Drop every graph and the pool (their memory returns to PyTorch's allocator)."""
        self.graphs.clear()
        self._pool = None

    def __len__(self) -> int:
        return len(self.graphs)
