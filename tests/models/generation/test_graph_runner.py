"""The order of stream operations around a capture (:mod:`notebookkit.models.generation.graph_runner`), on the CPU.

PyTorch's CUDA calls are replaced by recorders, so the test reads the order in which the runner asks for them.
The property: the replays on the current stream are ordered after everything given to the capture stream,
including PyTorch's capture prologue, which fills the generator's seed and offset there for real (session 48:
without that order, on a busy GPU the call that captured drew other numbers than the same seed later).
"""

from __future__ import annotations

import contextlib

import torch

from notebookkit.models.generation import graph_runner


class _Stream:
    def __init__(self, name: str, events: list) -> None:
        self.name, self.events = name, events

    def wait_stream(self, other: "_Stream") -> None:
        self.events.append(f"{self.name} waits for {other.name}")


def _recorded_run(monkeypatch, times: int) -> list:
    events: list = []
    capture, current = _Stream("capture stream", events), _Stream("current stream", events)

    class Graph:
        def replay(self) -> None:
            events.append("replay")

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode=None):
        assert stream is capture
        events.append("prologue and capture on the capture stream")
        yield
        events.append("capture ends")

    monkeypatch.setattr(graph_runner, "graphs_enabled", lambda device: True)
    monkeypatch.setattr(graph_runner, "capture_stream", lambda device: capture)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.zeros(16, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: events.append("rng put back"))

    slot = torch.zeros(1, dtype=torch.long)
    runner = graph_runner.GraphRunner()
    for _ in range(times):
        runner.run("step", lambda: slot.add_(1), torch.device("cuda"), [slot])
    assert (runner.captures, runner.replays) == (1, times)
    return events


def test_the_first_replay_waits_for_the_capture_stream(monkeypatch):
    events = _recorded_run(monkeypatch, times=2)
    assert events[:2] == ["capture stream waits for current stream", "current stream waits for capture stream"]
    captured = events.index("capture ends")
    wait = events.index("current stream waits for capture stream", captured)
    assert wait < events.index("replay"), events
    assert events[-2:] == ["replay", "replay"]  # a later step replays without another wait
