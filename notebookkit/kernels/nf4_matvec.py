"""NF4 matrix-vector product for decoding: ``y = x @ dequant(W)^T (+ b)`` for a few rows of ``x``,
reading bitsandbytes' 4-bit bytes and block scales directly, never writing the dense weight.

Math (``W`` is ``[N, K]``, ``x`` is ``[M, K]`` with ``M`` the decode batch, 1..16; ``a[n, b]`` the fp32
absmax of NF4 block ``b`` of row ``n``, plain or nested ``code2 * absmax2 + offset`` rounded twice as
bitsandbytes does; ``c`` the dtype of ``x``, fp16, bf16 or fp32):

* one row (``M == 1``, the row kernel): the block scale multiplies a block's sum, the weight is never
  rounded to ``c``::

      y[n] = c( sum_b a[n, b] * sum_{k in b} NF4[code(n, k)] * fp32(x[k])  +  b[n] )

  which is closer to the exact product than dequantise-then-multiply (whose ``w`` is rounded to ``c``);
* several rows (``M >= 2``, ``tl.dot`` on the tensor cores): ``w[n, k] = c(NF4[code(n, k)] * a[n, b])``,
  bit for bit :func:`notebookkit.kernels.nf4.dequantize_nf4`, and
  ``y[m, n] = c( sum_k fp32(x[m, k]) * w[n, k] + b[n] )``: the dequantise-then-multiply numbers up to the
  order of the fp32 additions.

With a LoRA adapter given (``lora = (U, B, s)``, ``U = X A^T`` ``[M, r]`` already computed, ``B``
``[N, r]``), ``s * sum_j fp32(U[m, j]) * B[n, j]`` joins the same fp32 sum before the one rounding (a
decode projection is one launch). There is no backward: decoding runs without gradients.

Layout (bitsandbytes' NF4, see :mod:`notebookkit.kernels.nf4`): the flat weight in row-major order,
two 4-bit codes a byte (element ``2i`` in the high nibble), one scale per ``B`` consecutive elements
(64). With ``K`` a multiple of ``B`` every row is ``K / B`` whole blocks; a program of the row kernel
(one row of ``x``) owns ``BLOCK_N`` whole rows of ``W`` (one launch, no workspace, the same result every
run) and walks along them ``STEP_BLOCKS`` blocks at a time. The ``tl.dot`` kernel (two to 16 rows of
``x``) also splits ``K`` (``MatvecConfig.split_k``, :func:`dot_split_k`): its programs store fp32 sums of
their share of the steps and a second launch adds them in a fixed order, so the result is still the same
every run. ``x`` is read as 32-bit words of two 16-bit values (64-bit for fp32): word ``t`` is the pair
``(x[2t], x[2t + 1])`` that code byte ``t`` multiplies.

The NF4 level of a code: on a GPU each lane of a warp holds ``NF4[lane % 16]`` and a warp shuffle
(``shfl.sync.idx``, the lane from the low 5 bits of the index) fetches any level in one instruction,
with no address arithmetic and no cache traffic; under the interpreter a load from the 16-entry
table does the same.

The row kernel spends few instructions a weight byte: two shuffles for its levels (the low nibble's
straight from the byte: the bit above it picks lanes 16-31, which hold the same table), two fp32
products with ``x`` and one multiply-add by the block's scale; no rounding of ``w``.
``benchmarks/ptx_census.py`` counts the loop's instructions per weight byte (at about 8 a byte,
instruction issue alone would let an H200 SM read at the copy bandwidth). A tile ``[rows, ...]`` puts each
row in other threads, so every thread unpacks ``x`` for its own row; with ``MatvecConfig.rows_in_thread``
(:data:`ROWS_IN_THREAD_CONFIG`) a thread holds the program's four rows at the same columns and unpacks ``x``
once for them (:func:`_row_products_in_thread`): 9.2 SASS instructions a byte on sm_90 against 12.2 (fp16, nested,
LoRA; bf16 9.2 against 11.2), 167 registers on sm_75 without spills. Timed on an H200 (session 36, bf16) it is
slower at five of the seven 8B shapes (the LM head 187 against 157 us): the loop is bound by memory latency, not by
instructions, and fewer loads stay in flight at that register count. So it is not :func:`matvec_config`'s choice
unless ``NOTEBOOKKIT_NF4_ROWS_IN_THREAD=1`` (an A/B switch); the sweep keeps timing it.

Several weights that read the same ``x`` (a decode layer's q/k/v, its gate/up) run in one launch of the row
kernel (:func:`nf4_matvec_group`): each weight's rows are programs of their own, picked by one scalar test of
the program id, so each output is the one-weight kernel's bits and a batch-1 decode layer launches 4 matvecs
instead of 7.

Weights whose rows are not whole NF4 blocks (``K % B != 0``: blocks straddle rows) are not run by
the kernels: :func:`nf4_matvec_supported` says ``False`` and :func:`nf4_matvec` decodes the weight
(``dequantize_nf4``) and multiplies. Graph-safe: no host synchronisation, the only allocations are ``y``
and, split along K, the splits' fp32 sums (their sizes from the shapes). The kernels compile without FMA
contraction (``enable_fp_fusion=False``: the nested absmax is a product and a sum, two roundings, as in
bitsandbytes); the accumulation uses explicit ``tl.fma``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from .nf4 import (dequantize_nf4, dequantize_nf4_reference, nf4_kernel_operands, program_rows, read_nf4_state,
                  unwrap_nf4_weight)
from .runtime import interpreter_on, should_use_triton, sm_count

__all__ = [
    "MAX_GROUP", "MAX_ROWS", "ROWS_IN_THREAD_CONFIG", "LoRATerm", "MatvecConfig", "dot_split_k", "matvec_config",
    "nf4_matvec", "nf4_matvec_group",
    "nf4_matvec_reference", "nf4_matvec_supported",
    "AOT_SPECS",
]

MAX_ROWS = 16  # rows of x (the decode batch) the kernel takes; tl.dot pads to this many
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# X_KIND of the kernel: how x's words hold two values, and the rounding of w and y
_X_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_WORDS = {torch.float32: torch.int64, torch.float16: torch.int32, torch.bfloat16: torch.int32}


class LoRATerm(NamedTuple):
    """A LoRA adapter's part of a projection, added by the kernel: ``s U B^T`` with ``U = X A^T``."""

    u: torch.Tensor  # [M, r], x's dtype
    lora_B: torch.Tensor  # [N, r], x's dtype
    scaling: float


# --------------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------------


