"""Q2 matrix-vector product for decoding: ``y = x @ dequant(W)^T`` for a few rows of ``x``, reading the
2-bit codes and the group scales directly, never writing the dense weight.

Math (``W`` a :class:`notebookkit.kernels.q2.Q2Weight` ``[N, K]``, group ``G``; ``x [M, K]``, ``M`` the
decode batch; ``c`` the dtype of ``x``):

    w[n, k] = c( (code(n, k) - zero[n, k // G]) * scale[n, k // G] )    fp32, one rounding to c
    y[m, n] = c( sum_k fp32(x[m, k]) * w[n, k] )                         fp32 accumulation, one rounding

``w`` is bit for bit ``dequantize_q2(W, out_dtype=c)``: ``y`` is the dequantise-then-matmul product up
to the order of the fp32 additions. No backward (decoding runs without gradients).

Kernel: a program owns ``BLOCK_N`` rows of ``W`` and one row of ``x`` (grid ``[N / BLOCK_N, M]``) and
walks ``K`` in steps of ``BLOCK_K`` (inside one group), multiply-adding the decoded ``[BLOCK_N,
BLOCK_K]`` tile into a per-thread accumulator of that shape, reduced once at the end: no ``tl.dot``
(so bf16 runs under the interpreter too), no split over ``K``, deterministic. Each row of ``x`` reads
``W`` again, so it is meant for ``M`` of 1 to a few; larger ``M`` goes through
:func:`notebookkit.kernels.q2_matmul.q2_matmul` (the tensor-core path) -- :func:`q2_matvec` does that
above ``MAX_ROWS``. Not tuned on a GPU yet (no lane-table or packed-conversion tricks of
``nf4_matvec``).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .q2 import DEFAULT_GROUP_SIZE, Q2Weight, q2_decode_tile
from .q2_matmul import q2_matmul, q2_matmul_reference, q2_operand_rows
from .runtime import interpreter_on, should_use_triton

__all__ = ["MAX_ROWS", "q2_matvec", "q2_matvec_reference", "AOT_SPECS"]

MAX_ROWS = 4


def q2_matvec_reference(x: torch.Tensor, q: Q2Weight) -> torch.Tensor:
    """Same math as :func:`q2_matvec` in plain PyTorch (the forward reference of ``q2_matmul``)."""
    return q2_matmul_reference(x, q)


@triton.jit
def _q2_matvec_kernel(
    x_ptr,  # *c [M, K], row stride stride_xm
    codes_ptr, scale_ptr, zero_ptr,  # the Q2 weight: *u8 [N, K/4] codes, *fp16 [N, K/G] scale and zero
    y_ptr,  # *c [M, N] contiguous
    N, K, stride_xm,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xv = tl.load(x_ptr + m * stride_xm + k0 + rk)
        w = q2_decode_tile(codes_ptr, scale_ptr, zero_ptr, rn, n_ok, k0, K, GROUP, BLOCK_K)
        if BF16_BY_HAND:  # the interpreter's fp32 -> bf16 cast truncates: round to nearest-even by hand
            bits = w.to(tl.uint32, bitcast=True)
            w = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            w = w.to(xv.dtype).to(tl.float32)
        acc += w * xv.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + m * N + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def _config(group_size: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps). Not tuned on a GPU yet."""
    return 32, min(group_size, 64), 4


def q2_matvec(x: torch.Tensor, q: Q2Weight) -> torch.Tensor:
    """``x @ dequant(W)^T`` for ``x [..., K]`` of at most ``MAX_ROWS`` rows without decoding ``W`` (CUDA,
    or Triton forced under the interpreter); more rows go through :func:`q2_matmul`, CPU tensors
    through the reference."""
    if not should_use_triton(x):
        return q2_matvec_reference(x, q)
    n, k = q.shape
    x2 = q2_operand_rows(x, q, k, "q2_matvec", "x")
    m = x2.shape[0]
    if m > MAX_ROWS:
        return q2_matmul(x, q)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        bn, bk, warps = _config(q.group_size)
        by_hand = x.dtype == torch.bfloat16 and interpreter_on() and not x.is_cuda
        _q2_matvec_kernel[(triton.cdiv(n, bn), m)](x2, q.codes, q.scale, q.zero, y, n, k, x2.stride(0),
                                                   GROUP=q.group_size, BLOCK_N=bn, BLOCK_K=bk,
                                                   BF16_BY_HAND=by_hand, num_warps=warps)
    return y.reshape(*x.shape[:-1], n)


def _aot_specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    specs = []
    bn, bk, warps = _config(DEFAULT_GROUP_SIZE)
    for ty in ("fp16", "bf16"):
        signature = {"x_ptr": f"*{ty}", "codes_ptr": "*u8", "scale_ptr": "*fp16", "zero_ptr": "*fp16",
                     "y_ptr": f"*{ty}", "N": "i32", "K": "i32", "stride_xm": "i32"}
        constexprs = {"GROUP": DEFAULT_GROUP_SIZE, "BLOCK_N": bn, "BLOCK_K": bk, "BF16_BY_HAND": False}
        specs.append((_q2_matvec_kernel, signature, constexprs, {"num_warps": warps}))
    return specs


AOT_SPECS = _aot_specs()
