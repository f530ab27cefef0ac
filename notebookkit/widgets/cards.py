"""GPU card choices for the panels: the detected GPU first, then the common cards.

The card table and the parsing of names/sizes live in :mod:`notebookkit.memory.cards`
(the planner needs them too); this module only builds the dropdown options.
"""

from __future__ import annotations

from notebookkit.memory.cards import CARDS, GPUCard, detect_card, parse_card, parse_memory

PANEL_CARDS = ("t4", "l4", "a100-40gb", "a100-80gb", "h100", "h200")


def card_options() -> list[tuple[str, str]]:
    """``(label, value)`` pairs for a Dropdown: ``"auto"`` (detected GPU or CPU) then card keys."""
    detected = detect_card()
    first = (f"Detected: {detected.label()}", "auto") if detected else ("No GPU detected (CPU run)", "auto")
    return [first] + [(CARDS[k].label(), k) for k in PANEL_CARDS]


def card_for(value: str | None) -> GPUCard | None:
    """The card a panel value refers to (None = CPU without a GPU)."""
    if value in (None, "", "auto"):
        return detect_card()
    return parse_card(value)


__all__ = ["CARDS", "GPUCard", "PANEL_CARDS", "card_for", "card_options", "detect_card", "parse_card", "parse_memory"]
