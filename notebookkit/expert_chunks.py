"""When the grouped expert kernels read NF4 experts decoded in chunks, and how large a chunk is: the rule the
kernel (:mod:`notebookkit.kernels.moe_experts`) and the memory model (:mod:`notebookkit.memory.moe`) share.

A stacked NF4 expert weight can be read two ways. Decoded in the kernel's weight loads (no dense copy), every
row block of an expert decodes that expert's whole weight again, one gathered byte, block scale and level a
weight: cheap when an expert has a few rows (a decode step), but at training sizes the GEMMs then run 20-30x
slower than on a 16-bit weight (the H200, ``benchmarks/moe_kernels.py``: Qwen3-30B-A3B's block at 2,048 tokens,
103 ms forward + backward, 5.7 ms decoded in chunks, 3.5 ms on 16-bit experts). So a call with at least
:data:`MIN_ROWS_PER_EXPERT` rows per expert on average decodes the weight first, a chunk of whole experts at a
time (``dequantize_nf4``: the same values, one rounding from fp32), and runs the 16-bit kernel on each chunk.
The threshold of 16 rows is a choice, not measured. A chunk holds as many experts as fit
:data:`DECODE_CHUNK_BYTES` in the compute dtype, at least one, so the dense copy never exceeds the larger of
that and one expert.
"""

from __future__ import annotations

__all__ = ["DECODE_CHUNK_BYTES", "MIN_ROWS_PER_EXPERT", "NF4_SCALE_GROUP", "decodes_in_chunks", "experts_per_chunk",
           "chunk_ranges", "decoded_range", "largest_decode", "grouped_mm_sizes"]

#: bytes of one chunk of decoded experts (a transient of the GEMM that reads it)
DECODE_CHUNK_BYTES = 128 * 2**20
#: average (token, expert) rows per expert from which NF4 experts are decoded in chunks
MIN_ROWS_PER_EXPERT = 16


#: elements under one second-level scale of a nested NF4 weight (blocks of 64, 256 blocks a scale): a decoded
#: range starts and ends on such a group, so the sliced scales keep their indices
NF4_SCALE_GROUP = 64 * 256


def decodes_in_chunks(pairs: int, num_experts: int) -> bool:
    """Whether a call with ``pairs`` routed (token, expert) rows over ``num_experts`` experts decodes its NF4
    experts in chunks (``pairs >= MIN_ROWS_PER_EXPERT * num_experts``) rather than in the kernel's loads."""
    return pairs >= MIN_ROWS_PER_EXPERT * num_experts


def grouped_mm_sizes(pairs: int, num_experts: int, dims: tuple[int, ...]) -> bool:
    """Whether a call's sizes suit the experts' ``grouped_mm`` path (:mod:`notebookkit.kernels.moe_experts_grouped`;
    the dtype and the card are its own checks): training-sized (:func:`decodes_in_chunks`) and every dimension in
    ``dims`` (hidden, intermediate, LoRA ranks) a multiple of 8, for ``grouped_mm``'s 16-byte strides in 16 bits."""
    return decodes_in_chunks(pairs, num_experts) and all(d % 8 == 0 for d in dims)


def experts_per_chunk(expert_bytes: int, num_experts: int) -> int:
    """Experts in one chunk: ``clamp(floor(DECODE_CHUNK_BYTES / expert_bytes), 1, num_experts)``, with
    ``expert_bytes`` one expert's ``out x in`` weight in the compute dtype."""
    if expert_bytes < 1 or num_experts < 1:
        raise ValueError(f"experts_per_chunk: expert_bytes and num_experts must be >= 1 (got {expert_bytes}, "
                         f"{num_experts}).")
    return max(1, min(num_experts, DECODE_CHUNK_BYTES // expert_bytes))


def chunk_ranges(num_experts: int, expert_bytes: int) -> list[tuple[int, int]]:
    """The expert ranges ``[lo, hi)`` of one weight's chunks, :func:`experts_per_chunk` experts each."""
    per = experts_per_chunk(expert_bytes, num_experts)
    return [(lo, min(num_experts, lo + per)) for lo in range(0, num_experts, per)]


def decoded_range(lo: int, hi: int, expert_numel: int, total: int, group: int = NF4_SCALE_GROUP) -> tuple[int, int]:
    """The flat elements ``[start, end)`` decoded for experts ``[lo, hi)`` of a stacked weight of ``total``
    elements, ``expert_numel`` each: the experts' range widened to whole ``group``s (at most two groups more)."""
    return lo * expert_numel // group * group, min(total, -(-hi * expert_numel // group) * group)


def largest_decode(expert_numel: int, num_experts: int, expert_bytes: int, group: int = NF4_SCALE_GROUP) -> int:
    """Elements of the largest range one call decodes, over its chunks (:func:`experts_per_chunk` experts each,
    :func:`decoded_range`)."""
    total = num_experts * expert_numel
    return max(end - start for lo, hi in chunk_ranges(num_experts, expert_bytes)
               for start, end in [decoded_range(lo, hi, expert_numel, total, group)])
