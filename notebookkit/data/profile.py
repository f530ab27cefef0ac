"""Token-length profile of a dataset: how long are the examples, and what ``max_seq_length`` fits them.

For lengths L_1..L_n (tokens per example after the chat template) the profile reports the
percentiles p50, p90, p99 (linear interpolation, ``numpy.percentile``) and suggests

    max_seq_length = smallest multiple of 64 that is >= p99          (rounding="multiple_of_64")
                   = smallest power of two that is >= p99           (rounding="power_of_two")

Multiples of 64 keep matmul tiles full on GPUs without padding short datasets to the next power of
two; with the p99 rule about 1 example in 100 is truncated. Activation memory grows linearly with
``max_seq_length`` (logits with ``max_seq_length x vocab``), so a tight value is the cheapest memory
saving there is. No gradients are involved; this is a pure statistic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

import numpy as np

__all__ = ["LengthProfile", "profile_lengths", "round_up_length", "example_lengths"]

Rounding = Literal["multiple_of_64", "power_of_two"]


def round_up_length(n: float, rounding: Rounding = "multiple_of_64") -> int:
    """Round a length up: to a multiple of 64 (default) or to a power of two (minimum 64)."""
    n = max(1, int(math.ceil(n)))
    if rounding == "multiple_of_64":
        return 64 * math.ceil(n / 64)
    if rounding == "power_of_two":
        return max(64, 1 << (n - 1).bit_length())
    raise ValueError(f"rounding must be 'multiple_of_64' or 'power_of_two', not {rounding!r}")


@dataclass
class LengthProfile:
    """Summary of token lengths; print it, or call :meth:`plot` for the histogram."""

    lengths: np.ndarray
    p50: float
    p90: float
    p99: float
    max: int
    mean: float
    suggested_max_seq_length: int
    rounding: str
    truncated_at_suggestion: int = 0
    source: str = field(default="")

    @property
    def total_tokens(self) -> int:
        """Sum of all lengths."""
        return int(self.lengths.sum())

    def padding_fraction(self, max_seq_length: int | None = None, batch_size: int = 8) -> float:
        """Fraction of a padded batch that is padding when examples are batched in dataset order
        and each batch is padded to its longest example (capped at ``max_seq_length``)."""
        cap = max_seq_length or self.suggested_max_seq_length
        lens = np.minimum(self.lengths, cap)
        padded = 0
        for i in range(0, len(lens), batch_size):
            chunk = lens[i : i + batch_size]
            padded += int(chunk.max()) * len(chunk)
        return 1.0 - lens.sum() / padded if padded else 0.0

    def __str__(self) -> str:
        return (
            f"{len(self.lengths):,} examples, {self.total_tokens:,} tokens{self.source}: "
            f"p50={self.p50:.0f}  p90={self.p90:.0f}  p99={self.p99:.0f}  max={self.max}  mean={self.mean:.1f}\n"
            f"suggested max_seq_length = {self.suggested_max_seq_length} "
            f"(p99 rounded up to a {'multiple of 64' if self.rounding == 'multiple_of_64' else 'power of two'}; "
            f"{self.truncated_at_suggestion} example(s) longer than that would be truncated)"
        )

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))

    def plot(self, ax: Any = None, bins: int = 40) -> Any:
        """Histogram of lengths with p50/p90/p99 and the suggestion marked. Returns the figure."""
        import matplotlib.pyplot as plt

        if ax is None:
            fig, ax = plt.subplots(figsize=(7, 3))
        else:
            fig = ax.figure
        ax.hist(self.lengths, bins=bins, color="#4c78a8", alpha=0.85)
        for value, label, style in (
            (self.p50, "p50", ":"),
            (self.p90, "p90", "--"),
            (self.p99, "p99", "-."),
            (self.suggested_max_seq_length, "max_seq_length", "-"),
        ):
            ax.axvline(value, color="#e45756" if label == "max_seq_length" else "black", ls=style, lw=1.2,
                       label=f"{label} = {value:.0f}")
        ax.set_xlabel("tokens per example")
        ax.set_ylabel("examples")
        ax.set_title("Token-length profile")
        ax.legend(fontsize=8)
        fig.tight_layout()
        return fig


def example_lengths(dataset: Any, tokenizer: Any = None, column: str | None = None) -> np.ndarray:
    """Token count per example.

    Reads ``input_ids`` when present; otherwise tokenises ``messages`` / ``conversations`` with the
    chat template, or the ``text`` column (``column`` picks another), which needs ``tokenizer``.
    """
    names = list(getattr(dataset, "column_names", None) or (dataset[0].keys() if len(dataset) else []))
    if column is None:
        for c in ("input_ids", "messages", "conversations", "text"):
            if c in names:
                column = c
                break
    if column is None:
        raise ValueError(f"No column to measure: pass column= (the dataset has {names}).")
    if column == "input_ids":
        return np.asarray([len(x) for x in dataset[column]], dtype=np.int64)
    if tokenizer is None:
        raise ValueError(f"Measuring the {column!r} column needs a tokenizer: profile_lengths(ds, tokenizer).")
    rows: Iterable = dataset[column]
    out = []
    for row in rows:
        if isinstance(row, str):
            out.append(len(tokenizer(row, add_special_tokens=True)["input_ids"]))
        else:
            if row and "from" in row[0]:
                from .sharegpt import to_role_content

                row = to_role_content(row)
            ids = tokenizer.apply_chat_template(row, tokenize=True, return_dict=True)["input_ids"]
            out.append(len(ids))
    return np.asarray(out, dtype=np.int64)


def profile_lengths(
    dataset: Any,
    tokenizer: Any = None,
    *,
    column: str | None = None,
    rounding: Rounding = "multiple_of_64",
) -> LengthProfile:
    """Token-length profile of ``dataset``: p50 / p90 / p99 / max and a suggested ``max_seq_length``.

    Args:
        dataset: a ``datasets.Dataset`` (or list of dicts) with ``input_ids``, ``messages``,
            ``conversations`` or ``text``.
        tokenizer: needed unless the dataset is already tokenised.
        column: which column to measure (detected when left out).
        rounding: ``"multiple_of_64"`` (default) or ``"power_of_two"`` for the suggestion.
    """
    if isinstance(dataset, list):
        from datasets import Dataset

        dataset = Dataset.from_list(dataset)
    lengths = example_lengths(dataset, tokenizer, column)
    if lengths.size == 0:
        raise ValueError("profile_lengths: the dataset is empty.")
    p50, p90, p99 = (float(v) for v in np.percentile(lengths, [50, 90, 99]))
    suggestion = round_up_length(p99, rounding)
    return LengthProfile(
        lengths=lengths,
        p50=p50,
        p90=p90,
        p99=p99,
        max=int(lengths.max()),
        mean=float(lengths.mean()),
        suggested_max_seq_length=suggestion,
        rounding=rounding,
        truncated_at_suggestion=int((lengths > suggestion).sum()),
    )
