"""When the grouped expert kernels read NF4 experts decoded in chunks, and how large a chunk is: the rule the
kernel (:mod:`notebookkit.kernels.moe_experts`) and the memory model (:mod:`notebookkit.memory.moe`) share.

A stacked NF4 expert weight can be read two ways. Decoded in the kernel's weight loads (no dense copy), every
row block of an expert decodes that expert's whole weight again, one gathered byte, block scale and level a
weight: cheap when an expert has a few rows (a decode step), but at training sizes the GEMMs then run 20-30x
slower than on a 16-bit weight (the H200, ``benchmarks/moe_kernels.py``: Qwen3-30B-A3B's block at 2,048 tokens,
103 ms forward + backward, 5.7 ms decoded in chunks, 3.5 ms on 16-bit experts). So a call with at least
:data:`MIN_ROWS_PER_EXPERT` rows per expert on average decodes the weight first, a chunk of whole experts at a
time (``dequantize_nf4``: the same values, one rounding from fp32), and runs the 16-bit kernel on each chunk.
The threshold of 16 rows is a choice, not measured. A chunk holds as many experts as fit the chunk budget in
the compute dtype, at least one, so the dense copy never exceeds the larger of the budget and one expert.

The budget grows with the card (:func:`decode_chunk_bytes`): each chunk costs a decode launch, a ``grouped_mm``
(two launches) and a copy into the output, four times a layer (the forward's gate/up and down, the backward's
two input gradients). Qwen3-30B-A3B's gate/up experts are 805 MB in bf16: seven chunks at 128 MiB, three at
320 MiB (an 80 GiB card), two on an H200 (562 MiB). On a fast card, where a mixture-of-experts step waits on
the host's launches (the H200: the GPU idle about two thirds of the step, ``benchmarks/results/*moe-s30.md``),
fewer chunks are fewer launches; on a small card, where every MiB counts and the GPU is the bound, the budget
stays at :data:`DECODE_CHUNK_BYTES`. A weight whose experts all fit one chunk has that chunk's product as its
output (no copy). "The card" is what the plan is for (:func:`chunk_budget`): an ``"auto"`` activation plan under
``max_memory`` counts the cap's chunks and the kernels then decode with those, so a cap on a large card gets the
chunks of a card that size.
"""

from __future__ import annotations

import functools
import os

__all__ = ["DECODE_CHUNK_BYTES", "MAX_DECODE_CHUNK_BYTES", "CARD_SHARE", "MIN_ROWS_PER_EXPERT", "NF4_SCALE_GROUP",
           "device_bounds", "decode_chunk_bytes", "process_card_bytes", "chunk_budget", "decodes_in_chunks",
           "experts_per_chunk", "chunk_ranges", "decoded_range", "largest_decode", "grouped_mm_sizes"]

#: bytes of one chunk of decoded experts (a transient of the GEMM that reads it) on a card of up to 32 GiB, and
#: where the card is not known
DECODE_CHUNK_BYTES = 128 * 2**20
#: the largest chunk budget, a card of 256 GiB or more
MAX_DECODE_CHUNK_BYTES = 2**30
#: the card's memory over the chunk budget between the two (a card of up to 32 GiB keeps the least)
CARD_SHARE = 256
#: average (token, expert) rows per expert from which NF4 experts are decoded in chunks
MIN_ROWS_PER_EXPERT = 16


#: elements under one second-level scale of a nested NF4 weight (blocks of 64, 256 blocks a scale): a decoded
#: range starts and ends on such a group, so the sliced scales keep their indices
NF4_SCALE_GROUP = 64 * 256


def device_bounds() -> bool:
    """Whether the ``grouped_mm`` path keeps an MoE call's expert segment bounds on the device when it decodes NF4
    experts in several chunks (``NOTEBOOKKIT_MOE_DEVICE_BOUNDS=1``; off by default until timed on the GPU). With the
    bounds on the host (the default) each call waits once for the GPU to copy ``E + 1`` integers, which drains the
    queue the host had built: on a fast card a mixture-of-experts step waits on the host. On the device, each chunk
    gathers all ``N`` rows from its first and adds its product into the output (``N`` rows in and out a chunk, every
    chunk decoded: :func:`notebookkit.kernels.moe_experts_grouped._chunks_by_device_bounds`), no synchronisation."""
    return os.environ.get("NOTEBOOKKIT_MOE_DEVICE_BOUNDS", "0") == "1"


