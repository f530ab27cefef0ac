"""Decode matrix-vector product for 2-bit and ternary bases: ``y = x @ deq(W)^T`` for a few rows of
``x``, reading the packed codes and the group scales directly, never writing the dense weight.

Both formats store four 2-bit codes a byte along ``K`` (weight ``k`` of a row in byte ``k // 4`` at
bits ``2 * (k % 4)``) and fp16 scales per row and group of ``G`` inputs; they differ in the zero point:

    2-bit   (:class:`~notebookkit.kernels.q2.Q2Weight`)       w = (code - zero[n, g]) * scale[n, g]
    ternary (:class:`~notebookkit.kernels.ternary.TernaryWeight`) w = (code - 1) * scales[n, g]

with ``g = k // G``. For ``x [M, K]`` (``M`` the decode batch, ``c`` its dtype), cutting each row into
words ``u`` of 16 weights (four code bytes read as one 32-bit word; a word lies inside one group):

    y[m, n] = c( sum_u s[n, u] * ( sum_{k in u} code[n, k] x[m, k]  -  z[n, u] * sum_{k in u} x[m, k] ) )

all in fp32 (``z = zero`` for 2-bit, 1 for ternary): the product with the weight dequantised in fp32,
up to the order of the fp32 additions. It is not rounded to ``c`` weight by weight as the training
path's dequantised weight is (a difference of one rounding of ``c`` a weight, below the rounding of
``y``); the reference computes the same fp32 product.

Kernel: a program owns ``BLOCK_N`` rows of ``W`` and one row of ``x`` (grid ``[N / BLOCK_N, M]``) and
walks a row ``WORDS`` words at a time: one load of ``[BLOCK_N, WORDS]`` 32-bit words, then for each of
the 16 code positions a shift, a mask and a multiply-add against ``x[16 u + i]`` (a ``[WORDS]`` vector
shared by the rows, from the cache), all on ``[BLOCK_N, WORDS]`` tiles of one layout: no reduction and
no reshape inside the loop. Each word's scale (and zero) is applied once, to its 16-weight sum, with
``sum x`` of the word shared by the rows; one reduction at the end. No ``tl.dot`` (bf16 runs under the
interpreter too), no split over ``K``, deterministic. Each row of ``x`` reads ``W`` again: meant for
``M`` up to :data:`MAX_ROWS`; more rows, and weights whose rows are not whole words (:func:`reads_words`),
go through :func:`~notebookkit.kernels.chunked_dequant_matmul.low_bit_matmul`, CPU tensors through the
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
    words_ptr,  # *i32 [N, row_words]: the code bytes read four at a time (16 codes a word)
    scale_ptr, zero_ptr,  # *fp16 [N, n_groups] each (zero_ptr unused without HAS_ZERO)
    y_ptr,  # *c [M, N] contiguous
    N, K, row_words, n_groups, group_size, stride_xm,
    BLOCK_N: tl.constexpr, WORDS: tl.constexpr, HAS_ZERO: tl.constexpr,
):
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    for w0 in range(0, row_words, WORDS):
        word_at = w0 + tl.arange(0, WORDS)
        word_ok = word_at < row_words
        ok = n_ok[:, None] & word_ok[None, :]
        word = tl.load(words_ptr + rn[:, None] * row_words + word_at[None, :], mask=ok, other=0)
        dot = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)  # sum of code * x over each word's 16 weights
        xsum = tl.zeros((WORDS,), dtype=tl.float32)  # sum of x over each word's 16 weights, shared by the rows
        for i in tl.static_range(16):
            k = word_at * 16 + i
            xv = tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            dot += ((word >> (2 * i)) & 3).to(tl.float32) * xv[None, :]
            xsum += xv
        grp = rn[:, None] * n_groups + ((word_at * 16) // group_size)[None, :]
        s = tl.load(scale_ptr + grp, mask=ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(zero_ptr + grp, mask=ok, other=0.0).to(tl.float32)
            acc += s * (dot - z * xsum[None, :])
        else:
            acc += s * (dot - xsum[None, :])
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + m * N + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)


#: (BLOCK_N, words a step, num_warps); ``benchmarks/low_bit_matvec.py`` sweeps the alternatives
CONFIG = (4, 16, 1)


def _parts(w) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(codes, scale, zero, group size, groups a row) of a packed weight; ``zero`` is the scale for ternary
    (never read there)."""
    if isinstance(w, Q2Weight):
        return w.codes, w.scale, w.zero, w.group_size, w.scale.shape[1]
    if isinstance(w, TernaryWeight):
        return w.packed, w.scales, w.scales, w.group_size, w.scales.shape[1]
    raise TypeError(f"low_bit_matvec takes a Q2Weight or a TernaryWeight, got {type(w).__name__}.")


def reads_words(codes: torch.Tensor, group_size: int, n_groups: int) -> bool:
    """Whether the kernel can take a weight: its code rows are whole 32-bit words (``K`` a multiple of 16,
    the rows 4-byte aligned) and a word's 16 weights share a scale (one group a row, or groups a multiple of
    16). Others (a ternary ``K`` or group that is not) go through the GEMM path."""
    return (codes.shape[1] % 4 == 0 and codes.data_ptr() % 4 == 0 and codes.stride(0) == codes.shape[1]
            and codes.stride(1) == 1 and (n_groups == 1 or group_size % 16 == 0))


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
    if m > MAX_ROWS or not reads_words(codes, group, n_groups):
        return low_bit_matmul(x, w)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        block_n, words, warps = config or CONFIG
        _low_bit_matvec_kernel[(triton.cdiv(n, block_n), m)](
            x2, codes.view(torch.int32), scale, zero, y, n, k, codes.shape[1] // 4, n_groups, group, x2.stride(0),
            BLOCK_N=block_n, WORDS=words, HAS_ZERO=isinstance(w, Q2Weight), num_warps=warps)
    return y.reshape(*x.shape[:-1], n)


def _aot_specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """Both formats (2-bit with its zero, ternary without), fp16 and bf16, at :data:`CONFIG`."""
    specs = []
    block_n, words, warps = CONFIG
    for ty in ("fp16", "bf16"):
        signature = {"x_ptr": f"*{ty}", "words_ptr": "*i32", "scale_ptr": "*fp16", "zero_ptr": "*fp16",
                     "y_ptr": f"*{ty}", "N": "i32", "K": "i32", "row_words": "i32", "n_groups": "i32",
                     "group_size": "i32", "stride_xm": "i32"}
        for has_zero in (True, False):
            constexprs = {"BLOCK_N": block_n, "WORDS": words, "HAS_ZERO": has_zero}
            specs.append((_low_bit_matvec_kernel, signature, constexprs, {"num_warps": warps}))
    return specs


AOT_SPECS = _aot_specs()
