"""Residual add and RMSNorm in one kernel (the decode step's ``h = h + a; x = norm(h)``), forward only.

Math, per row (``h``, ``a`` of length ``N``, the residual stream and what a block adds to it)::

    s    = round(h + a)                          summed in fp32, rounded once to the dtype of s: exactly
                                                 what ``h + a`` gives in PyTorch
    rstd = 1 / sqrt(mean(s**2) + eps)            fp32, from the *rounded* s (what the next norm reads)
    n    = s * rstd                              fp32

    Llama (``flavour="llama"``):    y = cast(n, s.dtype) * w      the cast before the weight multiply
    Gemma (``flavour="gemma"``):    y = cast(n * (1 + w), s.dtype) in fp32, one cast at the end
    gpt-oss (``flavour="gpt_oss"``): y = cast(n * w, s.dtype)       in fp32, one cast at the end

and both ``s`` (the new residual stream) and ``y`` (the next block's input) are returned. The norm is
:mod:`notebookkit.kernels.rms_norm`'s forward on ``s``, flavour for flavour; ``y``'s dtype follows it
(Llama: ``promote(s.dtype, w.dtype)``, the others ``s.dtype``, as Hugging Face).

One kernel instead of two reads ``h`` and ``a`` once and writes ``s`` and ``y`` once (the unfused pair
reads ``s`` back), and saves a launch: a decode step of one token per row is made of small kernels,
where the launch gap costs more than the memory traffic.

No backward: this is the decode path's op (no gradients). Under autograd (grad mode on and an input that
requires grad) :func:`add_rms_norm` runs the PyTorch reference, which autograd differentiates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from notebookkit.kernels.rms_norm import flavour_flags, normalized_rows, normed_dtype, row_tiles, rms_norm_reference
from notebookkit.kernels.runtime import should_use_triton

__all__ = ["add_rms_norm", "add_rms_norm_reference", "add_rms_norm_launch"]


@triton.jit
def _add_rms_norm_kernel(
    H, A, W, S, Y,
    n_rows, n_cols, stride_h, stride_a, stride_s, stride_y, eps,
    CAST_FIRST: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)

    h = tl.load(H + rows64[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + rows64[:, None] * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = (h + a).to(S.dtype.element_ty)
    tl.store(S + rows64[:, None] * stride_s + cols[None, :], s, mask=mask)

    y, _ = normalized_rows(s.to(tl.float32), W, cols, n_cols, eps, CAST_FIRST, UNIT_OFFSET, S.dtype.element_ty)
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, N]`` with unit column stride (a copy only when the layout needs one)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.shape[1] <= 1 or t2.stride(1) == 1 else t2.contiguous()


def add_rms_norm_launch(
    hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, flavour: str,
    residual_out: torch.Tensor, normed_out: torch.Tensor,
) -> None:
    """Run the kernel: ``residual_out = hidden + delta``, ``normed_out = RMSNorm(residual_out)``.

    All four activations have one shape ``[..., N]``; ``hidden``/``delta`` share a dtype, which is
    ``residual_out``'s; the outputs are fully overwritten and must be contiguous. ``weight`` is ``[N]``.
    """
    n_cols = hidden.shape[-1]
    h2, a2 = _rows(hidden), _rows(delta)
    s2, y2 = residual_out.view(-1, n_cols), normed_out.view(-1, n_cols)
    n_rows = h2.shape[0]
    if n_rows == 0:
        return
    block_m, block_n, num_warps = row_tiles(n_rows, n_cols, "add_rms_norm")
    _add_rms_norm_kernel[(triton.cdiv(n_rows, block_m),)](
        h2, a2, weight.contiguous(), s2, y2, n_rows, n_cols, h2.stride(0), a2.stride(0), s2.stride(0), y2.stride(0),
        float(eps), **flavour_flags(flavour), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )


def add_rms_norm_reference(
    hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, flavour: str = "llama"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch ``(s, RMSNorm(s))`` with ``s = hidden + delta`` (the CPU path and the test oracle).

    The norm is :func:`~notebookkit.kernels.rms_norm.rms_norm_reference` (fp32 reductions, fp64 for fp64
    inputs, so it doubles as a float64 oracle).
    """
    residual = hidden + delta
    return residual, rms_norm_reference(residual, weight, eps, flavour)


