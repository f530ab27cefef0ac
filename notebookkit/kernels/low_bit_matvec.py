"""Decode matrix-vector product for 2-bit and ternary bases: ``y = x @ deq(W)^T`` for a few rows of
``x``, reading the packed codes and the group scales directly, never writing the dense weight.

Both formats store four 2-bit codes a byte along ``K`` (weight ``k`` of a row in byte ``k // 4`` at
bits ``2 * (k % 4)``) and fp16 scales per row and group of ``G`` inputs; they differ in the zero point:

    2-bit   (:class:`~notebookkit.kernels.q2.Q2Weight`)       w = (code - zero[n, g]) * scale[n, g]
    ternary (:class:`~notebookkit.kernels.ternary.TernaryWeight`) w = (code - 1) * scales[n, g]

with ``g = k // G``. For ``x [M, K]`` (``M`` the decode batch, ``c`` its dtype), cutting each row into
pieces ``p`` of ``P`` weights inside one group (``P`` a power of two, 4 to 64: :func:`piece_length`):

    y[m, n] = c( sum_p s[n, p] * ( sum_{k in p} code[n, k] x[m, k]  -  z[n, p] * sum_{k in p} x[m, k] ) )

all in fp32 (``z = zero`` for 2-bit, 1 for ternary): the product with the weight dequantised in fp32,
up to the order of the fp32 additions. It is not rounded to ``c`` weight by weight as the training
path's dequantised weight is (a difference of one rounding of ``c`` a weight, below the rounding of
``y``); the reference computes the same fp32 product.

Kernel: a program owns ``BLOCK_N`` rows of ``W`` and one row of ``x`` (grid ``[N / BLOCK_N, M]``) and
walks a row ``PIECES`` pieces at a time: one contiguous load of the code bytes ``[BLOCK_N, PIECES,
P / 4]``, the four codes of a byte split by shifts against the contiguous ``x`` of the step, two sums
a piece, then one scale (and zero) a row and piece; ``sum x`` of a piece is shared by all rows. So
the scale is applied once a piece, not once a weight, and the loads are wide. No ``tl.dot`` (bf16 runs
under the interpreter too), no split over ``K``, deterministic. Each row of ``x`` reads ``W`` again:
meant for ``M`` up to :data:`MAX_ROWS`; more rows (and groups that are not a multiple of 4) go
through :func:`~notebookkit.kernels.chunked_dequant_matmul.low_bit_matmul`, CPU tensors through the
reference. The launch configuration comes from the sweep ``benchmarks/low_bit_matvec.py``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from .chunked_dequant_matmul import low_bit_matmul
from .q2 import Q2Weight, dequantize_q2_reference
from .q2_matmul import q2_operand_rows
from .runtime import should_use_triton
from .ternary import TernaryWeight, dequantize_ternary_reference

__all__ = ["MAX_ROWS", "low_bit_matvec", "low_bit_matvec_reference", "AOT_SPECS"]

#: rows from which the matvec hands over to the GEMM path (each row re-reads ``W`` here)
MAX_ROWS = 4


def low_bit_matvec_reference(x: torch.Tensor, w) -> torch.Tensor:
    """Same math in plain PyTorch: the weight dequantised in fp32, an fp32 product, one rounding to ``x``'s dtype."""
    deq = (dequantize_q2_reference(w, torch.float32) if isinstance(w, Q2Weight)
           else dequantize_ternary_reference(w, torch.float32))
    return (x.float() @ deq.float().t()).to(x.dtype)


@triton.jit
def _low_bit_matvec_kernel(
    x_ptr,  # *c [M, K], row stride stride_xm
    codes_ptr,  # *u8 [N, row_bytes]
    scale_ptr, zero_ptr,  # *fp16 [N, n_groups] each (zero_ptr unused without HAS_ZERO)
    y_ptr,  # *c [M, N] contiguous
    N, K, row_bytes, n_groups, group_size, stride_xm,
    BLOCK_N: tl.constexpr, PIECES: tl.constexpr, PIECE: tl.constexpr, HAS_ZERO: tl.constexpr,
):
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    n_ok = rn < N
    QP: tl.constexpr = PIECE // 4  # code bytes a piece
    pieces = tl.arange(0, PIECES)
    qb = tl.arange(0, QP)
    lanes = tl.arange(0, 4)
    acc = tl.zeros((BLOCK_N, PIECES), dtype=tl.float32)
    for p0 in range(0, tl.cdiv(K, PIECE), PIECES):
        piece = p0 + pieces  # [P]: pieces of this step
        byte_at = piece[:, None] * QP + qb[None, :]  # [P, QP]
        ok = n_ok[:, None, None] & (byte_at < row_bytes)[None, :, :]
        byte = tl.load(codes_ptr + rn[:, None, None] * row_bytes + byte_at[None, :, :], mask=ok, other=0)
        code = ((byte.to(tl.int32)[:, :, :, None] >> (2 * lanes)[None, None, None, :]) & 3).to(tl.float32)
        k = byte_at[:, :, None] * 4 + lanes[None, None, :]  # [P, QP, 4]
        xv = tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        dot = tl.sum(tl.sum(code * xv[None, :, :, :], axis=3), axis=2)  # [BN, P]: sum of code * x a piece
        grp = rn[:, None] * n_groups + ((piece * PIECE) // group_size)[None, :]
        grp_ok = n_ok[:, None] & (piece * PIECE < K)[None, :]
        s = tl.load(scale_ptr + grp, mask=grp_ok, other=0.0).to(tl.float32)
        xsum = tl.sum(tl.sum(xv, axis=2), axis=1)[None, :]  # [1, P]: sum of x a piece
        if HAS_ZERO:
            z = tl.load(zero_ptr + grp, mask=grp_ok, other=0.0).to(tl.float32)
            acc += s * (dot - z * xsum)
        else:
            acc += s * (dot - xsum)
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + m * N + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)