def decode_chunk_bytes(card_bytes: int | None) -> int:
    """The chunk budget on a card whose process may use ``card_bytes`` (its memory, or the allocator's cap where
    one is set; ``None``: not known): ``clamp(card_bytes / CARD_SHARE, DECODE_CHUNK_BYTES,
    MAX_DECODE_CHUNK_BYTES)``: 128 MiB up to 32 GiB (a T4, a 24 GiB card: where memory is tightest and the
    GPU, not the host, bounds the step), 160 MiB on 40 GiB, 320 MiB on 80 GiB, 562 MiB on an H200's
    143,771 MiB, 1 GiB from 256 GiB."""
    if card_bytes is None:
        return DECODE_CHUNK_BYTES
    return max(DECODE_CHUNK_BYTES, min(MAX_DECODE_CHUNK_BYTES, int(card_bytes) // CARD_SHARE))


def process_card_bytes(device) -> int | None:
    """The memory this process may use on ``device``: the card's, or the caching allocator's cap where
    ``torch.cuda.set_per_process_memory_fraction`` set one (a T4 emulated on a larger card gets a T4's chunks);
    ``None`` off CUDA."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    total = _card_total(index)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = float(getter(index)) if getter is not None else 1.0
    return int(fraction * total) if fraction < 1.0 else total


def chunk_budget(device, planned: int | None = None) -> int:
    """The budget the kernels decode a model's NF4 experts with on ``device``: ``planned``, the one its activation
    plan was sized for (``"auto"``: the cap's under ``max_memory``, a named card's, or this card's), else
    :func:`decode_chunk_bytes` of this process's share of the card (:func:`process_card_bytes`)."""
    return int(planned) if planned is not None else decode_chunk_bytes(process_card_bytes(device))


@functools.lru_cache(maxsize=None)
def _card_total(index: int) -> int:
    import torch

    return int(torch.cuda.get_device_properties(index).total_memory)


def decodes_in_chunks(pairs: int, num_experts: int) -> bool:
    """Whether a call with ``pairs`` routed (token, expert) rows over ``num_experts`` experts decodes its NF4
    experts in chunks (``pairs >= MIN_ROWS_PER_EXPERT * num_experts``) rather than in the kernel's loads."""
    return pairs >= MIN_ROWS_PER_EXPERT * num_experts


def grouped_mm_sizes(pairs: int, num_experts: int, dims: tuple[int, ...]) -> bool:
    """Whether a call's sizes suit the experts' ``grouped_mm`` path (:mod:`notebookkit.kernels.moe_experts_grouped`;
    the dtype and the card are its own checks): training-sized (:func:`decodes_in_chunks`) and every dimension in
    ``dims`` (hidden, intermediate, LoRA ranks) a multiple of 8, for ``grouped_mm``'s 16-byte strides in 16 bits."""
    return decodes_in_chunks(pairs, num_experts) and all(d % 8 == 0 for d in dims)


def experts_per_chunk(expert_bytes: int, num_experts: int, chunk_bytes: int | None = None) -> int:
    """Experts in one chunk: the fewest chunks the budget allows, ``c = ceil(E / m)`` with
    ``m = clamp(floor(chunk_bytes / expert_bytes), 1, E)``, filled evenly, ``ceil(E / c)`` experts each (the last
    may hold fewer). ``expert_bytes``: one expert's ``out x in`` weight in the compute dtype; ``chunk_bytes``: the
    budget (:func:`decode_chunk_bytes`; ``None``: :data:`DECODE_CHUNK_BYTES`). Even filling costs no launch and
    holds less: Qwen3-30B-A3B's 128 gate/up experts (6 MiB each in bf16) on an H200's 562 MiB budget are two
    chunks of 64 (384 MiB) rather than 93 and 35 (558 MiB)."""
    if expert_bytes < 1 or num_experts < 1:
        raise ValueError(f"experts_per_chunk: expert_bytes and num_experts must be >= 1 (got {expert_bytes}, "
                         f"{num_experts}).")
    budget = DECODE_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    most = max(1, min(num_experts, budget // expert_bytes))
    return -(-num_experts // -(-num_experts // most))


def chunk_ranges(num_experts: int, expert_bytes: int, chunk_bytes: int | None = None) -> list[tuple[int, int]]:
    """The expert ranges ``[lo, hi)`` of one weight's chunks, :func:`experts_per_chunk` experts each."""
    per = experts_per_chunk(expert_bytes, num_experts, chunk_bytes)
    return [(lo, min(num_experts, lo + per)) for lo in range(0, num_experts, per)]


def decoded_range(lo: int, hi: int, expert_numel: int, total: int, group: int = NF4_SCALE_GROUP) -> tuple[int, int]:
    """The flat elements ``[start, end)`` decoded for experts ``[lo, hi)`` of a stacked weight of ``total``
    elements, ``expert_numel`` each: the experts' range widened to whole ``group``s (at most two groups more)."""
    return lo * expert_numel // group * group, min(total, -(-hi * expert_numel // group) * group)


def largest_decode(expert_numel: int, num_experts: int, expert_bytes: int, group: int = NF4_SCALE_GROUP,
                   chunk_bytes: int | None = None) -> int:
    """Elements of the largest range one call decodes, over its chunks (:func:`experts_per_chunk` experts each,
    :func:`decoded_range`)."""
    total = num_experts * expert_numel
    return max(end - start for lo, hi in chunk_ranges(num_experts, expert_bytes, chunk_bytes)
               for start, end in [decoded_range(lo, hi, expert_numel, total, group)])
