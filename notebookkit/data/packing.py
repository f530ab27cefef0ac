"""Padding-free packing: put several examples in one row instead of padding each to the longest.

A padded batch of B examples costs ``B * max_i L_i`` token slots; a padding-free batch concatenates
them into one row of ``sum_i L_i`` slots. To keep the examples independent the row carries

    position_ids = [0, 1, .., L_1-1, 0, 1, .., L_2-1, ...]          (restart at every example)
    labels[start of every example] = -100                             (no cross-example prediction)

and the attention is block-diagonal causal: token t of example s sees token u iff seq(u) = seq(t) and
u <= t. The model layer derives the blocks from ``position_ids`` (a new block starts at every 0), so
no attention mask is passed. The loss is unchanged by packing: per-token cross-entropy summed over the
same kept labels and divided by the same count, and its gradient is the same per token.

``pack_examples`` groups examples into rows of at most ``max_length`` tokens (first-fit decreasing), and
``PaddingFreeCollator`` turns a list of (possibly packed) examples into one such row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = [
    "PaddingFreeCollator",
    "PackingStats",
    "pack_examples",
    "packing_stats",
    "position_ids_from_lengths",
]

IGNORE_INDEX = -100


def position_ids_from_lengths(lengths: Sequence[int]) -> np.ndarray:
    """``[0..L_1-1, 0..L_2-1, ...]`` for sequence lengths ``L_i``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) - starts


@dataclass
class PaddingFreeCollator:
    """Collate examples into one padding-free row (shape ``[1, sum of lengths]``).

    Each example is a dict with ``input_ids`` and optionally ``labels`` (defaults to ``input_ids``)
    and ``seq_lengths`` (an example that is itself a packed row of several sequences).

    Returns a dict of tensors ``input_ids``, ``labels``, ``position_ids`` (restarting at 0 for every
    sequence) and no ``attention_mask``. ``return_seq_lens=True`` adds ``cu_seq_lens_q/k`` and
    ``max_length_q/k`` for variable-length flash attention.
    """

    return_seq_lens: bool = False

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        ids, labels, lengths = [], [], []
        for ex in examples:
            x = list(ex["input_ids"])
            y = list(ex["labels"]) if ex.get("labels") is not None else list(x)
            if len(y) != len(x):
                raise ValueError(f"labels ({len(y)}) and input_ids ({len(x)}) differ in length")
            segs = list(ex["seq_lengths"]) if ex.get("seq_lengths") is not None else [len(x)]
            if sum(segs) != len(x):
                raise ValueError(f"seq_lengths sum to {sum(segs)} but the example has {len(x)} tokens")
            ids += x
            labels += y
            lengths += [int(s) for s in segs if s > 0]
        pos = position_ids_from_lengths(lengths)
        lab = np.asarray(labels, dtype=np.int64)
        lab[pos == 0] = IGNORE_INDEX
        out: dict[str, Any] = {
            "input_ids": torch.tensor([ids], dtype=torch.long),
            "labels": torch.from_numpy(lab)[None],
            "position_ids": torch.from_numpy(pos)[None],
        }
        if self.return_seq_lens:
            cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
            out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
            out["max_length_q"] = out["max_length_k"] = int(max(lengths))
        return out


def pack_examples(
    examples: Sequence[dict[str, Any]] | Any,
    max_length: int,
    truncate: bool = True,
) -> list[dict[str, list[int]]]:
    """Group examples into rows of at most ``max_length`` tokens (first-fit decreasing).

    Args:
        examples: dicts (or a ``datasets.Dataset``) with ``input_ids`` and optional ``labels``.
        max_length: row capacity in tokens.
        truncate: cut examples longer than ``max_length`` (otherwise raise).

    Returns:
        Rows ``{"input_ids", "labels", "seq_lengths"}``; feed them to :class:`PaddingFreeCollator`
        or ``datasets.Dataset.from_list``. Order is deterministic.
    """
    items = []
    for i in range(len(examples)):
        ex = examples[i]
        x = list(ex["input_ids"])
        y = list(ex["labels"]) if ex.get("labels") is not None else list(x)
        if len(x) > max_length:
            if not truncate:
                raise ValueError(f"example {i} has {len(x)} tokens > max_length={max_length}")
            x, y = x[:max_length], y[:max_length]
        if x:
            items.append((len(x), i, x, y))
    items.sort(key=lambda t: (-t[0], t[1]))
    bins: list[dict[str, list[int]]] = []
    free: list[int] = []
    for n, _, x, y in items:
        for b, room in enumerate(free):
            if n <= room:
                break
        else:
            bins.append({"input_ids": [], "labels": [], "seq_lengths": []})
            free.append(max_length)
            b = len(bins) - 1
        bins[b]["input_ids"] += x
        bins[b]["labels"] += y
        bins[b]["seq_lengths"].append(n)
        free[b] -= n
    return bins


@dataclass
class PackingStats:
    """Token slots a training pass uses with padding versus packed without padding."""

    real_tokens: int
    padded_slots: int
    packed_rows: int
    max_length: int

    @property
    def padding_waste(self) -> float:
        """Fraction of the padded batches that is padding."""
        return 1.0 - self.real_tokens / self.padded_slots if self.padded_slots else 0.0

    @property
    def packed_fill(self) -> float:
        """How full the packed rows are (real tokens / (rows * max_length))."""
        return self.real_tokens / (self.packed_rows * self.max_length) if self.packed_rows else 0.0

    def __str__(self) -> str:
        return (
            f"padded batches: {self.padded_slots:,} slots for {self.real_tokens:,} tokens "
            f"({self.padding_waste:.0%} padding); packed: {self.packed_rows} rows of {self.max_length} "
            f"({self.packed_fill:.0%} full, no padding computed)"
        )


def packing_stats(lengths: Sequence[int], max_length: int, batch_size: int = 8) -> PackingStats:
    """Compare padding each batch to its longest example with padding-free packing."""
    lens = np.minimum(np.asarray(lengths, dtype=np.int64), max_length)
    padded = sum(int(lens[i : i + batch_size].max()) * len(lens[i : i + batch_size])
                 for i in range(0, len(lens), batch_size))
    rows = pack_examples([{"input_ids": [0] * int(n)} for n in lens], max_length)
    return PackingStats(int(lens.sum()), padded, len(rows), max_length)
