"""Decode matrix-vector product for 2-bit and ternary bases: ``y = x @ deq(W)^T`` for a few rows of
``x``, reading the packed codes and the group scales directly, never writing the dense weight.

Both formats store four 2-bit codes a byte along ``K`` (weight ``k`` of a row in byte ``k // 4`` at
bits ``2 * (k % 4)``) and fp16 scales per row and group of ``G`` inputs; they differ in the zero point:

    2-bit   (:class:`~notebookkit.kernels.q2.Q2Weight`)       w = (code - zero[n, g]) * scale[n, g]
    ternary (:class:`~notebookkit.kernels.ternary.TernaryWeight`) w = (code - 1) * scales[n, g]

with ``g = k // G``. For ``x [M, K]`` (``M`` the decode batch, ``c`` its dtype), cutting each row into
blocks ``b`` of up to 64 weights that share a scale:

    y[m, n] = c( sum_b s[n, b] * ( sum_{k in b} (4 + code[n, k]) x[m, k]  -  (4 + z[n, b]) * sum_{k in b} x[m, k] ) )

all in fp32 (``z = zero`` for 2-bit, 1 for ternary; the ``4 +`` cancels): the product with the weight
dequantised in fp32, up to the order of the fp32 additions. It is not rounded to ``c`` weight by weight
as the training path's dequantised weight is (a difference of one rounding of ``c`` a weight, below the
rounding of ``y``); the reference computes the same fp32 product.

Why ``4 + code``: the two code bits moved into bits 21-22 of 4.0's fp32 pattern (``0x40800000``, whose
bit 21 is worth 1) *are* the float ``4 + code``: a shift and one and-or a weight, no integer-to-float
conversion. ``x`` is read as 64-bit words, the four 16-bit values a code byte multiplies (two words for
fp32 ``x``), widened by shifts (bf16) or one conversion each (fp16).

Kernel (the NF4 decode matvec's mould, :mod:`~notebookkit.kernels.nf4_matvec`): a program owns
``BLOCK_N`` rows of ``W`` and one row of ``x`` (grid ``[N / BLOCK_N, M]``) and walks the rows ``STEP``
blocks at a time: a ``[BLOCK_N, STEP, bytes a block]`` tile of code bytes, the ``x`` words in the same
layout (every row of the tile reads the same words, from L1), four multiply-adds a byte, the block's
scale and zero applied elementwise into a per-thread accumulator of the tile's shape, one reduction after
the last step. No ``tl.dot`` (bf16 runs under the interpreter too), no split over ``K``, deterministic.
Each row of ``x`` reads ``W`` again: meant for ``M`` up to :data:`MAX_ROWS`; more rows, and weights the
kernel cannot take (:func:`block_bytes` 0: ``K`` not a multiple of 4), go through
:func:`~notebookkit.kernels.chunked_dequant_matmul.low_bit_matmul`, CPU tensors through the reference.
:data:`CONFIG` is the pick of the H200 sweep ``benchmarks/low_bit_matvec.py`` (session 22: 83.9 us a
Llama-3.1-8B layer at 2-bit, 77.1 us ternary, against 125.7 us for cuBLAS's dense bf16 GEMV).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from .chunked_dequant_matmul import low_bit_matmul
from .q2 import Q2Weight, dequantize_q2_reference
from .dequant_gemm import as_rows
from .q2_matmul import q2_operand_rows
from .runtime import should_use_triton
from .ternary import TernaryWeight, dequantize_ternary_reference
from .ternary_matmul import check_ternary_operand

__all__ = ["MAX_ROWS", "CONFIG", "block_bytes", "low_bit_matvec", "low_bit_matvec_reference", "AOT_SPECS"]

#: rows from which the matvec hands over to the GEMM path (each row re-reads ``W`` here)
MAX_ROWS = 4


def low_bit_matvec_reference(x: torch.Tensor, w) -> torch.Tensor:
    """Same math in plain PyTorch: the weight dequantised in fp32, an fp32 product, one rounding to ``x``'s dtype."""
    deq = (dequantize_q2_reference(w, torch.float32) if isinstance(w, Q2Weight)
           else dequantize_ternary_reference(w, torch.float32))
    return (x.float() @ deq.t()).to(x.dtype)


