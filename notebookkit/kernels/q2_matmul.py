"""The frozen Q2 base layer of a LoRA projection with the dequantisation inside the GEMM:
``y = x @ dequant(W)^T`` forward and ``dx = dy @ dequant(W)`` backward, the dense weight never
written to memory.

Math (``W`` a :class:`notebookkit.kernels.q2.Q2Weight` ``[N, K]``, group size ``G``; ``x [M, K]``,
``dy [M, N]``; ``c`` the compute dtype, that of ``x``: fp16, bf16 or fp32):

    w[n, k]  = c( (code(n, k) - zero[n, k // G]) * scale[n, k // G] )     fp32, one rounding to c
    forward    y[m, n]  = c( sum_k x[m, k] w[n, k] )                      fp32 accumulation
    backward   dx[m, k] = c( sum_n dy[m, n] w[n, k] )                     fp32 accumulation

``w`` is, bit for bit, ``dequantize_q2(W, out_dtype=c)``, so both are the dequantise-then-matmul
products up to the order of the fp32 additions. The base weight is frozen: no weight gradient.

Kernels: the forward tiles ``y`` in ``[BLOCK_M, BLOCK_N]`` and walks ``K`` in steps of ``BLOCK_K``
(which divides ``G``: one ``(scale, zero)`` per row of ``W`` per step, loaded as a vector); each step
loads the ``[BLOCK_N, BLOCK_K / 4]`` code bytes, splits the four 2-bit fields, dequantises in fp32,
interleaves them back (``tl.join``), rounds to ``c`` and feeds ``tl.dot(x_tile, w_tile^T)``. The
backward tiles ``dx`` in ``[BLOCK_M, BLOCK_K]`` (``BLOCK_K`` again inside one group) and walks ``N``
in steps of ``BLOCK_N`` with the same decode, ``tl.dot(dy_tile, w_tile)``. fp32 dots use
``input_precision="ieee"`` (no TF32). Rows of ``x``/``dy`` need unit column stride; any row stride.

:func:`q2_linear` is the autograd function (``x`` differentiable, ``W`` not); CPU tensors run the
references (dequantise with :func:`notebookkit.kernels.q2.dequantize_q2_reference`, fp32 matmul, one
rounding) unless Triton is forced on under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .dequant_gemm import as_rows, dot_acc
from .q2 import DEFAULT_GROUP_SIZE, Q2Weight, check_q2, dequantize_q2_reference, q2_decode_tile
from .runtime import should_use_triton

__all__ = ["q2_matmul", "q2_matmul_reference", "q2_matmul_backward_input", "q2_matmul_backward_input_reference",
           "q2_linear", "AOT_SPECS"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------------
# References (plain PyTorch, the CPU path and the test oracle)
# --------------------------------------------------------------------------------------------------


def check_q2_operand(a: torch.Tensor, q: Q2Weight, features: int, what: str, name: str) -> None:
    """Refuse an activation ``a`` (named ``name`` in the message of ``what``) that does not fit the Q2 weight."""
    check_q2(q)
    if a.dtype not in _DTYPES:
        raise ValueError(f"{what}: {name} must be float16, bfloat16 or float32, got {a.dtype}.")
    if a.dim() < 1 or a.shape[-1] != features:
        raise ValueError(f"{what}: {name} has {a.shape[-1] if a.dim() else 0} features, the Q2 weight "
                         f"{tuple(q.shape)} needs {features}.")
    if a.device != q.device:
        raise ValueError(f"{what}: {name} is on {a.device} but the Q2 weight on {q.device}; move them together.")


def q2_operand_rows(a: torch.Tensor, q: Q2Weight, features: int, what: str, name: str) -> torch.Tensor:
    """``a`` checked against the Q2 weight (:func:`check_q2_operand`) and seen as ``[rows, features]``
    (:func:`~notebookkit.kernels.dequant_gemm.as_rows`): what a launcher hands its kernel."""
    check_q2_operand(a, q, features, what, name)
    return as_rows(a, features)


def q2_matmul_reference(x: torch.Tensor, q: Q2Weight) -> torch.Tensor:
    """``x @ dequant(W)^T``: ``W`` dequantised to ``x``'s dtype, fp32 product, one rounding."""
    check_q2_operand(x, q, q.shape[1], "q2_matmul", "x")
    w = dequantize_q2_reference(q, x.dtype).float()
    return (x.reshape(-1, q.shape[1]).float() @ w.t()).to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


