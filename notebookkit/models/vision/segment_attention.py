"""Attention within segments of one sequence (Qwen2.5-VL's windows and images): one SDPA call per segment length.

Qwen2.5-VL's vision tower attends bidirectionally inside segments of its patch sequence: windows
of patches in most blocks, whole images in the ``fullatt_block_indexes`` blocks. ``cu_seqlens``
holds the segment boundaries (``0, e_1, e_2, ..., N``). Without flash-attention's varlen kernel,
transformers loops over the segments in Python, one SDPA call each (64 calls per block for four
448-pixel images), and reads the boundaries back to the host in every block.

Segments of equal length are independent attention problems of one shape, so they batch. For the
``n_L`` segments of length ``L``::

    Q_L, K_L, V_L = their rows, as [n_L, H, L, d]
    O_L = softmax(scale * Q_L K_L^T) V_L            one SDPA call per distinct length L
    O   = the O_L rows put back in sequence order   [N, H, d]

Each segment still sees only itself, so this is the loop's result exactly. When all segments
have one length (square images whose side is a multiple of the window: the usual case) the
grouping is a view. Otherwise the rows are gathered by length and scattered back with two index
tensors. Both gradients are the gathers' and SDPA's own.

The boundaries are read to the host once per ``cu_seqlens`` tensor, not once per block: every block of a
forward gets the same tensor, and so does the recompute of a checkpointed block. The plan is
kept in a dictionary keyed weakly by that tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["SegmentPlan", "segment_attention", "segment_plan"]


@dataclass(frozen=True)
class SegmentPlan:
    """How to batch the segments of one ``cu_seqlens``.

    ``groups``: ``(length, count)`` per distinct segment length, in the order their rows are laid
    out after the gather. ``order``: the rows, gathered group by group (``None`` when the segments
    already come in that order). ``inverse``: the permutation putting them back.
    """

    groups: tuple[tuple[int, int], ...]
    order: Optional[torch.Tensor] = None
    inverse: Optional[torch.Tensor] = None


_PLANS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def segment_plan(cu_seqlens: torch.Tensor) -> SegmentPlan:
    """The :class:`SegmentPlan` of ``cu_seqlens`` (cumulative boundaries starting at 0), cached per tensor."""
    plan = _PLANS.get(cu_seqlens)
    if plan is None:
        plan = _build_plan([int(b) for b in cu_seqlens.tolist()], cu_seqlens.device)
        _PLANS[cu_seqlens] = plan
    return plan


def _build_plan(bounds: list[int], device: torch.device) -> SegmentPlan:
    segments = [(start, end - start) for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
    lengths = sorted({length for _, length in segments}, reverse=True)
    by_length = {length: [start for start, n in segments if n == length] for length in lengths}
    groups = tuple((length, len(by_length[length])) for length in lengths)
    in_order = [start for length in lengths for start in by_length[length]]
    if in_order == [start for start, _ in segments]:  # already grouped (one length, or sorted runs)
        return SegmentPlan(groups)
    order = torch.cat([torch.arange(start, start + length) for length in lengths for start in by_length[length]])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return SegmentPlan(groups, order.to(device), inverse.to(device))


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Bidirectional attention within each segment of ``cu_seqlens``.

    Args:
        q, k, v: ``[N, H, d]`` (any strides), the rows of all segments in sequence order.
        cu_seqlens: ``[S + 1]`` integer boundaries ``0 = e_0 <= e_1 <= ... <= e_S = N``.
        scale: the factor on ``q k^T`` (usually ``d ** -0.5``).

    Returns:
        ``[N, H, d]``: row ``i`` of segment ``s`` is ``softmax(scale * q_i K_s^T) V_s``.
    """
    n_rows = q.shape[0]
    plan = segment_plan(cu_seqlens)
    if sum(length * count for length, count in plan.groups) != n_rows:
        raise ValueError(f"segment_attention: cu_seqlens covers {sum(l * c for l, c in plan.groups)} rows, "
                         f"but the queries have {n_rows}.")
    if plan.order is not None:
        q, k, v = (t.index_select(0, plan.order) for t in (q, k, v))
    outputs, start = [], 0
    for length, count in plan.groups:
        rows = slice(start, start + length * count)
        q_s, k_s, v_s = (t[rows].unflatten(0, (count, length)).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q_s, k_s, v_s, scale=scale)  # [count, H, length, d]
        outputs.append(out.transpose(1, 2).reshape(count * length, *q.shape[1:]))
        start += length * count
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out if plan.inverse is None else out.index_select(0, plan.inverse)
