"""A test's count of a Triton kernel's launches: the kernel object of its module replaced (``monkeypatch``) by one that
records every ``kernel[grid](...)``, its name, grid and keyword arguments, and launches the real kernel."""

from __future__ import annotations

from types import ModuleType
from typing import Any


def spy_launches(monkeypatch: Any, module: ModuleType, *names: str) -> list[tuple[str, tuple, dict]]:
    """``[(kernel name, grid, keyword arguments)]`` of the launches of ``module``'s kernels ``names``, filled as
    they run."""
    seen: list[tuple[str, tuple, dict]] = []

    class Spied:
        def __init__(self, name: str):
            self.name, self.real = name, getattr(module, name)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((self.name, grid, kwargs))
                return self.real[grid](*args, **kwargs)

            return launch

    for name in names:
        monkeypatch.setattr(module, name, Spied(name))
    return seen
