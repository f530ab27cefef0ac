"""The planner's default budget respects torch.cuda.set_per_process_memory_fraction (an emulated T4 on
a big card: mem_get_info still reports the whole card free). CUDA faked on CPU."""

import pytest
import torch

from notebookkit.memory import planner

GIB = 2**30


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"fraction": 1.0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (139 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 1 * GIB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda *a: state["fraction"], raising=False)
    monkeypatch.setattr(planner, "detect_card", lambda: None)
    return state


def test_free_vram_without_a_cap(fake_cuda):
    budget, _, what, _ = planner._resolve_budget(None, None, None)
    assert budget == 140 * GIB and what.startswith("free VRAM")


def test_per_process_fraction_caps_the_budget(fake_cuda):
    fake_cuda["fraction"] = 15 * GIB / (140 * GIB)
    budget, counts_context, what, _ = planner._resolve_budget(None, None, None)
    assert budget == 15 * GIB
    assert not counts_context  # like free VRAM: the allocator's cap excludes the CUDA context
    assert "set_per_process_memory_fraction" in what and "15.00 GiB" in what


def test_an_explicit_max_memory_still_wins(fake_cuda):
    fake_cuda["fraction"] = 0.1
    budget, _, what, _ = planner._resolve_budget(None, "20GiB", None)
    assert budget == 20 * GIB and "max_memory" in what
