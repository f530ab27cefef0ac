"""On a GPU machine ``tests/conftest.py`` hands xdist the tests marked ``long`` first, so that none of them starts
last and becomes a half's tail; the others keep their order."""

from __future__ import annotations

import pytest

from tests import conftest


class _Item:
    def __init__(self, name: str, *marks: str) -> None:
        self.name, self.keywords = name, {name: 1, **{m: 1 for m in marks}}
        self.own_markers = [getattr(pytest.mark, m) for m in marks]

    def get_closest_marker(self, name):
        return next((m for m in self.own_markers if m.name == name), None)

    def add_marker(self, marker) -> None:
        self.own_markers.append(marker)


def test_the_long_gpu_tests_start_first(monkeypatch):
    monkeypatch.setattr(conftest, "_HAS_CUDA", True)
    items = [_Item("a"), _Item("b", "long"), _Item("c", "large_memory"), _Item("d", "long")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [item.name for item in items] == ["b", "d", "a", "c"]
    assert items[-1].get_closest_marker("xdist_group") is not None  # large_memory still grouped