#: (BLOCK_N, code bytes a step, num_warps); ``benchmarks/low_bit_matvec.py`` sweeps the alternatives
CONFIG = (4, 128, 1)


def _parts(w) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(codes, scale, zero, group size, groups a row) of a packed weight; ``zero`` is the scale for ternary
    (never read there)."""
    if isinstance(w, Q2Weight):
        return w.codes, w.scale, w.zero, w.group_size, w.scale.shape[1]
    if isinstance(w, TernaryWeight):
        return w.packed, w.scales, w.scales, w.group_size, w.scales.shape[1]
    raise TypeError(f"low_bit_matvec takes a Q2Weight or a TernaryWeight, got {type(w).__name__}.")


def piece_length(group_size: int, n_groups: int) -> int:
    """Weights a piece: a power of two of at least 4 (whole code bytes) and at most 64 inside which the
    scale does not change: any with one group a row, else one that divides the group; 0 when there is
    none (groups not a multiple of 4: such a weight goes through the GEMM path)."""
    if n_groups == 1:
        return 64
    piece = min(group_size & -group_size, 64)
    return piece if piece >= 4 else 0


def _rows_of(x: torch.Tensor, w, k: int) -> torch.Tensor:
    if isinstance(w, Q2Weight):
        return q2_operand_rows(x, w, k, "low_bit_matvec", "x")
    if x.shape[-1] != k:
        raise ValueError(f"low_bit_matvec: x has {x.shape[-1]} features, the ternary weight {tuple(w.shape)} "
                         f"needs {k}.")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"low_bit_matvec: x must be float16, bfloat16 or float32, got {x.dtype}.")
    return x.reshape(-1, k)


def low_bit_matvec(x: torch.Tensor, w, config: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """``x @ deq(W)^T`` for ``x [..., K]`` of at most :data:`MAX_ROWS` rows without decoding ``W`` (CUDA,
    or Triton forced under the interpreter); more rows go through ``low_bit_matmul``, CPU tensors
    through the reference. ``config`` overrides :data:`CONFIG` (the sweep)."""
    codes, scale, zero, group, n_groups = _parts(w)
    n, k = w.shape
    x2 = _rows_of(x, w, k)
    if not should_use_triton(x):
        return low_bit_matvec_reference(x2, w).reshape(*x.shape[:-1], n)
    m = x2.shape[0]
    piece = piece_length(group, n_groups)
    if m > MAX_ROWS or not piece:
        return low_bit_matmul(x, w)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        block_n, step_bytes, warps = config or CONFIG
        _low_bit_matvec_kernel[(triton.cdiv(n, block_n), m)](
            x2, codes, scale, zero, y, n, k, codes.shape[1], n_groups, group, x2.stride(0),
            BLOCK_N=block_n, PIECES=max(1, 4 * step_bytes // piece), PIECE=piece, HAS_ZERO=isinstance(w, Q2Weight),
            num_warps=warps)
    return y.reshape(*x.shape[:-1], n)


def _aot_specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """The two formats at their defaults (2-bit groups of 64, ternary one scale a row: pieces of 64), fp16 and bf16."""
    specs = []
    block_n, step_bytes, warps = CONFIG
    for ty in ("fp16", "bf16"):
        signature = {"x_ptr": f"*{ty}", "codes_ptr": "*u8", "scale_ptr": "*fp16", "zero_ptr": "*fp16",
                     "y_ptr": f"*{ty}", "N": "i32", "K": "i32", "row_bytes": "i32", "n_groups": "i32",
                     "group_size": "i32", "stride_xm": "i32"}
        for has_zero in (True, False):
            constexprs = {"BLOCK_N": block_n, "PIECES": 4 * step_bytes // 64, "PIECE": 64, "HAS_ZERO": has_zero}
            specs.append((_low_bit_matvec_kernel, signature, constexprs, {"num_warps": warps}))
    return specs


AOT_SPECS = _aot_specs()