def add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, flavour: str = "llama"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``delta`` to the residual stream ``hidden`` and RMS-normalise the sum, in one kernel.

    Args:
        hidden: the residual stream ``[..., N]`` (e.g. ``[B, T, hidden]``), fp32, fp16 or bf16.
        delta: what a block adds to it (attention or MLP output), same shape and dtype.
        weight: ``[N]``, the norm module's ``weight``.
        eps: the norm's epsilon (``variance_epsilon`` / ``eps`` of the Hugging Face module).
        flavour: ``"llama"``, ``"gemma"`` or ``"gpt_oss"`` (:data:`~notebookkit.kernels.rms_norm.NORM_FLAVOURS`).

    Returns:
        ``(s, y)``: ``s = hidden + delta`` exactly as PyTorch rounds it, and ``y = RMSNorm(s)`` (module
        docstring). CUDA tensors run the Triton kernel, CPU tensors the reference
        (:mod:`notebookkit.kernels.runtime`); so do mixed dtypes and inputs under autograd (no backward here).
    """
    if hidden.shape != delta.shape:
        raise ValueError(
            f"add_rms_norm: hidden {tuple(hidden.shape)} and delta {tuple(delta.shape)} must have one shape "
            "(the residual stream and the block output added to it)."
        )
    if weight.dim() != 1 or weight.shape[0] != hidden.shape[-1]:
        raise ValueError(
            f"add_rms_norm: weight has shape {tuple(weight.shape)} but the last dimension is {hidden.shape[-1]}; "
            "pass the norm's 1-D weight of that size."
        )
    differentiating = torch.is_grad_enabled() and any(t.requires_grad for t in (hidden, delta, weight))
    if not should_use_triton(hidden) or differentiating or hidden.dtype != delta.dtype:
        return add_rms_norm_reference(hidden, delta, weight, eps, flavour)
    if not (hidden.device == delta.device == weight.device):
        raise ValueError(
            f"add_rms_norm: hidden ({hidden.device}), delta ({delta.device}) and weight ({weight.device}) must be "
            "on one device."
        )
    residual = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    normed = torch.empty(hidden.shape, dtype=normed_dtype(hidden.dtype, weight.dtype, flavour), device=hidden.device)
    add_rms_norm_launch(hidden, delta, weight, eps, flavour, residual, normed)
    return residual, normed


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py): (kernel, signature, constexprs, options)
# --------------------------------------------------------------------------------------------------
def _aot_specs() -> list:
    def spec(dt, weight_dt, normed_dt, flavour, block_m, block_n, warps, targets):
        sig = {"H": f"*{dt}", "A": f"*{dt}", "W": f"*{weight_dt}", "S": f"*{dt}", "Y": f"*{normed_dt}",
               "n_rows": "i32", "n_cols": "i32", "stride_h": "i32", "stride_a": "i32", "stride_s": "i32",
               "stride_y": "i32", "eps": "fp32"}
        return (_add_rms_norm_kernel, sig, {**flavour_flags(flavour), "BLOCK_M": block_m, "BLOCK_N": block_n},
                {"num_warps": warps, "targets": targets})

    return [
        # the T4 (sm_75): fp16, every flavour, a decode row of an 8B model and a batch of narrow rows
        spec("fp16", "fp16", "fp16", "llama", 1, 4096, 8, [75, 90]),
        spec("fp16", "fp16", "fp16", "gemma", 1, 4096, 8, [75, 90]),
        spec("fp16", "fp32", "fp16", "gpt_oss", 1, 4096, 8, [75, 90]),
        spec("fp16", "fp32", "fp32", "llama", 8, 512, 4, [75, 90]),
        # Ampere and newer: bf16
        spec("bf16", "bf16", "bf16", "llama", 1, 4096, 8, [90]),
        spec("bf16", "bf16", "bf16", "gemma", 1, 2048, 4, [90]),
    ]


AOT_SPECS = _aot_specs()
