"""GEMMs through a frozen ternary base, dequantising in the tile: the forward ``y = x @ W^T`` and the
input gradient ``dx = dy @ W``, never writing the dense ``W``.

Math (``W [N, K]`` a :class:`~notebookkit.kernels.ternary.TernaryWeight`, ``x [M, K]``, ``dy [M, N]``):

    w[n, k]  = c( s[n, k // G] * t[n, k] )                    exact in fp16 / fp32 (s is fp16)
    y[m, n]  = c( sum_k fp32(x[m, k]) * w[n, k] )             fp32 accumulation, one rounding to c
    dx[m, k] = c( sum_n fp32(dy[m, n]) * w[n, k] )

``c`` is the dtype of ``x`` (``dy``). ``w`` is ``dequantize_ternary(W, out_dtype=c)``, so the results are
``x @ dequantize_ternary(W)^T`` and ``dy @ dequantize_ternary(W)`` up to the order of the fp32 additions.
There is no weight gradient: the base is frozen; LoRA's adapters take theirs from ``x`` and ``dy``.

Tiling: one kernel serves both, ``out = a @ W^T`` (``a = x``) and, with ``INPUT_GRAD``, ``out = a @ W``
(``a = dy``). Forward programs own ``[BLOCK_M, BLOCK_N]`` of ``y`` and walk ``K``; input-gradient programs
own ``[BLOCK_M, BLOCK_K]`` of ``dx`` and walk ``N``. Both build the ``[BLOCK_N, BLOCK_K]`` tile of ``w`` from
``BLOCK_K / 4`` bytes a row (:func:`~notebookkit.kernels.ternary.ternary_tile`) in registers and feed
``tl.dot`` (fp32 inputs as IEEE fp32, not TF32). ``tl.dot`` on bf16 is wrong under triton 3.9's
interpreter, so CPU tests cover fp32 and fp16 only.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .dequant_gemm import as_rows, dot_acc
from .runtime import should_use_triton
from .ternary import TernaryWeight, dequantize_ternary_reference, ternary_tile

__all__ = [
    "ternary_matmul", "ternary_matmul_reference", "ternary_input_grad", "ternary_input_grad_reference",
    "ternary_linear", "AOT_SPECS",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _ternary_gemm_kernel(
    a_ptr,  # [M, n_inner], row stride stride_am: x (forward) or dy (INPUT_GRAD)
    packed_ptr,  # *u8 [N, row_bytes]
    scales_ptr,  # *fp16 [N, n_groups]
    out_ptr,  # [M, n_out] contiguous, dtype of a: y (forward) or dx (INPUT_GRAD)
    M, n_out, n_inner, stride_am, row_bytes, n_groups, group_size,
    BLOCK_M: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_INNER: tl.constexpr, IEEE: tl.constexpr,
    INPUT_GRAD: tl.constexpr,
):
    """``out = a @ W^T`` (forward: ``W``'s rows are the outputs) or, with ``INPUT_GRAD``, ``out = a @ W``
    (``W``'s rows are the inner index); a program owns ``[BLOCK_M, BLOCK_OUT]`` of ``out`` and walks the
    inner index in steps of ``BLOCK_INNER``."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ro = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    m_ok = rm < M
    o_ok = ro < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_OUT), dtype=tl.float32)
    for i0 in range(0, n_inner, BLOCK_INNER):
        ri = i0 + tl.arange(0, BLOCK_INNER)
        i_ok = ri < n_inner
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_am + ri[None, :],
                    mask=m_ok[:, None] & i_ok[None, :], other=0.0)
        if INPUT_GRAD:
            w = ternary_tile(packed_ptr, scales_ptr, ri, ro, i_ok, o_ok, row_bytes, n_groups, group_size)
            acc = dot_acc(a, w.to(a.dtype), acc, IEEE)
        else:
            w = ternary_tile(packed_ptr, scales_ptr, ro, ri, o_ok, i_ok, row_bytes, n_groups, group_size)
            acc = dot_acc(a, tl.trans(w.to(a.dtype)), acc, IEEE)
    offs = rm[:, None].to(tl.int64) * n_out + ro[None, :]
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & o_ok[None, :])


def _config(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps); small M (decode, short rows) takes 16-row tiles."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    return block_m, 64, 64, 4


def check_ternary_operand(a: torch.Tensor, weight: TernaryWeight, what: str, where: str) -> None:
    """``a`` (``x`` against ``in_features``, ``dy`` against ``out_features``) checked against the ternary weight:
    its type, ``a``'s dtype, last dimension and device, each refused with what to change."""
    if not isinstance(weight, TernaryWeight):
        raise TypeError(f"{where} takes a TernaryWeight (see quantize_ternary), got {type(weight).__name__}.")
    width = weight.in_features if what == "x" else weight.out_features
    if a.dtype not in _DTYPES:
        raise ValueError(f"{where}: {what} must be float16, bfloat16 or float32, got {a.dtype}.")
    if a.shape[-1] != width:
        raise ValueError(f"{where}: {what} has last dimension {a.shape[-1]}, the ternary weight of shape "
                         f"{weight.shape} needs {width}.")
    if a.device != weight.device:
        raise ValueError(f"{where}: {what} is on {a.device} but the ternary weight is on {weight.device}.")


