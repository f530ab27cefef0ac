"""The product of many rows with a frozen 2-bit or ternary base: dequantise a bounded chunk, then cuBLAS.

For ``M`` rows (tokens) and a packed weight ``W [N, K]`` (:class:`~notebookkit.kernels.q2.Q2Weight` or
:class:`~notebookkit.kernels.ternary.TernaryWeight`), ``c`` the compute dtype (that of ``x``):

    forward    y[:, n0:n1]  = x  @ deq_c(W[n0:n1, :])^T      row chunks of W
    backward   dx[:, k0:k1] = dy @ deq_c(W[:, k0:k1])        column chunks of W

``deq_c`` is the format's own dequantisation (``dequantize_q2`` / ``dequantize_ternary``, bit for bit),
each chunk holds at most :data:`CHUNK_BYTES` of ``c`` and is freed before the next, and each product is
one cuBLAS GEMM with fp32 accumulation writing straight into its slice of the output. So the result is
the dequantise-then-matmul product of the in-tile kernels (:mod:`.q2_matmul`, :mod:`.ternary_matmul`)
up to the order of the fp32 additions, at cuBLAS speed, with one chunk of dense weight alive at a time.

Why two ways: on an H200 at ``M = 8192`` and the 8B projections the in-tile kernels reach ~180 TFLOP/s
(2-bit) and ~43 TFLOP/s (ternary) while this path reaches ~680 (``benchmarks/low_bit_gemm.py``,
``benchmarks/results/2026-12-03-NVIDIA-H200-low-bit-gemm-s20.md``); a chunk's dequantisation costs a
fixed few microseconds, so few rows (decode, short prompts) stay in the tile kernels.
:func:`low_bit_matmul` / :func:`low_bit_matmul_backward_input` choose by ``M`` (:data:`DENSE_MIN_ROWS`)
and :func:`low_bit_product` is their autograd function (``x`` differentiable, ``W`` frozen). The memory
model counts the chunk (``notebookkit.base_formats``: the 2-bit and ternary rows' ``product``).
"""

from __future__ import annotations

import torch

from notebookkit.base_formats import DEQUANT_CHUNK_BYTES, DEQUANT_CHUNK_MIN_ROWS

from .q2 import Q2Weight, dequantize_q2
from .q2_matmul import q2_matmul, q2_matmul_backward_input
from .ternary import TernaryWeight, dequantize_ternary
from .ternary_matmul import ternary_input_grad, ternary_matmul

__all__ = ["CHUNK_BYTES", "DENSE_MIN_ROWS", "chunked_dequant_matmul", "chunked_dequant_matmul_backward_input",
           "low_bit_matmul", "low_bit_matmul_backward_input", "low_bit_product"]

#: the most bytes of dense weight one chunk holds (the memory model's figure)
CHUNK_BYTES = DEQUANT_CHUNK_BYTES
#: rows from which a CUDA product goes through dense chunks (fewer: the in-tile kernels)
DENSE_MIN_ROWS = DEQUANT_CHUNK_MIN_ROWS


def _rows(w, n0: int, n1: int):
    """Rows ``n0:n1`` of a packed weight (views: codes and scales are row-major)."""
    if isinstance(w, Q2Weight):
        return Q2Weight(w.codes[n0:n1], w.scale[n0:n1], w.zero[n0:n1], (n1 - n0, w.shape[1]), w.group_size, w.dtype)
    return TernaryWeight(w.packed[n0:n1], w.scales[n0:n1], w.in_features, w.group_size)