@triton.jit
def _x_quad(x_ptr, at, ok, X_KIND: tl.constexpr):
    """``x[4 t .. 4 t + 3]`` in fp32 for byte indices ``at``: one 64-bit word holds the four 16-bit values
    (the first in the low bits); fp32 ``x`` is read as two 64-bit words. Bit shifts widen bf16 exactly."""
    if X_KIND == 0:
        lo = tl.load(x_ptr + 2 * at, mask=ok, other=0)
        hi = tl.load(x_ptr + 2 * at + 1, mask=ok, other=0)
        x0 = lo.to(tl.int32).to(tl.float32, bitcast=True)
        x1 = (lo >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        x2 = hi.to(tl.int32).to(tl.float32, bitcast=True)
        x3 = (hi >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        word = tl.load(x_ptr + at, mask=ok, other=0)
        lo = word.to(tl.int32)
        hi = (word >> 32).to(tl.int32)
        if X_KIND == 2:
            x0 = (lo << 16).to(tl.float32, bitcast=True)
            x1 = (lo & -65536).to(tl.float32, bitcast=True)
            x2 = (hi << 16).to(tl.float32, bitcast=True)
            x3 = (hi & -65536).to(tl.float32, bitcast=True)
        else:
            x0 = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x1 = (lo >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x2 = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x3 = (hi >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return x0, x1, x2, x3


@triton.jit
def _four_plus_code(byte, SHIFT: tl.constexpr):
    """``4 + code`` as fp32 for the code in bits ``21 - SHIFT`` and ``22 - SHIFT`` of ``byte``: the two code bits
    moved into mantissa bits 21-22 of 4.0 (``0x40800000``, where bit 21 is worth 1); no integer-to-float
    conversion."""
    return (((byte << SHIFT) & 0x600000) | 0x40800000).to(tl.float32, bitcast=True)


@triton.jit
def _low_bit_matvec_kernel(
    x_ptr,  # *i64 [M, K / 4] (16-bit x, four values a word) or [M, K / 2] (fp32 x, two a word)
    codes_ptr,  # *u8 [N, row_bytes]: four 2-bit codes a byte
    scale_ptr, zero_ptr,  # *fp16 [N, n_groups] each (zero_ptr unused without HAS_ZERO)
    y_ptr,  # *c [M, N] contiguous
    N, row_bytes, n_groups, group_size, stride_xm,
    BLOCK_N: tl.constexpr, STEP: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    X_KIND: tl.constexpr, HAS_ZERO: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    row_ok = rows < N
    blocks_per_row = row_bytes // BLOCK_BYTES
    byte_in_block = tl.arange(0, BLOCK_BYTES)
    acc = tl.zeros((BLOCK_N, STEP, BLOCK_BYTES), dtype=tl.float32)
    for step in range(0, tl.cdiv(blocks_per_row, STEP)):
        block = step * STEP + tl.arange(0, STEP)  # [STEP] blocks of this step in the row
        ok = row_ok[:, None] & (block < blocks_per_row)[None, :]  # [BLOCK_N, STEP]
        at = block[None, :, None] * BLOCK_BYTES + byte_in_block[None, None, :]  # [1, STEP, BYTES] byte in the row
        byte = tl.load(codes_ptr + rows[:, None, None] * row_bytes + at, mask=ok[:, :, None], other=0).to(tl.int32)
        # x in the bytes' layout (a row index times 0): every row of the tile reads the same words, from L1
        x0, x1, x2, x3 = _x_quad(x_ptr + m * stride_xm, at + 0 * rows[:, None, None], ok[:, :, None], X_KIND)
        dot = _four_plus_code(byte, 21) * x0  # sum over the byte's four weights of (4 + code) x
        dot = tl.fma(_four_plus_code(byte, 19), x1, dot)
        dot = tl.fma(_four_plus_code(byte, 17), x2, dot)
        dot = tl.fma(_four_plus_code(byte, 15), x3, dot)
        xsum = (x0 + x1) + (x2 + x3)
        group = rows[:, None] * n_groups + (block * (4 * BLOCK_BYTES) // group_size)[None, :]  # [BLOCK_N, STEP]
        scale = tl.load(scale_ptr + group, mask=ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            shift = tl.load(zero_ptr + group, mask=ok, other=0.0).to(tl.float32) + 4.0
        else:
            shift = tl.full((BLOCK_N, STEP), 5.0, tl.float32)  # ternary: zero 1
        # sum (code - zero) x = sum (4 + code) x - (4 + zero) sum x
        acc = tl.fma(scale[:, :, None], tl.fma(-shift[:, :, None], xsum, dot), acc)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(y_ptr + m * N + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


_X_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

#: (BLOCK_N, blocks a step, num_warps); ``benchmarks/low_bit_matvec.py`` sweeps the alternatives
CONFIG = (4, 32, 2)


def _parts(w) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(codes, scale, zero, group size, groups a row) of a packed weight; ``zero`` is the scale for ternary
    (never read there)."""
    if isinstance(w, Q2Weight):
        return w.codes, w.scale, w.zero, w.group_size, w.scale.shape[1]
    if isinstance(w, TernaryWeight):
        return w.packed, w.scales, w.scales, w.group_size, w.scales.shape[1]
    raise TypeError(f"low_bit_matvec takes a Q2Weight or a TernaryWeight, got {type(w).__name__}.")


def block_bytes(codes: torch.Tensor, k: int, group_size: int, n_groups: int) -> int:
    """Code bytes of the kernel's block (16, 8, 4, 2 or 1: 64 down to 4 weights), the largest whose weights share a
    scale (one group a row, or groups a multiple of the block) and divide a row; 0 where the kernel cannot take
    the weight (``K`` not a multiple of 4, or code rows that are not contiguous)."""
    if k % 4 or codes.shape[1] != k // 4 or codes.stride(1) != 1 or codes.stride(0) != codes.shape[1]:
        return 0
    for nbytes in (16, 8, 4, 2, 1):
        if k % (4 * nbytes) == 0 and (n_groups == 1 or group_size % (4 * nbytes) == 0):
            return nbytes
    return 0


def _as_words(x2: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` seen as 64-bit words (four 16-bit values a word, two fp32); copied where its rows are not
    contiguous or its start is not 8-byte aligned."""
    if not x2.is_contiguous() or (x2.storage_offset() * x2.element_size()) % 8:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    return x2.view(torch.int64)


def _rows_of(x: torch.Tensor, w, k: int) -> torch.Tensor:
    if isinstance(w, Q2Weight):
        return q2_operand_rows(x, w, k, "low_bit_matvec", "x")
    check_ternary_operand(x, w, "x", "low_bit_matvec")
    return as_rows(x, k)


def low_bit_matvec(x: torch.Tensor, w, config: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """``x @ deq(W)^T`` for ``x [..., K]`` of at most :data:`MAX_ROWS` rows without decoding ``W`` (CUDA,
    or Triton forced under the interpreter); more rows go through ``low_bit_matmul``, CPU tensors
    through the reference. ``config`` = ``(BLOCK_N, blocks a step, warps)`` overrides :data:`CONFIG` (the sweep)."""
    codes, scale, zero, group, n_groups = _parts(w)
    n, k = w.shape
    x2 = _rows_of(x, w, k)
    if not should_use_triton(x):
        return low_bit_matvec_reference(x2, w).reshape(*x.shape[:-1], n)
    m = x2.shape[0]
    nbytes = block_bytes(codes, k, group, n_groups)
    if m > MAX_ROWS or not nbytes:
        return low_bit_matmul(x, w)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        block_n, step, warps = config or CONFIG
        x_words = _as_words(x2)
        _low_bit_matvec_kernel[(triton.cdiv(n, block_n), m)](
            x_words, codes, scale, zero, y, n, codes.shape[1], n_groups, group, x_words.stride(0),
            BLOCK_N=block_n, STEP=step, BLOCK_BYTES=nbytes, X_KIND=_X_KINDS[x.dtype],
            HAS_ZERO=isinstance(w, Q2Weight), num_warps=warps)
    return y.reshape(*x.shape[:-1], n)


def _aot_specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """Both formats (2-bit with its zero, ternary without), fp16 and bf16, blocks of 64 weights, at :data:`CONFIG`."""
    specs = []
    block_n, step, warps = CONFIG
    for ty, kind in (("fp16", 1), ("bf16", 2)):
        signature = {"x_ptr": "*i64", "codes_ptr": "*u8", "scale_ptr": "*fp16", "zero_ptr": "*fp16",
                     "y_ptr": f"*{ty}", "N": "i32", "row_bytes": "i32", "n_groups": "i32", "group_size": "i32",
                     "stride_xm": "i32"}
        for has_zero in (True, False):
            constexprs = {"BLOCK_N": block_n, "STEP": step, "BLOCK_BYTES": 16, "X_KIND": kind, "HAS_ZERO": has_zero}
            specs.append((_low_bit_matvec_kernel, signature, constexprs, {"num_warps": warps}))
    return specs


AOT_SPECS = _aot_specs()