def ternary_matmul_reference(x: torch.Tensor, weight: TernaryWeight) -> torch.Tensor:
    """Plain-PyTorch ``x @ dequantize_ternary(W)^T`` (fp32 accumulation, one rounding to ``x.dtype``)."""
    check_ternary_operand(x, weight, "x", "ternary_matmul")
    w = dequantize_ternary_reference(weight, x.dtype).float()
    return (x.float() @ w.t()).to(x.dtype)


def ternary_input_grad_reference(dy: torch.Tensor, weight: TernaryWeight) -> torch.Tensor:
    """Plain-PyTorch ``dy @ dequantize_ternary(W)`` (fp32 accumulation, one rounding to ``dy.dtype``)."""
    check_ternary_operand(dy, weight, "dy", "ternary_input_grad")
    w = dequantize_ternary_reference(weight, dy.dtype).float()
    return (dy.float() @ w).to(dy.dtype)


def _launch(a: torch.Tensor, weight: TernaryWeight, input_grad: bool) -> torch.Tensor:
    """``a @ W^T`` (``a`` is ``x``) or, with ``input_grad``, ``a @ W`` (``a`` is ``dy``) through the kernel."""
    n, k = weight.shape
    out_width, inner = (k, n) if input_grad else (n, k)
    a2 = as_rows(a, inner)
    m = a2.shape[0]
    out = torch.empty((m, out_width), dtype=a.dtype, device=a.device)
    if m == 0 or out_width == 0:
        return out.reshape(*a.shape[:-1], out_width)
    block_m, block_n, block_k, warps = _config(m)
    block_out, block_inner = (block_k, block_n) if input_grad else (block_n, block_k)
    grid = (triton.cdiv(m, block_m), triton.cdiv(out_width, block_out))
    _ternary_gemm_kernel[grid](
        a2, weight.packed.contiguous(), weight.scales.contiguous(), out,
        m, out_width, inner, a2.stride(0), weight.packed.shape[1], weight.scales.shape[1], weight.group_size,
        BLOCK_M=block_m, BLOCK_OUT=block_out, BLOCK_INNER=block_inner, IEEE=a.dtype == torch.float32,
        INPUT_GRAD=input_grad, num_warps=warps,
    )
    return out.reshape(*a.shape[:-1], out_width)


def ternary_matmul(x: torch.Tensor, weight: TernaryWeight) -> torch.Tensor:
    """``y = x @ dequantize_ternary(W, x.dtype)^T`` for ``x [..., in]``: ``[..., out]`` in ``x.dtype``.

    CUDA tensors run the fused Triton GEMM (the dense weight is never written); CPU tensors run the
    reference unless Triton is forced (``runtime.use_triton(True)`` under ``TRITON_INTERPRET=1``).
    """
    check_ternary_operand(x, weight, "x", "ternary_matmul")
    if not should_use_triton(x):
        return ternary_matmul_reference(x, weight)
    return _launch(x, weight, input_grad=False)


def ternary_input_grad(dy: torch.Tensor, weight: TernaryWeight) -> torch.Tensor:
    """``dx = dy @ dequantize_ternary(W, dy.dtype)`` for ``dy [..., out]``: ``[..., in]`` in ``dy.dtype``
    (the backward of :func:`ternary_matmul` through the frozen base)."""
    check_ternary_operand(dy, weight, "dy", "ternary_input_grad")
    if not should_use_triton(dy):
        return ternary_input_grad_reference(dy, weight)
    return _launch(dy, weight, input_grad=True)


class _TernaryLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: TernaryWeight) -> torch.Tensor:  # type: ignore[override]
        ctx.weight = weight
        return ternary_matmul(x, weight)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        dx = ternary_input_grad(dy.contiguous(), ctx.weight) if ctx.needs_input_grad[0] else None
        return dx, None


def ternary_linear(x: torch.Tensor, weight: TernaryWeight) -> torch.Tensor:
    """``x @ W^T`` through a frozen ternary base, differentiable in ``x`` (forward :func:`ternary_matmul`,
    backward :func:`ternary_input_grad`)."""
    return _TernaryLinear.apply(x, weight)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py)
# --------------------------------------------------------------------------------------------------


def _aot_specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    specs = []
    for input_grad in (False, True):
        for ty, m in (("fp16", 16), ("fp16", 128), ("bf16", 128), ("fp32", 128)):
            signature = {
                "a_ptr": f"*{ty}", "packed_ptr": "*u8", "scales_ptr": "*fp16", "out_ptr": f"*{ty}",
                "M": "i32", "n_out": "i32", "n_inner": "i32", "stride_am": "i32", "row_bytes": "i32",
                "n_groups": "i32", "group_size": "i32",
            }
            block_m, block_n, block_k, warps = _config(m)
            block_out, block_inner = (block_k, block_n) if input_grad else (block_n, block_k)
            constexprs = {"BLOCK_M": block_m, "BLOCK_OUT": block_out, "BLOCK_INNER": block_inner,
                          "IEEE": ty == "fp32", "INPUT_GRAD": input_grad}
            options: dict[str, Any] = {"num_warps": warps}
            if ty == "bf16":
                options["targets"] = [80, 86, 89, 90]  # sm_75 has no bf16 tensor-core dot
            specs.append((_ternary_gemm_kernel, signature, constexprs, options))
    return specs


AOT_SPECS = _aot_specs()
