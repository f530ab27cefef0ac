"""The gated activation of a decode row and the down projection's rank-space product of its output, in one launch
(the batch-1 decode step's ``h = act(e) * g; U = h A^T``), forward only.

Math, for one row (``e``, ``g`` of length ``I``: the gate and up projections' outputs; ``A [R, I]`` the down
projection's LoRA ``A``; ``c`` the row's dtype)::

    h[k] = round_c( act(fp32(e[k])) fp32(g[k]) )     act: SiLU (SwiGLU), GELU exact or tanh (GeGLU)
    U[j] = round_c( sum_k fp32(h[k]) fp32(A[j, k]) )  fp32 sum of the *rounded* h, one rounding

``h`` is :func:`~notebookkit.kernels.swiglu.swiglu`'s / :func:`~notebookkit.kernels.geglu.geglu`'s, bit for bit;
``U`` is :func:`~notebookkit.kernels.skinny_matmul.skinny_matmul` of ``h`` up to the order of the fp32 additions.

Why: at batch 1 the activation and the thin product ``h A^T`` were two tiny launches before the down
projection's matrix-vector kernel (#35: a decode step is made of launches, not of bytes). Here program ``j`` of
``R`` walks the row in tiles of ``BLOCK`` elements, computing ``h`` again (``2 I`` elements from L2) and summing
its ``U[j]``; program 0 also writes ``h``. Graph-safe: no host synchronisation, the outputs the only allocations.

Other inputs (more than one row, strided rows, ``A`` in another dtype, CPU tensors without the interpreter, under
autograd) run the activation kernel and the thin product: :func:`gated_low_rank_supported` says which.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from notebookkit.kernels.geglu import gelu_and_grad, geglu
from notebookkit.kernels.runtime import should_use_triton
from notebookkit.kernels.skinny_matmul import MAX_OUT, skinny_matmul
from notebookkit.kernels.swiglu import swiglu

__all__ = ["GATED_ACTIVATIONS", "gated_low_rank", "gated_low_rank_supported", "AOT_SPECS"]

#: the activations the kernel computes, and its ``ACT`` constexpr for each
GATED_ACTIVATIONS = {"swiglu": 0, "geglu": 1, "geglu_tanh": 2}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 2048  # elements of the row a program holds at once (three fp32 tiles: e, g, A's row)


@triton.jit
def _gated_low_rank_kernel(E, G, H, LA, U, n_cols, stride_la, ACT: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, n_cols, BLOCK):
        k = k0 + cols
        ok = k < n_cols
        e = tl.load(E + k, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(G + k, mask=ok, other=0.0).to(tl.float32)
        if ACT == 0:
            a = e * tl.sigmoid(e)
        else:
            a, _ = gelu_and_grad(e, ACT == 2)
        h = (a * g).to(H.dtype.element_ty)
        if j == 0:
            tl.store(H + k, h, mask=ok)
        la = tl.load(LA + j.to(tl.int64) * stride_la + k, mask=ok, other=0.0).to(tl.float32)
        acc += h.to(tl.float32) * la
    u = tl.sum(acc, axis=0)
    tl.store(U + j, u.to(U.dtype.element_ty))


def _activation(e: torch.Tensor, g: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "swiglu":
        return swiglu(e, g)
    return geglu(e, g, approximate="tanh" if activation == "geglu_tanh" else "none")


def gated_low_rank_supported(e: torch.Tensor, g: torch.Tensor, a: torch.Tensor, activation: str) -> bool:
    """Whether :func:`gated_low_rank` runs its kernel: one contiguous row (``e.numel() == I``) of fp16, bf16 or fp32
    on CUDA (or with Triton forced on under the interpreter), ``g`` of its shape, dtype and layout, ``A [R, I]``
    of its dtype (``R`` at most :data:`~notebookkit.kernels.skinny_matmul.MAX_OUT`, unit column stride), one
    device, an activation of :data:`GATED_ACTIVATIONS`, and no gradient asked for."""
    n = e.shape[-1] if e.dim() else 0
    if activation not in GATED_ACTIVATIONS or not n or e.numel() != n or g.shape != e.shape:
        return False
    if e.dtype not in _DTYPES or g.dtype != e.dtype or a.dtype != e.dtype or not e.device == g.device == a.device:
        return False
    if not (e.is_contiguous() and g.is_contiguous()):
        return False
    if a.dim() != 2 or a.shape[1] != n or not 0 < a.shape[0] <= MAX_OUT or a.stride(1) != 1:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (e, g, a)):
        return False
    return should_use_triton(e)


def gated_low_rank(e: torch.Tensor, g: torch.Tensor, a: torch.Tensor,
                   activation: str = "swiglu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, U)``: ``h = act(e) * g`` (``e``'s shape and dtype) and ``U = h A^T`` (``[rows, R]``), in one launch
    where :func:`gated_low_rank_supported`, else the activation kernel then
    :func:`~notebookkit.kernels.skinny_matmul.skinny_matmul` (the same function; module docstring).

    Args:
        e, g: the gate and up projections' outputs, ``[..., I]`` (one row for the kernel).
        a: ``[R, I]``, the down projection's LoRA ``A`` in the row's dtype.
        activation: ``"swiglu"``, ``"geglu"`` or ``"geglu_tanh"``.

    Safe inside CUDA graph capture once a call of the same shapes has run.
    """
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"gated_low_rank: unknown activation {activation!r}; choose one of {sorted(GATED_ACTIVATIONS)}.")
    if not gated_low_rank_supported(e, g, a, activation):
        h = _activation(e, g, activation)
        return h, skinny_matmul(h.reshape(-1, h.shape[-1]), a.to(h.dtype))
    n = e.shape[-1]
    r = a.shape[0]
    h = torch.empty_like(e)
    u = torch.empty((1, r), dtype=e.dtype, device=e.device)
    block = min(_BLOCK, triton.next_power_of_2(n))
    _gated_low_rank_kernel[(r,)](e, g, h, a, u, n, a.stride(0), ACT=GATED_ACTIVATIONS[activation], BLOCK=block,
                                 num_warps=4)
    return h, u


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py): (kernel, signature, constexprs, options)
# --------------------------------------------------------------------------------------------------
def _aot_specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """Each activation in fp16 for the T4 (sm_75) and sm_90, SwiGLU in bf16 for sm_90."""
    specs = []
    for ty, activation, targets in (("fp16", "swiglu", [75, 90]), ("fp16", "geglu", [75, 90]),
                                    ("fp16", "geglu_tanh", [75, 90]), ("bf16", "swiglu", [90])):
        signature = {"E": f"*{ty}", "G": f"*{ty}", "H": f"*{ty}", "LA": f"*{ty}", "U": f"*{ty}", "n_cols": "i32",
                     "stride_la": "i32"}
        specs.append((_gated_low_rank_kernel, signature, {"ACT": GATED_ACTIVATIONS[activation], "BLOCK": _BLOCK},
                      {"num_warps": 4, "targets": targets}))
    return specs


AOT_SPECS = _aot_specs()
