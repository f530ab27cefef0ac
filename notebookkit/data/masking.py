"""Masking check: look at exactly what the loss sees in one batch.

The training loss averages cross-entropy over positions with ``labels != -100``. This check collates
the first examples of the training set with the trainer's own collator (so padding, packing and
response-only masking are all applied as in training) and decodes

* the trained text: maximal runs of positions whose label is kept, and
* the fraction of tokens in the loss.

A wrong marker or template shows up at once: user text among the trained runs, or nothing at all.
Nothing here has a gradient; it only reads labels.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

__all__ = ["MaskedExample", "MaskingReport", "check_masking", "masking_report_from_batch"]

IGNORE_INDEX = -100


@dataclass
class MaskedExample:
    """One sequence of the batch: its tokens and which of them are trained on."""

    pieces: list[str]
    trained: list[bool]
    trained_spans: list[str] = field(default_factory=list)

    @property
    def kept_fraction(self) -> float:
        """Fraction of this sequence's tokens in the loss."""
        return sum(self.trained) / max(1, len(self.trained))


@dataclass
class MaskingReport:
    """Decoded view of a batch's labels. ``print(report)`` or display it in a notebook (colours)."""

    examples: list[MaskedExample]

    @property
    def kept_tokens(self) -> int:
        """Tokens in the loss, over the batch."""
        return sum(sum(e.trained) for e in self.examples)

    @property
    def total_tokens(self) -> int:
        """Tokens (not padding) in the batch."""
        return sum(len(e.trained) for e in self.examples)

    @property
    def kept_fraction(self) -> float:
        """Fraction of the batch's tokens that are trained on."""
        return self.kept_tokens / max(1, self.total_tokens)

    @property
    def trained_text(self) -> list[str]:
        """The trained runs of text, one list entry per run, over all examples."""
        return [span for e in self.examples for span in e.trained_spans]

    def __str__(self) -> str:
        lines = [f"Masking check: {self.kept_tokens} of {self.total_tokens} tokens ({self.kept_fraction:.1%}) "
                 "are in the loss. Trained text, run by run:"]
        for i, e in enumerate(self.examples):
            lines.append(f"-- example {i} ({e.kept_fraction:.0%} trained)")
            for span in e.trained_spans:
                lines.append(f"   >> {span!r}")
            if not e.trained_spans:
                lines.append("   (nothing is trained in this example)")
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))

    def _repr_html_(self) -> str:
        out = [
            f"<div><b>Masking check</b>: {self.kept_tokens} of {self.total_tokens} tokens "
            f"({self.kept_fraction:.1%}) are in the loss. "
            "<span style='background:#c7e9c0'>green = trained</span>, "
            "<span style='color:#999'>grey = masked (-100)</span>.</div>"
        ]
        for i, e in enumerate(self.examples):
            parts = []
            for piece, kept in zip(e.pieces, e.trained):
                text = html.escape(piece)
                style = "background:#c7e9c0" if kept else "color:#999"
                parts.append(f"<span style='{style}'>{text}</span>")
            out.append(
                f"<pre style='white-space:pre-wrap;border:1px solid #ddd;padding:4px'>"
                f"<i>example {i}</i>\n{''.join(parts)}</pre>"
            )
        return "".join(out)


def _segments(input_ids: np.ndarray, labels: np.ndarray, attention: np.ndarray | None, position: np.ndarray | None):
    """Yield (ids, labels) per sequence of a collated row (packed rows are split at position 0)."""
    if attention is not None:
        valid = attention.astype(bool)
        yield input_ids[valid], labels[valid]
        return
    if position is not None:
        starts = np.flatnonzero(position == 0).tolist() + [len(input_ids)]
        for a, b in zip(starts[:-1], starts[1:]):
            yield input_ids[a:b], labels[a:b]
        return
    yield input_ids, labels


def masking_report_from_batch(batch: dict, tokenizer: Any, max_examples: int = 4) -> MaskingReport:
    """Build a :class:`MaskingReport` from a collated batch (``input_ids``, ``labels`` tensors)."""
    ids = np.asarray(batch["input_ids"].cpu() if hasattr(batch["input_ids"], "cpu") else batch["input_ids"])
    labels = np.asarray(batch["labels"].cpu() if hasattr(batch["labels"], "cpu") else batch["labels"])
    attention = batch.get("attention_mask")
    position = batch.get("position_ids")
    examples: list[MaskedExample] = []
    for row in range(ids.shape[0]):
        att = np.asarray(attention[row].cpu()) if attention is not None else None
        pos = np.asarray(position[row].cpu()) if (position is not None and attention is None) else None
        for seg_ids, seg_labels in _segments(ids[row], labels[row], att, pos):
            if len(examples) >= max_examples:
                break
            pad = getattr(tokenizer, "pad_token_id", None)
            if pos is not None and (seg_labels == IGNORE_INDEX).all() and pad is not None and (seg_ids == pad).all():
                continue  # trailing padding of a padding-free row
            pieces = [tokenizer.decode([int(t)], skip_special_tokens=False) for t in seg_ids]
            trained = [int(t) != IGNORE_INDEX for t in seg_labels]
            spans, current = [], []
            for i, keep in enumerate(trained):
                if keep:
                    current.append(int(seg_ids[i]))
                elif current:
                    spans.append(tokenizer.decode(current, skip_special_tokens=False))
                    current = []
            if current:
                spans.append(tokenizer.decode(current, skip_special_tokens=False))
            examples.append(MaskedExample(pieces, trained, spans))
    return MaskingReport(examples)


def check_masking(
    trainer: Any,
    n_examples: int = 2,
    dataset: Any = None,
    tokenizer: Any = None,
    require_trained_tokens: bool = True,
) -> MaskingReport:
    """Decode which tokens of the first training batch are trained on (labels kept) and which are masked.

    Args:
        trainer: a Hugging Face / TRL trainer; its ``data_collator`` builds the batch.
        n_examples: how many examples to collate.
        dataset: defaults to ``trainer.train_dataset``.
        tokenizer: defaults to ``trainer.processing_class``.
        require_trained_tokens: raise if an example has no trained token at all.

    Returns:
        A :class:`MaskingReport`; it prints the trained text and displays coloured tokens in Jupyter.
    """
    dataset = trainer.train_dataset if dataset is None else dataset
    tokenizer = tokenizer or getattr(trainer, "processing_class", None) or getattr(trainer, "tokenizer", None)
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    n = min(n_examples, len(dataset))
    rows = [dataset[i] for i in range(n)]
    keys: Sequence[str] = [k for k in ("input_ids", "labels", "seq_lengths", "attention_mask") if k in rows[0]]
    batch = trainer.data_collator([{k: row[k] for k in keys} for row in rows])
    report = masking_report_from_batch(batch, tokenizer, max_examples=max(n_examples, 1) * 8)
    if require_trained_tokens:
        empty = [i for i, e in enumerate(report.examples) if not any(e.trained)]
        if empty:
            raise ValueError(
                f"Masking check: example(s) {empty} of the first batch have no trained token (every label is -100), "
                "so they teach nothing. Check the response markers of train_on_responses_only and max_seq_length.\n"
                + str(report)
            )
    return report
