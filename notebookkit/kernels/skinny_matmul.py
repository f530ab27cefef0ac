"""A product of a few rows with a short, wide matrix: ``u = x @ a^T`` for ``x [M, K]`` (M <= 16, the decode
batch) and ``a [R, K]`` (R <= 256: a LoRA group's ``A_cat``, ``n`` adapters of rank ``r`` stacked), in one
launch that costs what its bytes cost.

Math, per output element (``c`` the dtype of ``x`` and ``a``)::

    u[m, j] = c( sum_k fp32(x[m, k]) * fp32(a[j, k]) )        fp32 accumulation, one rounding

Why not cuBLAS: the decode step runs four of these a layer (q/k/v, o, gate/up, down), a few hundred a step
for an 8B model, and cuBLAS's GEMV for ``[1, 4096] @ [4096, 48]`` took about 5.5 us on an H200 (session
24's profile of the 8B decode step: 1.0 ms of GEMM time, 0.3 ms of it the LM head) for 0.4 MB: a handful of
its blocks walk all of ``K``. Here a program owns ``BLOCK_R`` rows of ``a`` (one) and walks ``K`` in steps of
``BLOCK_K`` (all of it at once for ``K = 4096``, ``M = 1``): ``R / BLOCK_R`` programs each read ``BLOCK_R K``
elements of ``a`` and the ``M K`` of ``x`` (from L2 after the first program), multiply them elementwise into an
fp32 accumulator ``[BLOCK_M, BLOCK_R, BLOCK_K]`` and reduce over ``k`` once at the end. No ``tl.dot`` (``M`` is 1 in a batch-1 decode step, and the
tensor cores gain nothing on a product this thin), no split over ``K`` (deterministic, no workspace). Graph
safe: no host synchronisation, the output its only allocation.

Other shapes (more rows, a longer ``a``, CPU tensors, other dtypes) run ``x @ a.t()``, the same function up to
the order of the fp32 additions.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .runtime import should_use_triton

__all__ = ["skinny_matmul", "skinny_matmul_reference", "skinny_matmul_supported", "MAX_ROWS", "MAX_OUT", "AOT_SPECS"]

MAX_ROWS = 16  # rows of x the kernel takes (the decode batch)
MAX_OUT = 256  # rows of a (outputs per row of x)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _skinny_matmul_kernel(
    x_ptr,  # [M, K], rows stride_x apart, unit column stride
    a_ptr,  # [R, K], rows stride_a apart, unit column stride
    u_ptr,  # [M, R] contiguous, x's dtype
    M, R, K, stride_x, stride_a,
    BLOCK_M: tl.constexpr,  # next power of two >= M
    BLOCK_R: tl.constexpr,  # rows of a per program
    BLOCK_K: tl.constexpr,  # elements of K per step
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
):
    js = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ms = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    j_ok = js < R
    m_ok = ms < M
    acc = tl.zeros((BLOCK_M, BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        if EVEN_K:
            a_mask = j_ok[:, None]
            x_mask = m_ok[:, None]
        else:
            a_mask = j_ok[:, None] & (k < K)[None, :]
            x_mask = m_ok[:, None] & (k < K)[None, :]
        a = tl.load(a_ptr + js[:, None] * stride_a + k[None, :], mask=a_mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + ms[:, None] * stride_x + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
        acc += x[:, None, :] * a[None, :, :]
    u = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_R]
    tl.store(u_ptr + ms[:, None] * R + js[None, :], u.to(u_ptr.dtype.element_ty), mask=m_ok[:, None] & j_ok[None, :])


def skinny_matmul_reference(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: ``x @ a^T`` in fp32, rounded once to ``x``'s dtype (the tests' oracle)."""
    return (x.float() @ a.float().t()).to(x.dtype)


def skinny_matmul_supported(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether :func:`skinny_matmul` runs its kernel: a CUDA tensor (or Triton forced on under the interpreter)
    ``x [M, K]`` with ``M <= MAX_ROWS`` and ``a [R, K]`` with ``R <= MAX_OUT``, both of one 16- or 32-bit float
    dtype on one device, unit column strides."""
    return (x.dim() == 2 and a.dim() == 2 and x.shape[1] == a.shape[1] and 0 < x.shape[0] <= MAX_ROWS
            and 0 < a.shape[0] <= MAX_OUT and x.dtype in _DTYPES and a.dtype == x.dtype and a.device == x.device
            and x.stride(1) == 1 and a.stride(1) == 1 and should_use_triton(x))


def _blocks(m: int, r: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_R, BLOCK_K, warps): one row of ``a`` a program (48 programs for the ``A_cat`` of three
    rank-16 adapters) and steps as long as an accumulator of 8K elements allows (the whole row of 4096 at
    ``M = 1``): the kernel is one round trip to memory, not a loop of dependent ones."""
    block_m = triton.next_power_of_2(m)
    block_k = max(16, min(triton.next_power_of_2(k), 8192 // block_m))
    return block_m, 1, block_k, 4


def skinny_matmul(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``x @ a^T`` (``[M, R]``, ``x``'s dtype) for a few rows ``x [M, K]`` and a short matrix ``a [R, K]``.

    The kernel (module docstring) where :func:`skinny_matmul_supported`, else ``x @ a.t()``. Safe inside
    CUDA graph capture once a call of the same shapes has run.
    """
    if not skinny_matmul_supported(x, a):
        return x @ a.t()
    m, k = x.shape
    r = a.shape[0]
    u = torch.empty((m, r), dtype=x.dtype, device=x.device)
    block_m, block_r, block_k, warps = _blocks(m, r, k)
    _skinny_matmul_kernel[(triton.cdiv(r, block_r),)](
        x, a, u, m, r, k, x.stride(0), a.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps,
    )
    return u


def _aot_specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """The Llama-3.1-8B decode shapes (K = 4096 and 14336, M = 1 and 8), fp16 (the T4) and bf16 (sm_80+)."""
    specs = []
    for ty in ("fp16", "bf16"):
        for m, k in ((1, 4096), (8, 14336)):
            block_m, block_r, block_k, warps = _blocks(m, 48, k)
            signature = {"x_ptr": f"*{ty}", "a_ptr": f"*{ty}", "u_ptr": f"*{ty}", "M": "i32", "R": "i32", "K": "i32",
                         "stride_x": "i32", "stride_a": "i32"}
            constexprs = {"BLOCK_M": block_m, "BLOCK_R": block_r, "BLOCK_K": block_k, "EVEN_K": k % block_k == 0}
            options: dict[str, Any] = {"num_warps": warps}
            if ty == "bf16":
                options["targets"] = [80, 86, 89, 90]
            specs.append((_skinny_matmul_kernel, signature, constexprs, options))
    return specs


AOT_SPECS = _aot_specs()
