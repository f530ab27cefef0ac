"""Score captions of the bundled ``captions`` set: does a caption name the right colour and shape?

Every reference caption follows one grammar (:func:`~.generate_datasets.caption_specs`)::

    A {small|large} {colour} {shape} on a {background} background[ {position}].

:func:`caption_words` reads the colour and shape words off a caption of that grammar (``None`` for
text that does not follow it: a model that has not learned to caption). :func:`score_captions`
compares generated captions with the rows' ``colour`` and ``shape`` columns, word for word (exact
match), and returns the accuracy over both words of every image,

    accuracy = (#images with the right colour + #images with the right shape) / (2 * #images),

with the two parts and the level a caption of the right grammar reaches by guessing
(``chance``: always the most frequent training colour and shape). The held-out ``eval`` split
pairs colours and shapes that the ``train`` split never shows together, so a model scores there
only by reading both from the image.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .generate_datasets import CAPTION_COLOURS, CAPTION_SHAPES

_GRAMMAR = re.compile(r"^\s*a\s+(small|large)\s+(\w+)\s+(\w+)\s+on\s+a\b", re.IGNORECASE)


def caption_words(caption: str) -> Optional[tuple[str, str]]:
    """``(colour, shape)`` of a caption in the bundled grammar, else ``None``."""
    found = _GRAMMAR.match(caption or "")
    if not found:
        return None
    colour, shape = found.group(2).lower(), found.group(3).lower()
    return (colour, shape) if colour in CAPTION_COLOURS and shape in CAPTION_SHAPES else None


@dataclass
class CaptionScore:
    """Exact-match accuracy of the colour and shape words of generated captions."""

    colour: float
    shape: float
    well_formed: float  # share of captions in the bundled grammar
    chance: float  # accuracy of always naming the most frequent training colour and shape
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (reference, generated, verdict)

    @property
    def accuracy(self) -> float:
        """Mean of the colour and shape accuracies."""
        return (self.colour + self.shape) / 2

    def __str__(self) -> str:
        return (f"caption accuracy {self.accuracy:.0%} (colour {self.colour:.0%}, shape {self.shape:.0%}; "
                f"{self.well_formed:.0%} of captions well formed; guessing the most frequent words: {self.chance:.0%})")

    def _repr_pretty_(self, p, cycle: bool) -> None:
        p.text(str(self))


def score_captions(generated: Sequence[str], rows: Sequence[dict], train_rows: Sequence[dict] = ()) -> CaptionScore:
    """Score ``generated`` captions against ``rows`` (with ``caption``, ``colour``, ``shape`` columns).

    ``train_rows`` (the training split) sets the guessing level; without it ``chance`` is 0.
    """
    if len(generated) != len(rows) or not rows:
        raise ValueError(f"score_captions: {len(generated)} captions for {len(rows)} rows; give one caption per row.")
    colour = shape = formed = 0
    table = []
    for text, row in zip(generated, rows):
        words = caption_words(text)
        formed += words is not None
        right_colour = words is not None and words[0] == row["colour"]
        right_shape = words is not None and words[1] == row["shape"]
        colour += right_colour
        shape += right_shape
        verdict = "malformed" if words is None else f"colour {'ok' if right_colour else 'wrong'}, " \
                                                      f"shape {'ok' if right_shape else 'wrong'}"
        table.append((row["caption"], text, verdict))
    chance = 0.0
    if train_rows:
        top_colour = Counter(r["colour"] for r in train_rows).most_common(1)[0][0]
        top_shape = Counter(r["shape"] for r in train_rows).most_common(1)[0][0]
        chance = (sum(r["colour"] == top_colour for r in rows) + sum(r["shape"] == top_shape for r in rows)) / (2 * len(rows))
    n = len(rows)
    return CaptionScore(colour / n, shape / n, formed / n, chance, table)


__all__ = ["CaptionScore", "caption_words", "score_captions"]
