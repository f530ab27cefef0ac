"""Residual add, RMSNorm and the LoRA group's rank-space product of the normalised row, in one launch (the batch-1
decode step's ``h = h + a; x = norm(h); U = x A_cat^T``), forward only.

Math, for one row (``h``, ``a`` of length ``N``; ``A_cat [R, N]`` the stacked ``A`` of the adapters that read
``x``: q/k/v's, or gate/up's; ``c`` the row's dtype)::

    s = round_c(h + a)                       the new residual stream, as PyTorch rounds ``h + a``
    x = norm(s)                              :mod:`notebookkit.kernels.add_rms_norm`'s, flavour for flavour
    U[j] = round_c( sum_k fp32(x[k]) fp32(A_cat[j, k]) )      fp32 sum of the *rounded* x, one rounding

``s`` and ``x`` are :func:`~notebookkit.kernels.add_rms_norm.add_rms_norm`'s, bit for bit; ``U`` is
:func:`~notebookkit.kernels.skinny_matmul.skinny_matmul` of ``x`` up to the order of the fp32 additions.

Why: at batch 1 a decoder layer's norm, the thin product ``x A_cat^T`` and the matrix-vector kernel that reads
``U`` were three launches each tiny (the 1B model's q/k/v ``A_cat`` is 48 x 2048: 192 KiB), and a decode step is
made of such launches, not of bytes (#35). Here program ``j`` of ``R`` computes the whole norm of the row again
(``N`` elements from L2: 2-8 K) and then its one ``U[j]``; program 0 also writes ``s`` and ``x``. The norm's
work is repeated ``R`` times, which costs less than the launch it replaces. Graph-safe: no host
synchronisation, the outputs the only allocations.

Other inputs (more than one row, a normalised dtype other than the row's, ``A_cat`` in another dtype, CPU
tensors without the interpreter, under autograd) run the unfused pair: :func:`add_rms_norm_low_rank_supported`
says which.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from notebookkit.kernels.add_rms_norm import add_rms_norm
from notebookkit.kernels.rms_norm import flavour_flags, normalized_rows, normed_dtype, row_tiles
from notebookkit.kernels.runtime import should_use_triton
from notebookkit.kernels.skinny_matmul import MAX_OUT, skinny_matmul

__all__ = ["add_rms_norm_low_rank", "add_rms_norm_low_rank_supported", "AOT_SPECS"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _add_rms_norm_low_rank_kernel(
    H, A, W, S, Y, LA, U,
    n_cols, stride_la, eps,
    CAST_FIRST: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr,
):
    j = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    h = tl.load(H + cols[None, :], mask=col_ok[None, :], other=0.0).to(tl.float32)
    a = tl.load(A + cols[None, :], mask=col_ok[None, :], other=0.0).to(tl.float32)
    s = (h + a).to(S.dtype.element_ty)
    y, _ = normalized_rows(s.to(tl.float32), W, cols, n_cols, eps, CAST_FIRST, UNIT_OFFSET, S.dtype.element_ty)
    y = y.to(Y.dtype.element_ty)
    if j == 0:
        tl.store(S + cols[None, :], s, mask=col_ok[None, :])
        tl.store(Y + cols[None, :], y, mask=col_ok[None, :])
    la = tl.load(LA + j.to(tl.int64) * stride_la + cols[None, :], mask=col_ok[None, :], other=0.0).to(tl.float32)
    u = tl.sum(y.to(tl.float32) * la, axis=1)  # [1]
    tl.store(U + j + tl.arange(0, 1), u.to(U.dtype.element_ty))


def add_rms_norm_low_rank_supported(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, flavour: str,
                                    a_cat: torch.Tensor) -> bool:
    """Whether :func:`add_rms_norm_low_rank` runs its kernel: one row (``hidden.numel() == N``) of fp16, bf16 or
    fp32 on CUDA (or with Triton forced on under the interpreter), ``delta`` of its shape and dtype, a norm whose
    output keeps that dtype (:func:`~notebookkit.kernels.rms_norm.normed_dtype`), ``A_cat [R, N]`` of that dtype
    (``R`` at most :data:`~notebookkit.kernels.skinny_matmul.MAX_OUT`) with unit column stride, one device, and no
    gradient asked for."""
    n = hidden.shape[-1] if hidden.dim() else 0
    if not n or hidden.numel() != n or delta.shape != hidden.shape or hidden.dtype not in _DTYPES:
        return False
    if delta.dtype != hidden.dtype or a_cat.dtype != hidden.dtype or weight.shape != (n,):
        return False
    if a_cat.dim() != 2 or a_cat.shape[1] != n or not 0 < a_cat.shape[0] <= MAX_OUT or a_cat.stride(1) != 1:
        return False
    if normed_dtype(hidden.dtype, weight.dtype, flavour) != hidden.dtype:
        return False
    if not (hidden.device == delta.device == weight.device == a_cat.device):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (hidden, delta, weight, a_cat)):
        return False
    return should_use_triton(hidden)


def add_rms_norm_low_rank(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                          flavour: str, a_cat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(s, x, U)``: ``s = hidden + delta``, ``x = RMSNorm(s)`` (both of ``hidden``'s shape) and ``U = x A_cat^T``
    (``[rows, R]``, ``x``'s dtype), in one launch where :func:`add_rms_norm_low_rank_supported`, else
    :func:`~notebookkit.kernels.add_rms_norm.add_rms_norm` then
    :func:`~notebookkit.kernels.skinny_matmul.skinny_matmul` of ``x`` and ``A_cat`` in ``x``'s dtype (the same
    function; module docstring).

    Args:
        hidden, delta: the residual stream and what a block adds to it, ``[..., N]`` (one row for the kernel).
        weight: the norm's ``[N]`` weight; ``eps``, ``flavour``: the norm's (``"llama"``, ``"gemma"``,
            ``"gpt_oss"``).
        a_cat: ``[R, N]``, the adapters' ``A`` stacked by rows, in the row's dtype.

    Safe inside CUDA graph capture once a call of the same shapes has run.
    """
    if not add_rms_norm_low_rank_supported(hidden, delta, weight, flavour, a_cat):
        residual, normed = add_rms_norm(hidden, delta, weight, eps, flavour)
        return residual, normed, skinny_matmul(normed.reshape(-1, normed.shape[-1]), a_cat.to(normed.dtype))
    n = hidden.shape[-1]
    _, block_n, num_warps = row_tiles(1, n, "add_rms_norm_low_rank")
    residual = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    normed = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    r = a_cat.shape[0]
    u = torch.empty((1, r), dtype=hidden.dtype, device=hidden.device)
    _add_rms_norm_low_rank_kernel[(r,)](
        hidden, delta, weight, residual, normed, a_cat, u, n, a_cat.stride(0), float(eps), **flavour_flags(flavour),
        BLOCK_N=block_n, num_warps=num_warps,
    )
    return residual, normed, u


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py): (kernel, signature, constexprs, options)
# --------------------------------------------------------------------------------------------------
def _aot_specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """The Llama-3.1-8B (N = 4096) and Llama-3.2-1B (N = 2048) decode rows: fp16 for the T4 (sm_75), bf16 for
    sm_90, each norm flavour once."""
    specs = []
    for ty, weight_ty, flavour, n, targets in (("fp16", "fp16", "llama", 4096, [75, 90]),
                                               ("fp16", "fp16", "gemma", 2048, [75, 90]),
                                               ("fp16", "fp32", "gpt_oss", 4096, [75, 90]),
                                               ("bf16", "bf16", "llama", 2048, [90])):
        _, block_n, warps = row_tiles(1, n)
        signature = {"H": f"*{ty}", "A": f"*{ty}", "W": f"*{weight_ty}", "S": f"*{ty}", "Y": f"*{ty}",
                     "LA": f"*{ty}", "U": f"*{ty}", "n_cols": "i32", "stride_la": "i32", "eps": "fp32"}
        specs.append((_add_rms_norm_low_rank_kernel, signature, {**flavour_flags(flavour), "BLOCK_N": block_n},
                      {"num_warps": warps, "targets": targets}))
    return specs


AOT_SPECS = _aot_specs()