def _columns(w, k0: int, k1: int):
    """Columns ``k0:k1`` of a packed weight (small copies of the codes and scales; ``k0``, ``k1`` on group
    and byte boundaries, see :func:`_column_step`)."""
    if isinstance(w, Q2Weight):
        g = w.group_size
        return Q2Weight(w.codes[:, k0 // 4:k1 // 4].contiguous(), w.scale[:, k0 // g:k1 // g].contiguous(),
                        w.zero[:, k0 // g:k1 // g].contiguous(), (w.shape[0], k1 - k0), g, w.dtype)
    g = w.group_size
    return TernaryWeight(w.packed[:, k0 // 4:-(-k1 // 4)].contiguous(), w.scales[:, k0 // g:-(-k1 // g)].contiguous(),
                         k1 - k0, g)


#: chunk lengths are multiples of this (cuBLAS tiles), unless the whole weight is shorter
ALIGN = 128


def _column_step(w, align: int) -> int:
    """Column chunks start on a code byte (4 codes), on a group where scales change along a row, and on
    ``align`` (a power of two >= 4)."""
    return align if w.group_size >= w.shape[1] else max(align, w.group_size)


def _dequantise(w, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_q2(w, dtype) if isinstance(w, Q2Weight) else dequantize_ternary(w, dtype)


def _chunk(total: int, other: int, step: int, element_bytes: int, chunk_bytes: int) -> int:
    """Chunk length along ``total`` (a multiple of ``step``) whose ``[chunk, other]`` dense block fits ``chunk_bytes``."""
    fit = max(step, (chunk_bytes // max(1, other * element_bytes)) // step * step)
    return min(total, fit)


def chunked_dequant_matmul(x: torch.Tensor, w, chunk_bytes: int = CHUNK_BYTES, align: int = ALIGN) -> torch.Tensor:
    """``x @ deq(W)^T`` (``[..., K] -> [..., N]``), ``W`` dequantised ``chunk_bytes`` at a time by rows,
    chunks a multiple of ``align`` rows long."""
    n, k = w.shape
    x2 = x.reshape(-1, k)
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    step = _chunk(n, k, align, x.element_size(), chunk_bytes)
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        block = _dequantise(w if n1 - n0 == n else _rows(w, n0, n1), x.dtype)
        torch.mm(x2, block.t(), out=y[:, n0:n1])
        del block
    return y.reshape(*x.shape[:-1], n)


def chunked_dequant_matmul_backward_input(dy: torch.Tensor, w, chunk_bytes: int = CHUNK_BYTES,
                                          align: int = ALIGN) -> torch.Tensor:
    """``dy @ deq(W)`` (``[..., N] -> [..., K]``), ``W`` dequantised ``chunk_bytes`` at a time by columns
    (:func:`_column_step`)."""
    n, k = w.shape
    dy2 = dy.reshape(-1, n)
    dx = torch.empty((dy2.shape[0], k), dtype=dy.dtype, device=dy.device)
    step = _chunk(k, n, _column_step(w, align), dy.element_size(), chunk_bytes)
    for k0 in range(0, k, step):
        k1 = min(k, k0 + step)
        block = _dequantise(w if k1 - k0 == k else _columns(w, k0, k1), dy.dtype)
        torch.mm(dy2, block, out=dx[:, k0:k1])
        del block
    return dx.reshape(*dy.shape[:-1], k)


def _dense_chunks(a: torch.Tensor) -> bool:
    """Whether a product of ``a``'s rows goes through dense chunks: CUDA and at least :data:`DENSE_MIN_ROWS` rows."""
    return a.is_cuda and a.numel() // max(1, a.shape[-1]) >= DENSE_MIN_ROWS


def low_bit_matmul(x: torch.Tensor, w) -> torch.Tensor:
    """``x @ deq(W)^T`` for a 2-bit or ternary ``W``: dense chunks for many rows on CUDA, else the in-tile kernel."""
    if _dense_chunks(x):
        return chunked_dequant_matmul(x, w)
    return q2_matmul(x, w) if isinstance(w, Q2Weight) else ternary_matmul(x, w)


def low_bit_matmul_backward_input(dy: torch.Tensor, w) -> torch.Tensor:
    """``dy @ deq(W)``, the input gradient of :func:`low_bit_matmul`, chosen the same way."""
    if _dense_chunks(dy):
        return chunked_dequant_matmul_backward_input(dy, w)
    return q2_matmul_backward_input(dy, w) if isinstance(w, Q2Weight) else ternary_input_grad(dy, w)


class _LowBitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):  # type: ignore[override]
        ctx.weight = w
        return low_bit_matmul(x, w)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        dx = low_bit_matmul_backward_input(dy.contiguous(), ctx.weight) if ctx.needs_input_grad[0] else None
        return dx, None


def low_bit_product(x: torch.Tensor, w) -> torch.Tensor:
    """``x @ deq(W)^T`` with autograd to ``x`` (the frozen 2-bit or ternary base of a LoRA projection)."""
    return _LowBitLinear.apply(x, w)
