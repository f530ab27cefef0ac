"""Shared plumbing of the panels: a root widget, display hooks, change callbacks."""

from __future__ import annotations

from typing import Any, Callable

import ipywidgets as W


def styled(widget: W.Widget, *classes: str) -> W.Widget:
    """Add stable CSS classes (what browser tests and user CSS select on)."""
    for c in classes:
        widget.add_class(c)
    return widget


def header(title: str, subtitle: str = "") -> W.HTML:
    sub = f"<span style='color:#666;font-weight:normal'> — {subtitle}</span>" if subtitle else ""
    return W.HTML(f"<div style='font-size:1.05em;font-weight:600;margin:4px 0'>{title}{sub}</div>")


class Shown:
    """Something a notebook shows: a root ``self.widget`` and a ``.value``; displayed as the last
    expression of a cell or with ``.display()``."""

    widget: W.Widget

    def display(self) -> None:
        """Show the panel in the notebook."""
        from IPython.display import display

        display(self.widget)

    def _ipython_display_(self) -> None:
        self.display()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"


class Panel(Shown):
    """A group of widgets with a dataclass ``.value``.

    Subclasses build ``self.widget`` (the root box) and list the value widgets in
    ``self._controls``; ``on_change(fn)`` calls ``fn(panel)`` after any of them changes.
    """

    widget: W.Box
    _controls: list[W.Widget]

    def __init__(self) -> None:
        self._callbacks: list[Callable[["Panel"], Any]] = []

    def _starting_value(self, choice: type, overrides: dict[str, Any]) -> Any:
        """``choice(**overrides)``, the panel's first value; a setting that is not a field of the dataclass
        ``choice`` raises ``TypeError`` naming the known ones."""
        known = list(choice.__dataclass_fields__)
        unknown = set(overrides) - set(known)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown settings {sorted(unknown)}; known: {known}")
        return choice(**overrides)

    def _wire(self) -> None:
        for c in self._controls:
            c.observe(self._changed, names="value")

    def _changed(self, change: dict | None = None) -> None:
        for fn in list(self._callbacks):
            fn(self)

    def on_change(self, fn: Callable[["Panel"], Any]) -> None:
        """Call ``fn(panel)`` whenever a value in this panel changes."""
        self._callbacks.append(fn)

    @property
    def value(self):  # pragma: no cover - overridden
        raise NotImplementedError
