"""One row times 16-bit weights for batch-1 decoding: ``y_i = x W_i^T + b_i + s_i U_i B_i^T`` for the one to three
weights of a decode layer that read the same ``x`` (q/k/v; gate/up; o or down alone), in one launch.

Math (``x [1, K]``, ``W_i [N_i, K]`` in ``x``'s dtype ``c``: fp16, bf16 or fp32; ``U_i = X A_i^T [1, r_i]`` a LoRA
adapter's rank-space input, already computed; ``B_i [N_i, r_i]``), per output element::

    y_i[n] = c( sum_k fp32(W_i[n, k]) fp32(x[k])  +  fp32(b_i[n])  +  s_i sum_j fp32(B_i[n, j]) fp32(U_i[j]) )

one fp32 sum, rounded once. The training path's products (``notebookkit.kernels.lora_projection``) round the
base product to ``c`` before the adapter's ``addmm`` adds into it: the two agree to a rounding of ``c``.

Why a kernel of its own: at batch 1 a decode layer of a 16-bit base with LoRA on all seven projections made 18
GEMM launches through cuBLAS (seven base products, four rank-space products, seven ``addmm`` of ``U B^T``), each
reading a few MB at most: the step was a string of launches, not a read of the weights (the 1B bf16 decode step
ran at 8-23% of its bandwidth bound, #35). Here a group's base products, biases and adapter terms are one
launch (the rank-space products stay :mod:`~notebookkit.kernels.skinny_matmul`'s): 8 launches a layer instead
of 18, the same layout as the NF4 decode kernel's (:func:`notebookkit.kernels.nf4_matvec.nf4_matvec_group`).

Layout: a program owns ``BLOCK_N`` whole rows of one weight and walks along them ``BLOCK_K`` columns a step
(no split over ``K``: one launch, no workspace, the same result every run), multiplying into an fp32
accumulator of the tile's shape that is reduced once after the last step. The programs ``[0, first1)``
compute the first weight, ``[first1, first2)`` the second, the rest the third: which weight is one scalar test
of the program id. Graph-safe: no host synchronisation, the outputs the only allocations.

Under ``TRITON_INTERPRET=1`` the final cast to bf16 truncates where the GPU rounds to nearest even (triton
3.9): one more unit in the last place on the CPU, never on the GPU.

Other inputs (more than one row of ``x``, a weight in another dtype or with strided columns, CPU tensors without
the interpreter) are not taken: :func:`dense_matvec_supported` says so, and the caller runs its own products.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import triton
import triton.language as tl

from .runtime import should_use_triton, sm_count

__all__ = ["MAX_GROUP", "dense_matvec_group", "dense_matvec_reference", "dense_matvec_supported", "AOT_SPECS"]

MAX_GROUP = 3  # weights one launch takes (a decode layer's q/k/v)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# elements of one program's weight tile per step: 4 KiB of a 16-bit weight, 16 bytes a thread of 4 warps, twice
_TILE_ELEMENTS = 2048


@triton.jit
def _dense_rows(x_ptr, w_ptr, stride_w, bias_ptr, u_ptr, lora_b_ptr, y_ptr, first_row, N, K, rank, lora_scale,
                HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, RANK: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Rows ``first_row + [0, BLOCK_N)`` of one weight's ``y`` (module docstring): the products in an fp32 tile
    ``[BLOCK_N, BLOCK_K]`` summed after the last step, then the bias and ``s sum_j B[n, j] U[j]`` (a rank of 0 adds
    nothing), one rounding."""
    rows = first_row + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_at = w_ptr + rows.to(tl.int64)[:, None] * stride_w  # a weight may hold more than 2^31 elements
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        if EVEN_K:
            w = tl.load(row_at + k[None, :], mask=row_ok[:, None], other=0.0)
            x = tl.load(x_ptr + k)
        else:
            k_ok = k < K
            w = tl.load(row_at + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_LORA:
        js = tl.arange(0, RANK)
        j_ok = js < rank
        b = tl.load(lora_b_ptr + rows[:, None] * rank + js[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0.0)
        u = tl.load(u_ptr + js, mask=j_ok, other=0.0)
        y += lora_scale * tl.sum(b.to(tl.float32) * u.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _dense_matvec_group_kernel(
    x_ptr,  # [K], x's dtype, unit stride
    K,
    # weight 0, then 1 and 2 (SEGMENTS of them are read): W [N, K] rows stride_ apart, bias [N], U [rank] (unit
    # stride), B [N, rank] contiguous, y [N], the rows N, the rank (0: no adapter), the adapter's scaling
    w_0, stride_0, bias_0, u_0, lora_b_0, y_0, n_0, rank_0, scale_0,
    w_1, stride_1, bias_1, u_1, lora_b_1, y_1, n_1, rank_1, scale_1,
    w_2, stride_2, bias_2, u_2, lora_b_2, y_2, n_2, rank_2, scale_2,
    first1,  # the first program of weight 1: cdiv(n_0, BLOCK_N)
    first2,  # of weight 2: first1 + cdiv(n_1, BLOCK_N)
    SEGMENTS: tl.constexpr,  # 1, 2 or 3
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    RANK: tl.constexpr,  # next power of two of the largest rank (at least 1)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
):
    pid = tl.program_id(0)
    w, stride, bias, u, lora_b, y, n, rank, scale, first = (w_0, stride_0, bias_0, u_0, lora_b_0, y_0, n_0, rank_0,
                                                            scale_0, pid * 0)
    if SEGMENTS >= 2:
        if pid >= first1:
            w, stride, bias, u, lora_b, y, n, rank, scale, first = (w_1, stride_1, bias_1, u_1, lora_b_1, y_1, n_1,
                                                                    rank_1, scale_1, first1)
    if SEGMENTS == 3:
        if pid >= first2:
            w, stride, bias, u, lora_b, y, n, rank, scale, first = (w_2, stride_2, bias_2, u_2, lora_b_2, y_2, n_2,
                                                                    rank_2, scale_2, first2)
    _dense_rows(x_ptr, w, stride, bias, u, lora_b, y, (pid - first) * BLOCK_N, n, K, rank, scale, HAS_BIAS, HAS_LORA,
                RANK, BLOCK_N, BLOCK_K, EVEN_K)


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------


def _blocks(rows: int, k: int, sm_count: int) -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_K)`` for ``rows`` output rows over the launch: the most rows a program, up to 4, that
    still leave two programs an SM (the NF4 row kernel's rule), and steps of :data:`_TILE_ELEMENTS` a program
    (never longer than a row)."""
    block_n = 1
    while block_n < 4 and triton.cdiv(rows, block_n * 2) >= 2 * sm_count:
        block_n *= 2
    block_k = max(16, min(triton.next_power_of_2(k), _TILE_ELEMENTS // block_n))
    return block_n, block_k


def dense_matvec_supported(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`dense_matvec_group` runs its kernel: one row ``x [1, K]`` (unit column stride) of fp16,
    bf16 or fp32 on CUDA (or with Triton forced on under the interpreter), and one to :data:`MAX_GROUP` dense
    weights ``[N_i, K]`` of ``x``'s dtype on its device with unit column strides."""
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype not in _DTYPES or x.stride(1) != 1 or not should_use_triton(x):
        return False
    if not 1 <= len(weights) <= MAX_GROUP:
        return False
    k = x.shape[1]
    return all(isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] == k and w.shape[0] > 0
               and w.dtype == x.dtype and w.device == x.device and w.stride(1) == 1 for w in weights)


def dense_matvec_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                           lora: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None) -> torch.Tensor:
    """Plain PyTorch: ``x W^T + b + s U B^T`` in fp32, rounded once to ``x``'s dtype (the tests' oracle)."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    if lora is not None:
        u, lora_b, scaling = lora
        y = y + scaling * (u.float() @ lora_b.float().t())
    return y.to(x.dtype)


def _check_group(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
                 loras: Sequence[Any]) -> None:
    if not dense_matvec_supported(x, weights):
        raise ValueError(
            f"dense_matvec_group takes one row x [1, K] (got {tuple(x.shape)}, {x.dtype}) and 1 to {MAX_GROUP} "
            "weights [N, K] of its dtype and device with unit column strides, on CUDA or under TRITON_INTERPRET=1 "
            "with Triton forced on: check dense_matvec_supported first."
        )
    if len(biases) != len(weights) or len(loras) != len(weights):
        raise ValueError(f"dense_matvec_group: {len(weights)} weights need as many biases and LoRA terms (None for "
                         f"none), got {len(biases)} and {len(loras)}.")
    if len({b is None for b in biases}) > 1:
        raise ValueError("dense_matvec_group: give every weight of a launch a bias, or none of them.")
    for w, b, lora in zip(weights, biases, loras):
        if b is not None and (b.shape != (w.shape[0],) or b.dtype != x.dtype or b.device != x.device):
            raise ValueError(f"dense_matvec_group: a bias must be [{w.shape[0]}] in {x.dtype} on {x.device}, "
                             f"got {tuple(b.shape)} {b.dtype}.")
        if lora is not None:
            u, lora_b, _ = lora
            r = lora_b.shape[-1]
            if (u.shape != (1, r) or lora_b.shape != (w.shape[0], r) or u.dtype != x.dtype
                    or lora_b.dtype != x.dtype or u.stride(1) != 1):
                raise ValueError(f"dense_matvec_group: a LoRA term is U [1, r] and B [{w.shape[0]}, r] in "
                                 f"{x.dtype}, got U {tuple(u.shape)} {u.dtype} and B {tuple(lora_b.shape)} "
                                 f"{lora_b.dtype}.")


def dense_matvec_group(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
                       loras: Sequence[Optional[tuple[torch.Tensor, torch.Tensor, float]]]) -> list[torch.Tensor]:
    """``[x W_i^T + b_i + s_i U_i B_i^T]`` (each ``[1, N_i]``, ``x``'s dtype) for one row ``x [1, K]`` and one to
    three dense weights that read it, in one launch (module docstring).

    Args:
        x: ``[1, K]``, fp16 / bf16 / fp32, unit column stride.
        weights: ``[N_i, K]`` each, in ``x``'s dtype, unit column strides.
        biases: one per weight, ``[N_i]`` or ``None``: all given or none.
        loras: one per weight, ``None`` or ``(U [1, r_i], B [N_i, r_i], s_i)`` in ``x``'s dtype.

    Raises ``ValueError`` for inputs :func:`dense_matvec_supported` refuses (call it first) or operands of the
    wrong shapes. Safe inside CUDA graph capture once a call of the same shapes has run.
    """
    _check_group(x, weights, biases, loras)
    k = x.shape[1]
    rows = sum(int(w.shape[0]) for w in weights)
    block_n, block_k = _blocks(rows, k, sm_count(x.device))
    has_bias = biases[0] is not None
    has_lora = any(lora is not None for lora in loras)
    rank = max((int(lora[1].shape[1]) for lora in loras if lora is not None), default=0)
    outs, operands, firsts, at = [], [], [], 0
    for w, b, lora in zip(weights, biases, loras):
        n = int(w.shape[0])
        y = torch.empty((1, n), dtype=x.dtype, device=x.device)
        if lora is not None:
            u, lora_b, scaling = lora
            lora_b = lora_b.contiguous()
            operands += [w, w.stride(0), b if has_bias else y, u, lora_b, y, n, int(lora_b.shape[1]), float(scaling)]
        else:
            operands += [w, w.stride(0), b if has_bias else y, y, y, y, n, 0, 0.0]
        outs.append(y)
        firsts.append(at)
        at += triton.cdiv(n, block_n)
    segments = len(weights)
    while len(operands) < 9 * MAX_GROUP:  # the unused weights' operands: never read (SEGMENTS)
        operands += operands[:9]
    firsts += [at] * (MAX_GROUP - len(firsts))
    _dense_matvec_group_kernel[(at,)](
        x, k, *operands, firsts[1], firsts[2],
        SEGMENTS=segments, HAS_BIAS=has_bias, HAS_LORA=has_lora, RANK=max(1, triton.next_power_of_2(rank)),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=4,
    )
    return outs


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py): (kernel, signature, constexprs, options)
# --------------------------------------------------------------------------------------------------


def _aot_specs() -> list:
    """The Llama-3.2-1B decode groups (q/k/v at K = 2048 with LoRA and no bias; down alone at K = 8192 with a
    bias, to cover both branches), fp16 (the T4) and bf16 (sm_80 and newer)."""
    specs = []
    for ty in ("fp16", "bf16"):
        p = f"*{ty}"
        weight = {"w": p, "stride": "i32", "bias": p, "u": p, "lora_b": p, "y": p, "n": "i32", "rank": "i32",
                  "scale": "fp32"}
        signature = {"x_ptr": p, "K": "i32"}
        for i in range(MAX_GROUP):
            signature.update({f"{name}_{i}": kind for name, kind in weight.items()})
        signature.update({"first1": "i32", "first2": "i32"})
        for segments, k, bias, lora in ((3, 2048, False, True), (1, 8192, True, False)):
            block_n, block_k = _blocks(3072 if segments == 3 else 2048, k, 132)
            constexprs = {"SEGMENTS": segments, "HAS_BIAS": bias, "HAS_LORA": lora, "RANK": 16, "BLOCK_N": block_n,
                          "BLOCK_K": block_k, "EVEN_K": True}
            options: dict[str, Any] = {"num_warps": 4}
            if ty == "bf16":
                options["targets"] = [80, 86, 89, 90]
            specs.append((_dense_matvec_group_kernel, signature, constexprs, options))
    return specs


AOT_SPECS = _aot_specs()