@triton.jit
def _block_scale(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, blocks, ok,
                 BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr, MASKED: tl.constexpr):
    """fp32 absmax of NF4 blocks ``blocks`` (``ok``: which exist, when ``MASKED``); nested as
    ``fp32(code2[c] * absmax2[b // BLOCKSIZE2]) + offset`` (no FMA: the kernel compiles without
    contraction), as in bitsandbytes' decode. :func:`notebookkit.kernels.nf4.block_absmax` with
    bounds checks that can be left out."""
    if NESTED:
        if MASKED:
            c = tl.load(absmax_ptr + blocks, mask=ok, other=0).to(tl.int32)
            s2 = tl.load(absmax2_ptr + blocks // BLOCKSIZE2, mask=ok, other=0.0)
        else:
            c = tl.load(absmax_ptr + blocks).to(tl.int32)
            s2 = tl.load(absmax2_ptr + blocks // BLOCKSIZE2)
        absmax = tl.load(code2_ptr + c) * s2
        absmax = absmax + tl.load(offset_ptr)
    elif MASKED:
        absmax = tl.load(absmax_ptr + blocks, mask=ok, other=0.0)
    else:
        absmax = tl.load(absmax_ptr + blocks)
    return absmax


@triton.jit
def _lane_level(table_ptr, LANE_TABLE: tl.constexpr):
    """This lane's NF4 level, ``NF4[lane % 16]``, for :func:`_nf4_level` (0 without ``LANE_TABLE``)."""
    if LANE_TABLE:
        lane = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [tl.full((1,), 0, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)
        level = tl.load(table_ptr + (lane & 15))
    else:
        level = tl.full((1,), 0.0, tl.float32)
    return level


@triton.jit
def _nf4_level(lane_level, table_ptr, code, LANE_TABLE: tl.constexpr):
    """``NF4[code & 15]`` (fp32): a warp shuffle from the lane holding it (the table is in lanes 0-15
    and again in 16-31, the shuffle reads the low 5 bits of ``code``), or a load from the table."""
    if LANE_TABLE:
        level = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 31, -1;", "=r,r,r", [lane_level, code],
                                          dtype=tl.float32, is_pure=True, pack=1)
    else:
        level = tl.load(table_ptr + (code & 15))
    return level


@triton.jit
def _round_one(v, X_KIND: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    if X_KIND == 1:
        v = v.to(tl.float16).to(tl.float32)
    elif X_KIND == 2 and BF16_BY_HAND:
        bits = v.to(tl.uint32, bitcast=True)
        v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif X_KIND == 2:
        v = v.to(tl.bfloat16).to(tl.float32)
    return v


@triton.jit
def _x_pair(word, X_KIND: tl.constexpr, dtype: tl.constexpr):
    """``(x[2t], x[2t + 1])`` in ``dtype`` from the word holding both (little endian: the first in the
    low half)."""
    if X_KIND == 0:
        even = word.to(tl.int32).to(tl.float32, bitcast=True)
        odd = (word >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    elif X_KIND == 2 and dtype == tl.float32:
        even = (word << 16).to(tl.float32, bitcast=True)
        odd = (word & -65536).to(tl.float32, bitcast=True)
    elif X_KIND == 2:
        even = word.to(tl.int16).to(tl.bfloat16, bitcast=True)
        odd = (word >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        even = word.to(tl.int16).to(tl.float16, bitcast=True).to(dtype)
        odd = (word >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(dtype)
    return even, odd


@triton.jit
def _low_rank(u_ptr, lora_b_ptr, rows, row_ok, ms, m_ok, stride_u, rank, RANK: tl.constexpr):
    """``sum_j B[n, j] u[m, j]`` (fp32) for this program's rows ``n`` and the batch rows ``m``:
    ``[BLOCK_N, BLOCK_M]``, products of 16-bit values, exact in fp32 (no ``tl.dot``: the rank can be
    below 16, and ``BLOCK_N x RANK x BLOCK_M`` is a few thousand multiply-adds)."""
    js = tl.arange(0, RANK)
    j_ok = js < rank
    b = tl.load(lora_b_ptr + rows[:, None] * rank + js[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0.0)
    u = tl.load(u_ptr + ms[None, :] * stride_u + js[:, None], mask=j_ok[:, None] & m_ok[None, :], other=0.0)
    return tl.sum(b.to(tl.float32)[:, :, None] * u.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _code_tile(packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, first_block, row_ok, step,
               blocks_per_row, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr, MASKED: tl.constexpr,
               STEP_BLOCKS: tl.constexpr, HALF: tl.constexpr):
    """Loop step ``step`` of a program's rows: ``(code bytes [BLOCK_N, R, HALF] as int32, their blocks'
    fp32 scales [BLOCK_N, R], the step's blocks of a row [R], which of those exist [R])``."""
    block_in_row = step * STEP_BLOCKS + tl.arange(0, STEP_BLOCKS)
    col_ok = block_in_row < blocks_per_row
    blocks = first_block[:, None] + block_in_row[None, :]  # [BLOCK_N, R]
    ok = row_ok[:, None] & col_ok[None, :]
    absmax = _block_scale(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, blocks, ok, BLOCKSIZE2, NESTED, MASKED)
    at = blocks[:, :, None] * HALF + tl.arange(0, HALF)[None, None, :]  # [BLOCK_N, R, HALF] byte index
    if MASKED:
        byte = tl.load(packed_ptr + at, mask=ok[:, :, None], other=0).to(tl.int32)
    else:
        byte = tl.load(packed_ptr + at).to(tl.int32)
    return byte, absmax, block_in_row, col_ok


@triton.jit
def _row_products(x_words_ptr, packed_ptr, absmax_ptr, table_ptr, code2_ptr, absmax2_ptr, offset_ptr, bias_ptr, u_ptr,
                  lora_b_ptr, y_ptr, rows, N, blocks_per_row, rank, lora_scale, BLOCKSIZE: tl.constexpr,
                  BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
                  RANK: tl.constexpr, BLOCK_N: tl.constexpr, STEP_BLOCKS: tl.constexpr, X_KIND: tl.constexpr,
                  MASKED: tl.constexpr, PREFETCH: tl.constexpr, LANE_TABLE: tl.constexpr,
                  BF16_BY_HAND: tl.constexpr):
    """Rows ``rows`` of ``y`` for one row of ``x``: ``y[n] = sum_b absmax[n, b] * sum_{k in b} NF4[code(n, k)] * x[k]``
    in fp32 (the body of :func:`_nf4_matvec_row_kernel` and :func:`_nf4_matvec_rows_group_kernel`).

    The tile is ``[BLOCK_N, STEP_BLOCKS, BLOCKSIZE / 2]`` code bytes with ``x``'s pair words in the same
    shape: byte ``t`` of a row holds the codes of columns ``2t`` (high nibble) and ``2t + 1`` (low), the
    pair word ``t`` holds ``(x[2t], x[2t + 1])``. A byte costs two shuffles (its levels), two products
    in fp32 and one multiply-add by its block's scale into an accumulator of the tile's shape, summed
    once after the last step; the weight is never rounded to ``x``'s dtype."""
    HALF: tl.constexpr = BLOCKSIZE // 2  # bytes of an NF4 block
    row_ok = rows < N
    first_block = rows * blocks_per_row
    byte_in_block = tl.arange(0, HALF)
    lane_level = _lane_level(table_ptr, LANE_TABLE)
    acc = tl.zeros((BLOCK_N, STEP_BLOCKS, HALF), dtype=tl.float32)  # reduced once, after the loop
    steps = tl.cdiv(blocks_per_row, STEP_BLOCKS)
    if PREFETCH:  # the first step's tile before the loop; each step then asks for the next one's
        next_byte, next_absmax, next_blocks, next_ok = _code_tile(
            packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, first_block, row_ok, 0, blocks_per_row,
            BLOCKSIZE2, NESTED, MASKED, STEP_BLOCKS, HALF)
    for step in range(0, steps):
        if PREFETCH:  # in flight while this step computes (the last step asks for its own tile again)
            byte, absmax, block_in_row, col_ok = next_byte, next_absmax, next_blocks, next_ok
            next_byte, next_absmax, next_blocks, next_ok = _code_tile(
                packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, first_block, row_ok,
                tl.minimum(step + 1, steps - 1), blocks_per_row, BLOCKSIZE2, NESTED, MASKED, STEP_BLOCKS, HALF)
        else:
            byte, absmax, block_in_row, col_ok = _code_tile(
                packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, first_block, row_ok, step, blocks_per_row,
                BLOCKSIZE2, NESTED, MASKED, STEP_BLOCKS, HALF)
        # x's pair words in the bytes' shape (a row index times 0): every row of the tile reads the same
        # words (from L1), in the layout of the bytes they multiply
        word_at = x_words_ptr + (block_in_row[None, :, None] * HALF + byte_in_block[None, None, :]
                                 + 0 * rows[:, None, None])
        if MASKED:
            word = tl.load(word_at, mask=col_ok[None, :, None], other=0)
        else:
            word = tl.load(word_at)
        x_hi, x_lo = _x_pair(word, X_KIND, tl.float32)
        # the low nibble's shuffle reads the byte's low 5 bits: the bit above the nibble picks lanes
        # 16-31, which hold the same table
        part = _nf4_level(lane_level, table_ptr, byte, LANE_TABLE) * x_lo
        part = tl.fma(_nf4_level(lane_level, table_ptr, byte >> 4, LANE_TABLE), x_hi, part)
        acc = tl.fma(part, absmax[:, :, None], acc)  # a byte's two products times its block's scale
    _store_rows(tl.sum(tl.sum(acc, axis=2), axis=1), rows, row_ok, bias_ptr, u_ptr, lora_b_ptr, y_ptr, rank,
                lora_scale, HAS_BIAS, HAS_LORA, RANK, X_KIND, BF16_BY_HAND)


@triton.jit
def _row_tile(packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, row, N, block_in_row, col_ok,
              blocks_per_row, byte_in_block, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr, MASKED: tl.constexpr,
              HALF: tl.constexpr):
    """One row's loop step for :func:`_row_products_in_thread`: ``(code bytes [R, HALF] as int32, the blocks'
    fp32 scales [R])`` of row ``row`` (a scalar; rows past ``N`` read nothing when ``MASKED``)."""
    blocks = row * blocks_per_row + block_in_row
    ok = col_ok & (block_in_row * 0 + row < N)  # the row test as a vector (a scalar mask trips the interpreter)
    absmax = _block_scale(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, blocks, ok, BLOCKSIZE2, NESTED, MASKED)
    at = blocks[:, None] * HALF + byte_in_block[None, :]
    if MASKED:
        byte = tl.load(packed_ptr + at, mask=ok[:, None], other=0).to(tl.int32)
    else:
        byte = tl.load(packed_ptr + at).to(tl.int32)
    return byte, absmax


@triton.jit
def _row_products_in_thread(x_words_ptr, packed_ptr, absmax_ptr, table_ptr, code2_ptr, absmax2_ptr, offset_ptr,
                            bias_ptr, u_ptr, lora_b_ptr, y_ptr, first_row, N, blocks_per_row, rank, lora_scale,
                            BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
                            HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, RANK: tl.constexpr,
                            STEP_BLOCKS: tl.constexpr, X_KIND: tl.constexpr, MASKED: tl.constexpr,
                            LANE_TABLE: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """Rows ``first_row + [0, 4)`` of ``y`` as :func:`_row_products` computes them, with the four rows held in
    each thread: the tile is ``[STEP_BLOCKS, BLOCKSIZE / 2, 2, 2]``, the last two dimensions the rows (joined with
    ``tl.join``, whose new dimension stays in one thread). Each thread then unpacks ``x``'s words once for the four
    rows' bytes at the same columns, where a tile ``[rows, ...]`` spreads the rows over threads and each unpacks
    them again: the loop's SASS (sm_90, fp16, nested, LoRA) is 9.2 instructions a weight byte at 64 blocks a step
    against the row-per-thread tile's 12.2 (``x``'s conversions 2 a byte to 0.5). Each row's sum is
    the same products in the same fp32 accumulator element as there; the final reduction's order may differ."""
    HALF: tl.constexpr = BLOCKSIZE // 2
    byte_in_block = tl.arange(0, HALF)
    lane_level = _lane_level(table_ptr, LANE_TABLE)
    acc = tl.zeros((STEP_BLOCKS, HALF, 2, 2), dtype=tl.float32)
    for step in range(0, tl.cdiv(blocks_per_row, STEP_BLOCKS)):
        block_in_row = step * STEP_BLOCKS + tl.arange(0, STEP_BLOCKS)
        col_ok = block_in_row < blocks_per_row
        b0, a0 = _row_tile(packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, first_row, N, block_in_row,
                           col_ok, blocks_per_row, byte_in_block, BLOCKSIZE2, NESTED, MASKED, HALF)
        b1, a1 = _row_tile(packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, first_row + 1, N, block_in_row,
                           col_ok, blocks_per_row, byte_in_block, BLOCKSIZE2, NESTED, MASKED, HALF)
        b2, a2 = _row_tile(packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, first_row + 2, N, block_in_row,
                           col_ok, blocks_per_row, byte_in_block, BLOCKSIZE2, NESTED, MASKED, HALF)
        b3, a3 = _row_tile(packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, first_row + 3, N, block_in_row,
                           col_ok, blocks_per_row, byte_in_block, BLOCKSIZE2, NESTED, MASKED, HALF)
        # [..., k, j] holds row 2 k + j: join(join(r0, r2), join(r1, r3)) puts r0, r2 at j = 0 and r1, r3 at j = 1
        byte = tl.join(tl.join(b0, b2), tl.join(b1, b3))
        absmax = tl.join(tl.join(a0, a2), tl.join(a1, a3))
        word_at = x_words_ptr + block_in_row[:, None] * HALF + byte_in_block[None, :]
        if MASKED:
            word = tl.load(word_at, mask=col_ok[:, None], other=0)
        else:
            word = tl.load(word_at)
        x_hi, x_lo = _x_pair(word, X_KIND, tl.float32)  # once for the four rows
        part = _nf4_level(lane_level, table_ptr, byte, LANE_TABLE) * x_lo[:, :, None, None]
        part = tl.fma(_nf4_level(lane_level, table_ptr, byte >> 4, LANE_TABLE), x_hi[:, :, None, None], part)
        acc = tl.fma(part, absmax[:, None, :, :], acc)
    rows = first_row + tl.arange(0, 4)
    _store_rows(tl.reshape(tl.sum(tl.sum(acc, axis=1), axis=0), (4,)), rows, rows < N, bias_ptr, u_ptr, lora_b_ptr,
                y_ptr, rank, lora_scale, HAS_BIAS, HAS_LORA, RANK, X_KIND, BF16_BY_HAND)


@triton.jit
def _store_rows(y, rows, row_ok, bias_ptr, u_ptr, lora_b_ptr, y_ptr, rank, lora_scale, HAS_BIAS: tl.constexpr,
                HAS_LORA: tl.constexpr, RANK: tl.constexpr, X_KIND: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """``y[rows] = round(y + b[rows] + s (U B^T)[rows])``: the row kernels' epilogue (fp32 ``y`` of the rows)."""
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_LORA:
        one = tl.arange(0, 1)
        low_rank = _low_rank(u_ptr, lora_b_ptr, rows, row_ok, one, one < 1, 0, rank, RANK)
        y = y + lora_scale * tl.sum(low_rank, axis=1)
    y = _round_one(y, X_KIND, BF16_BY_HAND)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _nf4_matvec_row_kernel(
    x_words_ptr,  # *i32 (fp16 / bf16 x) or *i64 (fp32 x): the one row of x as K / 2 words
    packed_ptr,  # *u8 NF4 bytes of W [N, K]
    absmax_ptr,  # *fp32 [n_blocks] (plain) or *u8 [n_blocks] (nested codes)
    table_ptr,  # *fp32 [16] NF4 levels
    code2_ptr,  # *fp32 [256] dynamic map (nested only)
    absmax2_ptr,  # *fp32 second-level scales (nested only)
    offset_ptr,  # *fp32 [1] mean offset (nested only)
    bias_ptr,  # x's dtype [N] (HAS_BIAS only)
    u_ptr,  # x's dtype, [1, rank]: x A^T of a LoRA adapter (HAS_LORA only)
    lora_b_ptr,  # x's dtype, [N, rank] contiguous: its B (HAS_LORA only)
    y_ptr,  # x's dtype, [N]
    N,
    blocks_per_row,  # K // BLOCKSIZE
    rank,
    lora_scale,  # fp32 s
    BLOCKSIZE: tl.constexpr,
    BLOCKSIZE2: tl.constexpr,
    NESTED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,  # rows of W per program
    STEP_BLOCKS: tl.constexpr,  # NF4 blocks of a row per loop step
    X_KIND: tl.constexpr,  # 0 fp32, 1 fp16, 2 bf16
    MASKED: tl.constexpr,
    PREFETCH: tl.constexpr,  # load the next step's tile before this step's arithmetic
    LANE_TABLE: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    INT64: tl.constexpr,
    ROWS_IN_THREAD: tl.constexpr,  # BLOCK_N == 4 rows held in each thread (_row_products_in_thread)
):
    """One row of ``x``, one weight: program ``p`` computes rows ``[p BLOCK_N, (p + 1) BLOCK_N)`` of ``y``
    (:func:`_row_products`, or :func:`_row_products_in_thread`)."""
    if ROWS_IN_THREAD:
        if INT64:
            first_row = tl.program_id(0).to(tl.int64) * BLOCK_N
        else:
            first_row = tl.program_id(0) * BLOCK_N
        _row_products_in_thread(x_words_ptr, packed_ptr, absmax_ptr, table_ptr, code2_ptr, absmax2_ptr, offset_ptr,
                                bias_ptr, u_ptr, lora_b_ptr, y_ptr, first_row, N, blocks_per_row, rank, lora_scale,
                                BLOCKSIZE, BLOCKSIZE2, NESTED, HAS_BIAS, HAS_LORA, RANK, STEP_BLOCKS, X_KIND, MASKED,
                                LANE_TABLE, BF16_BY_HAND)
    else:
        _row_products(x_words_ptr, packed_ptr, absmax_ptr, table_ptr, code2_ptr, absmax2_ptr, offset_ptr, bias_ptr,
                      u_ptr, lora_b_ptr, y_ptr, program_rows(BLOCK_N, INT64), N, blocks_per_row, rank, lora_scale,
                      BLOCKSIZE, BLOCKSIZE2, NESTED, HAS_BIAS, HAS_LORA, RANK, BLOCK_N, STEP_BLOCKS, X_KIND, MASKED,
                      PREFETCH, LANE_TABLE, BF16_BY_HAND)


@triton.jit(do_not_specialize=["n_0", "rank_0", "n_1", "rank_1", "n_2", "rank_2", "first1", "first2"])
def _nf4_matvec_rows_group_kernel(
    x_words_ptr, table_ptr, blocks_per_row,
    # segment 0, then 1 and 2 (SEGMENTS of them are read): the operands of _nf4_matvec_row_kernel for one weight
    packed_0, absmax_0, code2_0, absmax2_0, offset_0, bias_0, u_0, lora_b_0, y_0, n_0, rank_0, scale_0,
    packed_1, absmax_1, code2_1, absmax2_1, offset_1, bias_1, u_1, lora_b_1, y_1, n_1, rank_1, scale_1,
    packed_2, absmax_2, code2_2, absmax2_2, offset_2, bias_2, u_2, lora_b_2, y_2, n_2, rank_2, scale_2,
    first1,  # the first program of segment 1: cdiv(n_0, BLOCK_N)
    first2,  # of segment 2: first1 + cdiv(n_1, BLOCK_N)
    SEGMENTS: tl.constexpr,  # 2 or 3
    BLOCKSIZE: tl.constexpr,
    BLOCKSIZE2: tl.constexpr,
    NESTED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STEP_BLOCKS: tl.constexpr,
    X_KIND: tl.constexpr,
    MASKED: tl.constexpr,
    PREFETCH: tl.constexpr,
    LANE_TABLE: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    INT64: tl.constexpr,
    ROWS_IN_THREAD: tl.constexpr,
):
    """One row of ``x``, two or three weights that read it (q/k/v, gate/up) in one launch: the programs
    ``[0, first1)`` compute the first weight's ``y``, ``[first1, first2)`` the second's, the rest the third's,
    each program as :func:`_nf4_matvec_row_kernel`'s (the same rows, the same sums: bit for bit its output at
    the same ``BLOCK_N`` and ``STEP_BLOCKS``). Which weight is one scalar test of the program id."""
    pid = tl.program_id(0)
    packed, absmax, code2, absmax2, offset, bias = packed_0, absmax_0, code2_0, absmax2_0, offset_0, bias_0
    u, lora_b, y, n, rank, scale, first = u_0, lora_b_0, y_0, n_0, rank_0, scale_0, pid * 0
    if pid >= first1:
        packed, absmax, code2, absmax2, offset, bias = packed_1, absmax_1, code2_1, absmax2_1, offset_1, bias_1
        u, lora_b, y, n, rank, scale, first = u_1, lora_b_1, y_1, n_1, rank_1, scale_1, first1
    if SEGMENTS == 3:
        if pid >= first2:
            packed, absmax, code2, absmax2, offset, bias = packed_2, absmax_2, code2_2, absmax2_2, offset_2, bias_2
            u, lora_b, y, n, rank, scale, first = u_2, lora_b_2, y_2, n_2, rank_2, scale_2, first2
    if INT64:
        first_row = (pid - first).to(tl.int64) * BLOCK_N
    else:
        first_row = (pid - first) * BLOCK_N
    if ROWS_IN_THREAD:
        _row_products_in_thread(x_words_ptr, packed, absmax, table_ptr, code2, absmax2, offset, bias, u, lora_b, y,
                                first_row, n, blocks_per_row, rank, scale, BLOCKSIZE, BLOCKSIZE2, NESTED, HAS_BIAS,
                                HAS_LORA, RANK, STEP_BLOCKS, X_KIND, MASKED, LANE_TABLE, BF16_BY_HAND)
    else:
        _row_products(x_words_ptr, packed, absmax, table_ptr, code2, absmax2, offset, bias, u, lora_b, y,
                      first_row + tl.arange(0, BLOCK_N), n, blocks_per_row, rank, scale, BLOCKSIZE, BLOCKSIZE2, NESTED,
                      HAS_BIAS, HAS_LORA, RANK, BLOCK_N, STEP_BLOCKS, X_KIND, MASKED, PREFETCH, LANE_TABLE,
                      BF16_BY_HAND)


@triton.jit
def _nf4_matvec_dot_kernel(
    x_words_ptr,  # *i32 (fp16 / bf16 x) or *i64 (fp32 x): [M, K / 2] words, row stride stride_xw
    packed_ptr,  # *u8 NF4 bytes of W [N, K]
    absmax_ptr,  # *fp32 [n_blocks] (plain) or *u8 [n_blocks] (nested codes)
    table_ptr,  # *fp32 [16] NF4 levels
    code2_ptr,  # *fp32 [256] dynamic map (nested only)
    absmax2_ptr,  # *fp32 second-level scales (nested only)
    offset_ptr,  # *fp32 [1] mean offset (nested only)
    bias_ptr,  # *fp16 / *bf16 / *fp32 [N] (HAS_BIAS only)
    u_ptr,  # x's dtype, [M, rank] rows stride_u apart: X A^T of a LoRA adapter (HAS_LORA only)
    lora_b_ptr,  # x's dtype, [N, rank] contiguous: its B (HAS_LORA only)
    y_ptr,  # x's dtype, [M, N] contiguous
    part_ptr,  # fp32 [SPLIT_K, M, N]: each split's sum (SPLIT_K > 1 only; y_ptr stands in otherwise)
    M,
    N,
    blocks_per_row,  # K // BLOCKSIZE
    stride_xw,
    stride_u,
    rank,
    lora_scale,  # fp32 s
    steps_per_split,  # loop steps of one split of K (all of them when SPLIT_K == 1)
    BLOCKSIZE: tl.constexpr,
    BLOCKSIZE2: tl.constexpr,
    NESTED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    RANK: tl.constexpr,  # next power of two >= rank (HAS_LORA only)
    BLOCK_N: tl.constexpr,  # rows of W (columns of y) per program
    BLOCK_M: tl.constexpr,  # MAX_ROWS: x padded with zeros to tl.dot's 16
    STEP_BLOCKS: tl.constexpr,  # NF4 blocks of a row per loop step
    X_KIND: tl.constexpr,  # 0 fp32, 1 fp16, 2 bf16
    MASKED: tl.constexpr,  # N % BLOCK_N or blocks_per_row % STEP_BLOCKS: bounds checks needed
    LANE_TABLE: tl.constexpr,  # NF4 levels by warp shuffle (GPU), else by table loads (interpreter)
    BF16_BY_HAND: tl.constexpr,  # round to bf16 with integer ops (the interpreter truncates a cast)
    INT64: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs along K (axis 1 of the grid); > 1: fp32 sums to part_ptr, summed after
):
    """Rows ``[p BLOCK_N, (p + 1) BLOCK_N)`` of ``y`` (``p``: axis 0 of the grid) for all rows of ``x``: the NF4 tile
    decoded to ``x``'s dtype and multiplied on the tensor cores, fp32 sums. With ``SPLIT_K > 1`` program ``(p, s)``
    sums only the loop steps from ``s steps_per_split`` to ``(s + 1) steps_per_split`` and stores that sum,
    unrounded (split 0 with the bias and the LoRA term), in ``part[s]``; :func:`_split_sum_kernel` adds the splits
    in order and rounds once. A batch of 8 rows has few programs otherwise (``N / BLOCK_N``: 128 for a 4096-row
    weight on a 132-SM card)."""
    HALF: tl.constexpr = BLOCKSIZE // 2
    rows = program_rows(BLOCK_N, INT64)
    row_ok = rows < N
    first_block = rows * blocks_per_row  # [BLOCK_N] each row's first NF4 block
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    lane_level = _lane_level(table_ptr, LANE_TABLE)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    split = tl.program_id(1)
    first_step = split * steps_per_split
    last_step = tl.minimum(first_step + steps_per_split, tl.cdiv(blocks_per_row, STEP_BLOCKS))

    for step in range(first_step, last_step):
        byte, absmax, _, _ = _code_tile(packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, first_block, row_ok,
                                        step, blocks_per_row, BLOCKSIZE2, NESTED, MASKED, STEP_BLOCKS, HALF)
        hi = _nf4_level(lane_level, table_ptr, byte >> 4, LANE_TABLE) * absmax[:, :, None]
        lo = _nf4_level(lane_level, table_ptr, byte, LANE_TABLE) * absmax[:, :, None]
        STEP_BYTES: tl.constexpr = STEP_BLOCKS * HALF
        dtype: tl.constexpr = y_ptr.dtype.element_ty
        w_hi = tl.reshape(hi.to(dtype), (BLOCK_N, STEP_BYTES))
        w_lo = tl.reshape(lo.to(dtype), (BLOCK_N, STEP_BYTES))
        word_col = step * STEP_BYTES + tl.arange(0, STEP_BYTES)
        word_at = x_words_ptr + ms[None, :] * stride_xw + word_col[:, None]  # [STEP_BYTES, BLOCK_M]
        if MASKED:
            word = tl.load(word_at, mask=(word_col < blocks_per_row * HALF)[:, None] & m_ok[None, :], other=0)
        else:
            word = tl.load(word_at, mask=m_ok[None, :], other=0)
        x_even, x_odd = _x_pair(word, X_KIND, dtype)
        if X_KIND == 0:
            acc = tl.dot(w_hi, x_even, acc, input_precision="ieee")
            acc = tl.dot(w_lo, x_odd, acc, input_precision="ieee")
        else:
            acc = tl.dot(w_hi, x_even, acc)
            acc = tl.dot(w_lo, x_odd, acc)

    at = ms[None, :] * N + rows[:, None]  # [BLOCK_N, BLOCK_M] of y
    if SPLIT_K == 1:
        y = _with_terms(acc, rows, row_ok, ms, m_ok, bias_ptr, u_ptr, lora_b_ptr, stride_u, rank, lora_scale, HAS_BIAS,
                        HAS_LORA, RANK)
        y = _round_one(y, X_KIND, BF16_BY_HAND)
        tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & m_ok[None, :])
    else:
        if split == 0:
            acc = _with_terms(acc, rows, row_ok, ms, m_ok, bias_ptr, u_ptr, lora_b_ptr, stride_u, rank, lora_scale,
                              HAS_BIAS, HAS_LORA, RANK)
        tl.store(part_ptr + split * M * N + at, acc, mask=row_ok[:, None] & m_ok[None, :])


@triton.jit
def _with_terms(acc, rows, row_ok, ms, m_ok, bias_ptr, u_ptr, lora_b_ptr, stride_u, rank, lora_scale,
                HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, RANK: tl.constexpr):
    """``acc + b[rows] + s (U B^T)[rows]`` in fp32, ``acc`` ``[BLOCK_N, BLOCK_M]`` (rows of ``W``, rows of ``x``)."""
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_LORA:
        acc = acc + lora_scale * _low_rank(u_ptr, lora_b_ptr, rows, row_ok, ms, m_ok, stride_u, rank, RANK)
    return acc


@triton.jit
def _split_sum_kernel(part_ptr, y_ptr, count, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, X_KIND: tl.constexpr,
                      BF16_BY_HAND: tl.constexpr):
    """``y = round(part[0] + part[1] + ... + part[SPLIT_K - 1])`` over ``count`` elements, the splits added in order
    (the same bits every run): the second pass of :func:`_nf4_matvec_dot_kernel` split along K."""
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = at < count
    total = tl.load(part_ptr + at, mask=ok, other=0.0)
    for split in tl.static_range(1, SPLIT_K):
        total = total + tl.load(part_ptr + split * count + at, mask=ok, other=0.0)
    tl.store(y_ptr + at, _round_one(total, X_KIND, BF16_BY_HAND).to(y_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatvecConfig:
    """Launch parameters of the kernel: rows of ``W`` per program, NF4 blocks of a row per loop
    step, ``tl.dot`` or fused multiply-adds, warps per program, pipeline stages."""

    block_n: int
    step_blocks: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int | None = None  # Triton's software pipelining depth; None: Triton's default
    prefetch: bool = False  # the row kernel loads a step's tile one step ahead (two tiles in flight)
    rows_in_thread: bool = False  # the row kernel's four rows a program held in each thread (_row_products_in_thread)
    split_k: int = 1  # the tl.dot kernel's programs along K, summed by a second launch (_split_sum_kernel)

    def __post_init__(self):
        for name in ("block_n", "step_blocks", "num_warps", "split_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"MatvecConfig.{name} must be a power of two, got {value}.")
        if self.use_dot and self.block_n < 16:
            raise ValueError(f"tl.dot needs block_n >= 16, got {self.block_n}.")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"MatvecConfig.num_stages must be at least 1, got {self.num_stages}.")
        if self.prefetch and self.use_dot:
            raise ValueError("MatvecConfig.prefetch is the row kernel's (use_dot=False).")
        if self.rows_in_thread and (self.use_dot or self.prefetch or self.block_n != 4):
            raise ValueError("MatvecConfig.rows_in_thread is the row kernel's with block_n=4, without prefetch.")
        if self.split_k > 1 and not self.use_dot:
            raise ValueError("MatvecConfig.split_k is the tl.dot kernel's (use_dot=True).")


# elements of y a program of the split-K sum adds up
_SPLIT_SUM_BLOCK = 1024
# the tl.dot kernel's rows a program, and its split along K: at most this many splits, each loop at most this
# many inputs where the programs already fill the card (dot_split_k)
_DOT_ROWS = 32
_MAX_SPLIT_K = 8
_SPLIT_K_INPUTS = 2048
# NF4 bytes of one program's tile per loop step at M = 1: 16 per thread with 4 warps (one 128-bit load).
_ROW_TILE_BYTES = 2048
#: the rows-in-thread body's launch (16 bytes of each of its 4 rows a thread a step, 4 warps): slower than
#: matvec_config's choice on an H200 (session 36), so not chosen; the sweep (generate.py --kernels --sweep) times it
ROWS_IN_THREAD_CONFIG = MatvecConfig(block_n=4, step_blocks=64, use_dot=False, num_warps=4, rows_in_thread=True)
#: "1" makes matvec_config choose the rows-in-thread body where it gives a program 4 rows (an A/B switch)
ROWS_IN_THREAD_ENV = "NOTEBOOKKIT_NF4_ROWS_IN_THREAD"


def matvec_config(m: int, n: int, k: int, blocksize: int = 64, sm_count: int = 132) -> MatvecConfig:
    """Block sizes for ``x [m, k] @ W[n, k]^T`` on a GPU with ``sm_count`` SMs.

    ``m == 1``: fused multiply-adds, the most rows per program up to 4 that still leave two programs
    per SM, steps of ``_ROW_TILE_BYTES``, 4 warps (8 with fewer than 4 rows a program). ``m >= 2``:
    ``tl.dot``, 32 rows and 2 warps per program, steps of 64 bytes a row (at least 16: ``tl.dot``'s
    smallest inner size), split along K (:func:`dot_split_k`). Steps never exceed a row.

    The sweep on an H200 (``benchmarks/generate.py --kernels --sweep``, bf16, the Llama-3.1-8B shapes) put
    the row kernel's choices first or within 3% of the first. Session 25, the row kernel: 4096 x 4096 (4, 16)
    7.13 us (best 7.07), 14336 x 4096 (4, 16) 20.0 us (the best; session 24's kernel: 22.0), 4096 x 14336 20.1
    (19.9), 1024 x 4096 (2, 32, 8 warps) 3.25 (3.16). The ``tl.dot`` kernel at M = 8 on an H100 (session 50,
    ``--kernel-batches 8``): 64 rows a program ran 1.05-1.6x slower than 32 at every shape (1.3x at the LM head),
    and 16 rows lost to 32 at every shape once split.

    With ``NOTEBOOKKIT_NF4_ROWS_IN_THREAD=1`` in the environment, a one-row call that gets 4 rows a program runs the
    rows-in-thread body instead (:data:`ROWS_IN_THREAD_CONFIG`, its steps no longer than a row): an A/B switch for
    whole decode steps (the kernel alone was slower on an H200, session 36).
    """
    half = max(1, blocksize // 2)
    row_blocks = triton.next_power_of_2(max(1, k // blocksize))
    if m <= 1:
        block_n = 1
        while block_n < 4 and triton.cdiv(n, block_n * 2) >= 2 * sm_count:
            block_n *= 2
        if block_n == 4 and os.environ.get(ROWS_IN_THREAD_ENV, "0") == "1":
            return replace(ROWS_IN_THREAD_CONFIG, step_blocks=min(ROWS_IN_THREAD_CONFIG.step_blocks, row_blocks))
        step_blocks = max(1, min(_ROW_TILE_BYTES // (block_n * half), row_blocks))
        return MatvecConfig(block_n=block_n, step_blocks=step_blocks, use_dot=False, num_warps=4 if block_n >= 4 else 8)
    step_blocks = max(triton.cdiv(16, half), min(triton.cdiv(64, half), row_blocks))
    split_k = dot_split_k(triton.cdiv(n, _DOT_ROWS), k, sm_count)
    return MatvecConfig(block_n=_DOT_ROWS, step_blocks=step_blocks, use_dot=True, num_warps=2, split_k=split_k)


def dot_split_k(row_programs: int, k: int, sm_count: int) -> int:
    """Splits along K for the ``tl.dot`` kernel: the fewest (a power of two, at most ``_MAX_SPLIT_K``) that
    give at least three programs per SM and at most ``_SPLIT_K_INPUTS`` inputs to each program's loop.

    At M = 8 a weight has few row blocks (128 for 4096 rows at 32 a program on a 132-SM card), so without a
    split most SMs hold one program walking the whole row. Session 50's sweep on an H100 (bf16, M = 8, the
    fp32 sums added by a second launch, its time included), the previous rule's launch against this one's:
    4096 x 4096 17.6 -> 11.6 us (split 4), 1024 x 4096 16.8 -> 7.0 (8), 14336 x 4096 33.0 -> 29.5 (2),
    4096 x 14336 58.0 -> 29.1 (8); each the best of the shape's configurations."""
    split = 1
    while split < _MAX_SPLIT_K and (row_programs * split < 3 * sm_count or k > split * _SPLIT_K_INPUTS):
        split *= 2
    return split


def _check_x(x: torch.Tensor, k: int, where: str) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"{where} multiplies float16, bfloat16 or float32 inputs, not {x.dtype}.")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(
            f"{where}: x has shape {tuple(x.shape)}, but the 4-bit weight has {k} input features: the last "
            f"dimension of x must be {k}."
        )


def _matrix_shape(st: Any, where: str) -> tuple[int, int]:
    if len(st.shape) != 2:
        raise ValueError(f"{where} needs a 2-D weight [out_features, in_features], got shape {st.shape}.")
    return int(st.shape[0]), int(st.shape[1])


def _weight_parts(weight: Any, quant_state: Any) -> tuple[torch.Tensor, Any]:
    """(packed bytes, QuantState) of a ``Params4bit``, a ``(packed, quant_state)`` pair, or bare bytes
    with ``quant_state`` given."""
    if isinstance(weight, (tuple, list)):
        if len(weight) != 2:
            raise ValueError("Pass the 4-bit weight as a Params4bit or as a pair (packed bytes, quant_state).")
        weight, quant_state = weight
    return unwrap_nf4_weight(weight, quant_state)


def nf4_matvec_reference(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None, *,
                         quant_state: Any = None, lora: LoRATerm | None = None) -> torch.Tensor:
    """Plain PyTorch: ``W`` decoded by :func:`~notebookkit.kernels.nf4.dequantize_nf4_reference` in
    ``x``'s dtype, then ``x @ W^T + b + s U B^T`` in fp32, rounded once to ``x``'s dtype (the CPU path and
    the tests' oracle; same arguments as :func:`nf4_matvec`, any number of rows)."""
    return _decode_then_multiply(x, weight, quant_state, bias, lora, dequantize_nf4_reference,
                                 "nf4_matvec_reference")


def _decode_then_multiply(x, weight, quant_state, bias, lora, decode, where: str) -> torch.Tensor:
    packed, quant_state = _weight_parts(weight, quant_state)
    st = read_nf4_state(packed, quant_state)
    n, k = _matrix_shape(st, where)
    _check_x(x, k, where)
    _check_lora(lora, x, n, where)
    w = decode(packed, quant_state, out_dtype=x.dtype)
    y = x.reshape(-1, k).float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    if lora is not None:
        u, b, scaling = lora
        y = y + scaling * (u.reshape(-1, u.shape[-1]).float() @ b.float().t())
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def _check_lora(lora: LoRATerm | None, x: torch.Tensor, n: int, where: str) -> None:
    if lora is None:
        return
    u, b, _ = lora
    rows = x.numel() // max(1, x.shape[-1])
    if b.dim() != 2 or b.shape[0] != n or u.shape[-1] != b.shape[1] or u.numel() // max(1, u.shape[-1]) != rows:
        raise ValueError(
            f"{where}: the LoRA term needs U [{rows}, r] and B [{n}, r]; got U {tuple(u.shape)} and B {tuple(b.shape)}."
        )
    if u.dtype != x.dtype or b.dtype != x.dtype or u.device != x.device or b.device != x.device:
        raise ValueError(f"{where}: U and B must be {x.dtype} on {x.device} like x, got U {u.dtype} on {u.device} "
                         f"and B {b.dtype} on {b.device}.")


def _why_not(x: torch.Tensor, packed: torch.Tensor, quant_state: Any) -> str | None:
    """Why the kernel cannot take this call (None when it can)."""
    if not should_use_triton(x):
        return "x is not a CUDA tensor"
    if x.dtype not in _DTYPES:
        return f"x is {x.dtype}"
    if quant_state is None or getattr(quant_state, "quant_type", "nf4") != "nf4":
        return "the weight is not NF4"
    if getattr(quant_state, "packing_format_for_cpu", False):
        return "the weight was repacked for bitsandbytes' CPU kernel"
    shape = tuple(int(s) for s in quant_state.shape)
    if len(shape) != 2:
        return f"the weight has shape {shape}, not [out, in]"
    blocksize = int(quant_state.blocksize)
    if blocksize < 2 or shape[1] % blocksize:
        return f"in_features {shape[1]} is not a multiple of the NF4 blocksize {blocksize} (blocks straddle rows)"
    if x.dim() < 1 or x.shape[-1] != shape[1]:
        return f"x has {x.shape[-1] if x.dim() else 0} features, the weight {shape[1]}"
    rows = x.numel() // max(1, x.shape[-1])
    if rows > MAX_ROWS:
        return f"x has {rows} rows (more than {MAX_ROWS})"
    if packed.device != x.device:
        return "x and the weight are on different devices"
    return None


def nf4_matvec_supported(x: torch.Tensor, weight: Any, *, quant_state: Any = None) -> bool:
    """True when :func:`nf4_matvec` runs its kernel for ``x`` and ``weight``: a CUDA tensor (or
    Triton forced on under ``TRITON_INTERPRET=1``) of fp16 / bf16 / fp32 with at most ``MAX_ROWS``
    rows (all dimensions but the last), and an NF4 weight ``[N, K]`` on the same device whose rows
    are whole NF4 blocks (``K % blocksize == 0``, true of every released model). Never raises;
    where it says False, :func:`nf4_matvec` still gives the right answer, by decoding the weight."""
    try:
        packed, quant_state = _weight_parts(weight, quant_state)
        read_nf4_state(packed, quant_state)  # raises for bytes and state that do not belong together
        return _why_not(x, packed, quant_state) is None
    except Exception:  # a weight it cannot read: not supported (nf4_matvec says why)
        return False


def _as_words(x2: torch.Tensor) -> torch.Tensor:
    """``x2 [M, K]`` viewed as ``[M, K / 2]`` words of two values (copied first when its rows are not
    contiguous or not aligned to a word)."""
    word = _WORDS[x2.dtype]
    size = torch.empty((), dtype=word).element_size()
    aligned = x2.stride(1) == 1 and x2.stride(0) % 2 == 0 and x2.data_ptr() % size == 0
    if not aligned:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    return x2.view(word)


def nf4_matvec(
    x: torch.Tensor,
    weight: Any,
    bias: torch.Tensor | None = None,
    *,
    quant_state: Any = None,
    config: MatvecConfig | None = None,
    lora: LoRATerm | None = None,
) -> torch.Tensor:
    """``x @ W^T + bias (+ s U B^T)`` for an NF4 weight ``W [N, K]`` and a few rows of ``x``, without
    decoding ``W``.

    Args:
        x: ``[..., K]`` in float16 / bfloat16 / float32; at most ``MAX_ROWS`` (16) rows for the
            kernel (the decode batch: ``[batch, 1, hidden]`` is fine).
        weight: the bitsandbytes ``Params4bit`` (its ``quant_state`` is used), a pair
            ``(packed bytes, quant_state)``, or the bare bytes with ``quant_state=`` given; plain or
            nested (double-quantised) absmax.
        bias: optional ``[N]``, added in fp32 before the one rounding.
        quant_state: the weight's ``QuantState`` when ``weight`` is the bare bytes.
        config: launch parameters (:class:`MatvecConfig`) instead of :func:`matvec_config`'s
            choice; for tests and benchmarks.
        lora: a LoRA adapter's term ``(U, B, s)`` (:class:`LoRATerm`): ``U = x A^T`` ``[..., r]`` in ``x``'s
            dtype (its rows may be a column slice of a wider matrix: the ``X A_cat^T`` of a group),
            ``B`` ``[N, r]`` in ``x``'s dtype, ``s`` the adapter's scaling; added in fp32 before the rounding.

    Returns:
        ``[..., N]`` in ``x``'s dtype: ``x @ dequantize_nf4(W, out_dtype=x.dtype)^T + bias + s U B^T``,
        accumulated in fp32 and rounded once (:func:`nf4_matvec_reference` is the same math).

    CUDA tensors run the Triton kernel when :func:`nf4_matvec_supported`; other calls (CPU
    tensors, more rows, rows that are not whole NF4 blocks) decode the weight with
    ``dequantize_nf4`` and multiply, with the same numbers. Safe inside CUDA graph capture once a
    call of the same shapes has run (that call compiles the kernel).
    """
    packed, quant_state = _weight_parts(weight, quant_state)
    st = read_nf4_state(packed, quant_state)
    n, k = _matrix_shape(st, "nf4_matvec")
    _check_x(x, k, "nf4_matvec")
    if bias is not None and (bias.numel() != n or bias.device != x.device):
        raise ValueError(
            f"nf4_matvec: bias must have {n} elements on {x.device}, got {tuple(bias.shape)} on {bias.device}."
        )
    _check_lora(lora, x, n, "nf4_matvec")
    if _why_not(x, packed, quant_state) is not None:
        return _decode_then_multiply(x, (packed, quant_state), None, bias, lora, dequantize_nf4, "nf4_matvec")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*x.shape[:-1], n)
    if config is None:
        config = matvec_config(m, n, k, st.blocksize, sm_count(x.device))
    half = st.blocksize // 2
    if config.use_dot and half * config.step_blocks < 16:
        raise ValueError(f"tl.dot needs at least 16 bytes a row per step: step_blocks={config.step_blocks} is too few.")
    if not config.use_dot and m > 1:
        raise ValueError(
            f"The fused multiply-add path takes one row of x, got {m}: use a MatvecConfig with use_dot=True."
        )
    words = _as_words(x2)
    packed, absmax, table, code2, absmax2, offset = nf4_kernel_operands(packed, st)
    blocks_per_row = k // st.blocksize
    on_gpu = x.is_cuda
    u, lora_b, scaling = _lora_operands(lora, m, y)
    common = dict(
        BLOCKSIZE=st.blocksize,
        BLOCKSIZE2=st.blocksize2,
        NESTED=st.nested,
        HAS_BIAS=bias is not None,
        HAS_LORA=lora is not None,
        RANK=triton.next_power_of_2(lora_b.shape[-1]),
        BLOCK_N=config.block_n,
        STEP_BLOCKS=config.step_blocks,
        X_KIND=_X_KINDS[x.dtype],
        MASKED=bool(n % config.block_n or blocks_per_row % config.step_blocks),
        LANE_TABLE=on_gpu,
        BF16_BY_HAND=not on_gpu and interpreter_on(),
        INT64=packed.numel() + half * config.block_n * config.step_blocks >= 2**31,
        num_warps=config.num_warps,
        enable_fp_fusion=False,
        **({} if config.num_stages is None else {"num_stages": config.num_stages}),
    )
    bias_or_y = bias.reshape(-1) if bias is not None else y
    grid = (triton.cdiv(n, config.block_n),)
    if config.use_dot:
        steps = triton.cdiv(blocks_per_row, config.step_blocks)
        split = min(config.split_k, steps)  # no split without a step of its own
        parts = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        _nf4_matvec_dot_kernel[(grid[0], split)](
            words, packed, absmax, table, code2, absmax2, offset, bias_or_y, u, lora_b, y, parts,
            m, n, blocks_per_row, words.stride(0), u.stride(0), lora_b.shape[-1], scaling, triton.cdiv(steps, split),
            BLOCK_M=MAX_ROWS, SPLIT_K=split, **common)
        if split > 1:
            _split_sum_kernel[(triton.cdiv(m * n, _SPLIT_SUM_BLOCK),)](
                parts, y, m * n, SPLIT_K=split, BLOCK=_SPLIT_SUM_BLOCK, X_KIND=_X_KINDS[x.dtype],
                BF16_BY_HAND=common["BF16_BY_HAND"])
    else:
        _nf4_matvec_row_kernel[grid](
            words, packed, absmax, table, code2, absmax2, offset, bias_or_y, u, lora_b, y,
            n, blocks_per_row, lora_b.shape[-1], scaling, PREFETCH=config.prefetch,
            ROWS_IN_THREAD=config.rows_in_thread, **common)
    return y.reshape(*x.shape[:-1], n)


#: weights one launch of the grouped row kernel takes (q, k and v)
MAX_GROUP = 3


def _group_why_not(x: torch.Tensor, parts: list, biases: Sequence, loras: Sequence) -> str | None:
    """Why :func:`nf4_matvec_group` cannot run ``parts`` (``(packed, quant_state, state)`` each) in one launch
    (None when it can): the row kernel's calls (one row of ``x``) whose weights share the operands' kinds."""
    if len(parts) < 2:
        return "fewer than two weights"
    if x.dim() == 0 or x.numel() // max(1, x.shape[-1]) != 1:
        return "more than one row of x (the grouped kernel is the row kernel's)"
    for packed, quant_state, _ in parts:
        why = _why_not(x, packed, quant_state)
        if why is not None:
            return why
    states = [st for _, _, st in parts]
    if len({(st.blocksize, st.blocksize2 if st.nested else 0, st.nested) for st in states}) != 1:
        return "the weights' NF4 blocksizes or absmax kinds differ"
    if len({b is None for b in biases}) != 1 or len({lo is None for lo in loras}) != 1:
        return "some weights have a bias or a LoRA term and others not"
    if loras[0] is not None and len({triton.next_power_of_2(lo[1].shape[-1]) for lo in loras}) != 1:
        return "the LoRA ranks round to different powers of two"
    return None


def nf4_matvec_group(
    x: torch.Tensor,
    weights: Sequence[Any],
    biases: Sequence[torch.Tensor | None] | None = None,
    *,
    loras: Sequence[LoRATerm | None] | None = None,
    config: MatvecConfig | None = None,
) -> list[torch.Tensor]:
    """``[x @ W_i^T + b_i (+ s_i U_i B_i^T)]`` for NF4 weights ``W_i`` that read the same ``x`` (a decode
    layer's q/k/v, its gate/up): :func:`nf4_matvec` of each, in one launch of the row kernel per
    :data:`MAX_GROUP` weights where it can take them all (one row of ``x``, every weight supported with the
    same NF4 layout, biases and LoRA terms on all or none, ranks of one power of two), else one
    :func:`nf4_matvec` each.

    Every output is bit for bit what :func:`nf4_matvec` gives for that weight alone with the same
    ``config``: each weight's rows are its own programs, their sums those of the one-weight kernel.
    Without ``config``, :func:`matvec_config` chooses for the group's total rows (the launch is sized
    by them). ``weights``, ``biases`` and ``loras`` as :func:`nf4_matvec`'s ``weight``, ``bias`` and
    ``lora``, one per weight."""
    count = len(weights)
    biases = list(biases) if biases is not None else [None] * count
    loras = list(loras) if loras is not None else [None] * count
    if len(biases) != count or len(loras) != count:
        raise ValueError(f"nf4_matvec_group: {count} weights, but {len(biases)} biases and {len(loras)} LoRA terms "
                         "(give one per weight, None where a weight has none).")
    parts = []
    for weight in weights:
        packed, quant_state = _weight_parts(weight, None)
        parts.append((packed, quant_state, read_nf4_state(packed, quant_state)))
    if count > MAX_GROUP:
        return [y for lo in range(0, count, MAX_GROUP)
                for y in nf4_matvec_group(x, weights[lo:lo + MAX_GROUP], biases[lo:lo + MAX_GROUP],
                                          loras=loras[lo:lo + MAX_GROUP], config=config)]
    if _group_why_not(x, parts, biases, loras) is not None:
        return [nf4_matvec(x, (p, q), b, lora=lo, config=config) for (p, q, _), b, lo in zip(parts, biases, loras)]
    k = x.shape[-1]
    segments = []
    for (packed, quant_state, st), bias, lora in zip(parts, biases, loras):
        n, _ = _matrix_shape(st, "nf4_matvec_group")
        if bias is not None and (bias.numel() != n or bias.device != x.device):
            raise ValueError(f"nf4_matvec_group: a bias must have its weight's {n} elements on {x.device}, got "
                             f"{tuple(bias.shape)} on {bias.device}.")
        _check_lora(lora, x, n, "nf4_matvec_group")
        segments.append((n, packed, st, bias, lora))
    _check_x(x, k, "nf4_matvec_group")
    total = sum(n for n, *_ in segments)
    st = segments[0][2]
    if config is None:
        config = matvec_config(1, total, k, st.blocksize, sm_count(x.device))
    if config.use_dot:
        raise ValueError("nf4_matvec_group runs the row kernel: give a MatvecConfig with use_dot=False.")
    words = _as_words(x.reshape(1, k))
    blocks_per_row = k // st.blocksize
    args, firsts, outs = [], [0], []
    for n, packed, st_i, bias, lora in segments:
        y = torch.empty((1, n), dtype=x.dtype, device=x.device)
        packed, absmax, table, code2, absmax2, offset = nf4_kernel_operands(packed, st_i)
        u, lora_b, scaling = _lora_operands(lora, 1, y)
        args += [packed, absmax, code2, absmax2, offset, bias.reshape(-1) if bias is not None else y, u, lora_b, y, n,
                 lora_b.shape[-1], scaling]
        firsts.append(firsts[-1] + triton.cdiv(n, config.block_n))
        outs.append(y.reshape(*x.shape[:-1], n))
    args += args[-12:] * (MAX_GROUP - count)  # the unused third segment: any operands of the right kinds
    half = st.blocksize // 2
    on_gpu = x.is_cuda
    _nf4_matvec_rows_group_kernel[(firsts[count],)](
        words, table, blocks_per_row, *args, firsts[1], firsts[2],
        SEGMENTS=count,
        BLOCKSIZE=st.blocksize,
        BLOCKSIZE2=st.blocksize2,
        NESTED=st.nested,
        HAS_BIAS=biases[0] is not None,
        HAS_LORA=loras[0] is not None,
        RANK=triton.next_power_of_2(args[10]),
        BLOCK_N=config.block_n,
        STEP_BLOCKS=config.step_blocks,
        X_KIND=_X_KINDS[x.dtype],
        MASKED=bool(any(n % config.block_n for n, *_ in segments) or blocks_per_row % config.step_blocks),
        PREFETCH=config.prefetch,
        ROWS_IN_THREAD=config.rows_in_thread,
        LANE_TABLE=on_gpu,
        BF16_BY_HAND=not on_gpu and interpreter_on(),
        INT64=max(p.numel() for _, p, *_ in segments) + half * config.block_n * config.step_blocks >= 2**31,
        num_warps=config.num_warps,
        enable_fp_fusion=False,
        **({} if config.num_stages is None else {"num_stages": config.num_stages}),
    )
    return outs


def _lora_operands(lora: LoRATerm | None, m: int, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(U [m, r] with unit column stride, B [N, r] contiguous, s)`` for the kernel; without an adapter,
    ``y`` stands in for both pointers (never read) with rank 1."""
    if lora is None:
        return y.reshape(m, -1), y.reshape(-1, 1), 0.0
    u, b, scaling = lora
    u = u.reshape(m, u.shape[-1])
    if u.stride(-1) != 1:
        u = u.contiguous()
    return u, b.contiguous(), float(scaling)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py, e.g. for sm_75)
# --------------------------------------------------------------------------------------------------


def _aot_specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """The Llama-3.1-8B decode configurations (K = 4096, M = 1 and 8) on a GPU, fp16 and bf16,
    nested and plain absmax, with and without bias, with and without a LoRA term, masked and not:
    the row kernel for M = 1 (every target, the T4's sm_75 included) and the ``tl.dot`` kernel for
    M = 8 (bf16 ``tl.dot`` needs sm_80+; a T4 runs fp16)."""
    pointers = {"absmax_ptr": None, "table_ptr": "*fp32", "code2_ptr": "*fp32", "absmax2_ptr": "*fp32",
                "offset_ptr": "*fp32"}
    specs = []
    for x_ty, kind in (("fp16", 1), ("bf16", 2)):
        for m, nested, bias, masked, lora in ((1, True, False, False, True), (1, False, True, True, False),
                                              (8, True, True, False, False), (8, False, False, True, True)):
            config = matvec_config(m, 4096, 4096)
            operands = {**pointers, "absmax_ptr": "*u8" if nested else "*fp32", "bias_ptr": f"*{x_ty}",
                        "u_ptr": f"*{x_ty}", "lora_b_ptr": f"*{x_ty}", "y_ptr": f"*{x_ty}"}
            constexprs = {
                "BLOCKSIZE": 64, "BLOCKSIZE2": 256, "NESTED": nested, "HAS_BIAS": bias, "HAS_LORA": lora,
                "RANK": 16, "BLOCK_N": config.block_n, "STEP_BLOCKS": config.step_blocks, "X_KIND": kind,
                "MASKED": masked, "LANE_TABLE": True, "BF16_BY_HAND": False, "INT64": False,
            }
            options: dict[str, Any] = {"num_warps": config.num_warps, "enable_fp_fusion": False}
            if m == 1:
                signature = {"x_words_ptr": "*i32", "packed_ptr": "*u8", **operands,
                             "N": "i32", "blocks_per_row": "i32", "rank": "i32", "lora_scale": "fp32"}
                specs.append((_nf4_matvec_row_kernel, signature,
                              {**constexprs, "PREFETCH": not nested, "ROWS_IN_THREAD": False}, options))
                continue
            part = "*fp32" if config.split_k > 1 else f"*{x_ty}"
            signature = {"x_words_ptr": "*i32", "packed_ptr": "*u8", **operands, "part_ptr": part, "M": "i32",
                         "N": "i32", "blocks_per_row": "i32", "stride_xw": "i32", "stride_u": "i32", "rank": "i32",
                         "lora_scale": "fp32", "steps_per_split": "i32"}
            if x_ty == "bf16":
                options["targets"] = [80, 86, 89, 90]
            specs.append((_nf4_matvec_dot_kernel, signature,
                          {**constexprs, "BLOCK_M": MAX_ROWS, "SPLIT_K": config.split_k}, options))
        # the grouped row kernel: q/k/v (3 weights, 6144 rows) nested with LoRA; gate/up (2) plain with bias, masked
        for segments, nested, bias, masked, lora in ((3, True, False, False, True), (2, False, True, True, False)):
            config = matvec_config(1, 6144, 4096)
            segment = {"packed": "*u8", "absmax": "*u8" if nested else "*fp32", "code2": "*fp32", "absmax2": "*fp32",
                       "offset": "*fp32", "bias": f"*{x_ty}", "u": f"*{x_ty}", "lora_b": f"*{x_ty}", "y": f"*{x_ty}",
                       "n": "i32", "rank": "i32", "scale": "fp32"}
            signature = {"x_words_ptr": "*i32", "table_ptr": "*fp32", "blocks_per_row": "i32",
                         **{f"{name}_{j}": ty for j in range(MAX_GROUP) for name, ty in segment.items()},
                         "first1": "i32", "first2": "i32"}
            constexprs = {
                "SEGMENTS": segments, "BLOCKSIZE": 64, "BLOCKSIZE2": 256, "NESTED": nested, "HAS_BIAS": bias,
                "HAS_LORA": lora, "RANK": 16, "BLOCK_N": config.block_n, "STEP_BLOCKS": config.step_blocks,
                "X_KIND": kind, "MASKED": masked, "PREFETCH": not nested, "LANE_TABLE": True, "BF16_BY_HAND": False,
                "INT64": False, "ROWS_IN_THREAD": False,
            }
            specs.append((_nf4_matvec_rows_group_kernel, signature, constexprs,
                          {"num_warps": config.num_warps, "enable_fp_fusion": False}))
    # the rows-in-thread body (ROWS_IN_THREAD_CONFIG), after the specs above so that their indices stay: the row
    # kernel nested with LoRA, the grouped one plain with bias and masked, fp16 and bf16
    row_specs = [sp for sp in specs if sp[0] is not _nf4_matvec_dot_kernel]
    for kernel, signature, constexprs, options in row_specs:
        if (kernel is _nf4_matvec_row_kernel) != constexprs["NESTED"]:
            continue
        specs.append((kernel, signature, {**constexprs, "ROWS_IN_THREAD": True, "PREFETCH": False, "BLOCK_N": 4,
                                          "STEP_BLOCKS": ROWS_IN_THREAD_CONFIG.step_blocks},
                      {**options, "num_warps": ROWS_IN_THREAD_CONFIG.num_warps}))
    # last so that the indices above stay: the tl.dot kernel without a split along K (a weight that fills the card
    # with short rows), and the sum of matvec_config's splits at K = 4096, fp16 (every target)
    dot = next(sp for sp in specs if sp[0] is _nf4_matvec_dot_kernel)
    split = dot[2]["SPLIT_K"]
    specs.append((dot[0], {**dot[1], "part_ptr": "*fp16"}, {**dot[2], "SPLIT_K": 1}, dot[3]))
    specs.append((_split_sum_kernel, {"part_ptr": "*fp32", "y_ptr": "*fp16", "count": "i32"},
                  {"SPLIT_K": split, "BLOCK": _SPLIT_SUM_BLOCK, "X_KIND": 1, "BF16_BY_HAND": False}, {"num_warps": 4}))
    return specs


AOT_SPECS = _aot_specs()