def q2_matmul_backward_input_reference(dy: torch.Tensor, q: Q2Weight) -> torch.Tensor:
    """``dy @ dequant(W)``: ``W`` dequantised to ``dy``'s dtype, fp32 product, one rounding."""
    check_q2_operand(dy, q, q.shape[0], "q2_matmul_backward_input", "dy")
    w = dequantize_q2_reference(q, dy.dtype).float()
    return (dy.reshape(-1, q.shape[0]).float() @ w).to(dy.dtype).reshape(*dy.shape[:-1], q.shape[1])


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _q2_matmul_fwd_kernel(
    x_ptr,  # *c [M, K], row stride stride_xm
    codes_ptr, scale_ptr, zero_ptr,  # the Q2 weight: *u8 [N, K/4] codes, *fp16 [N, K/G] scale and zero
    y_ptr,  # *c [M, N] contiguous
    M, N, K, stride_xm,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        w = q2_decode_tile(codes_ptr, scale_ptr, zero_ptr, rn, n_ok, k0, K, GROUP, BLOCK_K).to(xt.dtype)
        acc = dot_acc(xt, tl.trans(w), acc, IEEE)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _q2_matmul_bwd_input_kernel(
    dy_ptr,  # *c [M, N], row stride stride_dym
    codes_ptr, scale_ptr, zero_ptr,  # the Q2 weight: *u8 [N, K/4] codes, *fp16 [N, K/G] scale and zero
    dx_ptr,  # *c [M, K] contiguous
    M, N, K, stride_dym,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = tl.program_id(1) * BLOCK_K
    m_ok = rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        n_ok = rn < N
        dyt = tl.load(dy_ptr + rm[:, None] * stride_dym + rn[None, :], mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        w = q2_decode_tile(codes_ptr, scale_ptr, zero_ptr, rn, n_ok, k0, K, GROUP, BLOCK_K).to(dyt.dtype)
        acc = dot_acc(dyt, w, acc, IEEE)
    rk = k0 + tl.arange(0, BLOCK_K)
    tl.store(dx_ptr + rm[:, None] * K + rk[None, :], acc.to(dx_ptr.dtype.element_ty), mask=m_ok[:, None])


def _config(group_size: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_K divides the group (one scale per step).
    Not tuned on a GPU yet."""
    return 64, 64, min(group_size, 64), 4, 3


def q2_matmul(x: torch.Tensor, q: Q2Weight) -> torch.Tensor:
    """``x @ dequant(W)^T`` (``[..., K] -> [..., N]``, ``x``'s dtype), dequantising inside the GEMM
    on CUDA (or forced Triton); the reference elsewhere."""
    if not should_use_triton(x):
        return q2_matmul_reference(x, q)
    n, k = q.shape
    x2 = q2_operand_rows(x, q, k, "q2_matmul", "x")
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        bm, bn, bk, warps, stages = _config(q.group_size)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _q2_matmul_fwd_kernel[grid](x2, q.codes, q.scale, q.zero, y, m, n, k, x2.stride(0), GROUP=q.group_size,
                                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=x.dtype == torch.float32,
                                    num_warps=warps, num_stages=stages)
    return y.reshape(*x.shape[:-1], n)


def q2_matmul_backward_input(dy: torch.Tensor, q: Q2Weight) -> torch.Tensor:
    """``dy @ dequant(W)`` (``[..., N] -> [..., K]``, ``dy``'s dtype), the input gradient of
    :func:`q2_matmul`, dequantising inside the GEMM on CUDA (or forced Triton)."""
    if not should_use_triton(dy):
        return q2_matmul_backward_input_reference(dy, q)
    n, k = q.shape
    dy2 = q2_operand_rows(dy, q, n, "q2_matmul_backward_input", "dy")
    m = dy2.shape[0]
    dx = torch.empty((m, k), dtype=dy.dtype, device=dy.device)
    if m:
        bm, bn, bk, warps, stages = _config(q.group_size)
        grid = (triton.cdiv(m, bm), k // bk)
        _q2_matmul_bwd_input_kernel[grid](dy2, q.codes, q.scale, q.zero, dx, m, n, k, dy2.stride(0),
                                          GROUP=q.group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                          IEEE=dy.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return dx.reshape(*dy.shape[:-1], k)


class _Q2Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, codes, scale, zero, meta):
        q = Q2Weight(codes, scale, zero, *meta)
        ctx.meta = meta
        ctx.save_for_backward(codes, scale, zero)
        return q2_matmul(x, q)

    @staticmethod
    def backward(ctx, dy):
        codes, scale, zero = ctx.saved_tensors
        dx = q2_matmul_backward_input(dy.contiguous(), Q2Weight(codes, scale, zero, *ctx.meta)) \
            if ctx.needs_input_grad[0] else None
        return dx, None, None, None, None


def q2_linear(x: torch.Tensor, q: Q2Weight) -> torch.Tensor:
    """``x @ dequant(W)^T`` with autograd to ``x`` (the frozen base of a LoRA projection)."""
    return _Q2Linear.apply(x, q.codes, q.scale, q.zero, (q.shape, q.group_size, q.dtype))


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py, e.g. for sm_75)
# --------------------------------------------------------------------------------------------------


def _aot_specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """fp16 (sm_75+) and bf16 (sm_80+: sm_75 has no bf16 tl.dot) forward and input gradient, G = 64."""
    specs = []
    bm, bn, bk, warps, stages = _config(DEFAULT_GROUP_SIZE)
    for ty in ("fp16", "bf16"):
        for kernel, a_name, stride in ((_q2_matmul_fwd_kernel, "x_ptr", "stride_xm"),
                                       (_q2_matmul_bwd_input_kernel, "dy_ptr", "stride_dym")):
            out_name = "y_ptr" if kernel is _q2_matmul_fwd_kernel else "dx_ptr"
            signature = {a_name: f"*{ty}", "codes_ptr": "*u8", "scale_ptr": "*fp16", "zero_ptr": "*fp16",
                         out_name: f"*{ty}", "M": "i32", "N": "i32", "K": "i32", stride: "i32"}
            constexprs = {"GROUP": DEFAULT_GROUP_SIZE, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "IEEE": False}
            options: dict[str, Any] = {"num_warps": warps, "num_stages": stages}
            if ty == "bf16":
                options["targets"] = [80, 86, 89, 90]
            specs.append((kernel, signature, constexprs, options))
    return specs


AOT_SPECS = _aot_specs()
