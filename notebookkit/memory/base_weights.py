"""The frozen base's share of the memory model, read off the base-format record.

Every byte here comes from :mod:`notebookkit.base_formats` (one row per format); this module only
applies a row to a model's shapes, for the training estimate, generation and the vision tower alike.

With ``L`` layers, a projection ``[out, in]``, ``b(in)`` the record's bytes per weight
(``BaseFormat.bytes_per_weight``: 2-bit ``0.25 + 4/64``, ternary ``0.25 + 2/in``, NF4 ``0.5 + 1/64 +
4/(64*256)``, 16-bit ``s``):

    decoder projections   L * sum_proj in * out * b(in)         (ternary's row scale depends on in)

What a GEMM through the base adds to a working set (the record's ``product``), with ``N`` tokens:

    "dequantise" (NF4)    max_proj(in * out) * s     one dense copy of the weight being multiplied
    "chunks" (2-bit, ternary)
                          min(C, max_proj(in * out) * s)   one dense chunk of the weight, C = 32 MiB, when
                                                     N >= 256 (cuBLAS on chunks; fewer rows: in-tile, 0)
                          + N * H * s (backward)     the fresh ``[N, in]`` input gradient of the second
                                                     (third) projection reading one input (q/k/v read H,
                                                     gate/up read H), alive until it is added to the
                                                     first one's; nothing else is allocated (the outputs
                                                     are the tensors the estimate counts)
    "dense" (16-bit)      0                          (``addmm_`` into one buffer)
"""

from __future__ import annotations

from typing import Iterable

from notebookkit.base_formats import BASE_FORMATS, DEQUANT_CHUNK_BYTES, DEQUANT_CHUNK_MIN_ROWS, BaseFormat

from .shapes import ModelShape

__all__ = ["base_format_for", "load_flags", "linear_weight_bytes", "projection_weight_bytes",
           "dense_copy_bytes", "input_grad_buffer_bytes"]


def load_flags() -> tuple[str, ...]:
    """The ``from_pretrained`` keywords that choose a quantised base (``load_in_4bit``, ``load_in_2bit``, ...)."""
    return tuple(f.load_flag for f in BASE_FORMATS.values() if f.load_flag)


def base_format_for(**flags: bool) -> BaseFormat:
    """The format asked for by ``from_pretrained``'s flags (``load_in_4bit=True`` -> NF4; none -> 16-bit).

    More than one set is refused: a base is held in one format.
    """
    unknown = sorted(set(flags) - set(load_flags()))
    if unknown:
        raise ValueError(f"notebookkit.memory: unknown base-format flags {unknown}; use one of {list(load_flags())}.")
    chosen = [f for f in BASE_FORMATS.values() if f.load_flag and flags.get(f.load_flag)]
    if len(chosen) > 1:
        names = " and ".join(f"{f.load_flag}=True" for f in chosen)
        raise ValueError(
            f"notebookkit.memory: {names} ask for two formats of the frozen base weights; a base is held in one. "
            f"Keep one flag: {', '.join(f'{f.load_flag} ({f.label})' for f in chosen)}.")
    return chosen[0] if chosen else BASE_FORMATS["16bit"]


def linear_weight_bytes(shapes: Iterable[tuple[int, int]], fmt: BaseFormat, s: int, double_quant: bool = True) -> int:
    """Bytes of linear weights ``(in_features, out_features)`` held in ``fmt``."""
    return int(sum(i * o * fmt.bytes_per_weight(i, s, double_quant) for i, o in shapes))


def projection_weight_bytes(shape: ModelShape, fmt: BaseFormat, s: int, double_quant: bool = True) -> int:
    """Bytes of all decoder projections: ``L * sum_proj in * out * b(in)``."""
    return shape.num_layers * linear_weight_bytes(shape.projection_shapes().values(), fmt, s, double_quant)


def dense_copy_bytes(shape: ModelShape, fmt: BaseFormat, s: int, tokens: int) -> int:
    """The dense weight alive during one product of ``tokens`` rows: a ``"dequantise"`` format's copy of the
    largest projection, a ``"chunks"`` format's chunk from :data:`DEQUANT_CHUNK_MIN_ROWS` rows (0 otherwise)."""
    largest = max(i * o for i, o in shape.projection_shapes().values()) * s
    if fmt.product == "dequantise":
        return largest
    if fmt.product == "chunks" and tokens >= DEQUANT_CHUNK_MIN_ROWS:
        return min(largest, DEQUANT_CHUNK_BYTES)
    return 0


def input_grad_buffer_bytes(shape: ModelShape, fmt: BaseFormat, tokens: int, s: int) -> int:
    """The fresh input gradient a ``"chunks"`` product writes for a projection sharing its input (0 otherwise)."""
    if fmt.product != "chunks":
        return 0
    return tokens * shape.hidden_size * s
