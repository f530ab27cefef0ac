r"""Multiply a tensor in place by a scalar that lives on the device, in fp32 arithmetic.

    x <- x * f        (every element: load, widen to fp32, multiply, round once to x's dtype)

Losses whose gradients are made in the forward pass (the cross-entropy ops) scale them by
``grad_output`` in the backward. Under fp16 training ``grad_output`` is the loss scaler's factor,
65536 at the start: cast to float16 first (what ``x.mul_(f)`` does when ``x`` is float16 and ``f`` a
0-dim CUDA tensor) it becomes ``inf``, and every gradient turns to inf or NaN. This op never rounds
``f`` to ``x``'s dtype, reads ``f`` on the device (no host sync, so it can sit in a captured graph)
and writes in place (no temporary).

CUDA tensors run the Triton kernel; CPU tensors run the plain-PyTorch reference (widen, multiply,
round back), or the kernel under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from notebookkit.kernels.runtime import should_use_triton

__all__ = ["scale_in_place", "scale_in_place_reference", "AOT_SPECS"]

_BLOCK = 4096


@triton.jit
def _scale_in_place_kernel(
    x_ptr,  # [n] contiguous fp32 / fp16 / bf16, overwritten
    factor_ptr,  # [] fp32 factor on the device
    n_elements,
    BLOCK: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n_elements
    factor = tl.load(factor_ptr)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + offs, (x * factor).to(x_ptr.dtype.element_ty), mask=mask)


def scale_in_place_reference(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``x = x * factor`` with fp32 products, rounded once to ``x``'s dtype (plain PyTorch)."""
    x.copy_(x.to(torch.float32) * factor.to(device=x.device, dtype=torch.float32))
    return x


def scale_in_place(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Multiply ``x`` in place by the 0-dim (or one-element) tensor ``factor``, in fp32; returns ``x``.

    ``x`` must be contiguous (the gradient buffers this serves are). ``factor`` stays on the device:
    nothing is read on the host.
    """
    if factor.numel() != 1:
        raise ValueError(f"scale_in_place takes a one-element factor, got shape {tuple(factor.shape)}.")
    if x.numel() == 0:
        return x
    if not x.is_contiguous():
        raise ValueError("scale_in_place needs a contiguous tensor (it walks the storage as one flat array).")
    if not should_use_triton(x):
        return scale_in_place_reference(x, factor)
    f32 = factor.reshape(()).to(device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(x.numel(), _BLOCK),)
    _scale_in_place_kernel[grid](x, f32, x.numel(), BLOCK=_BLOCK, num_warps=8)
    return x


AOT_SPECS = [
    (_scale_in_place_kernel, {"x_ptr": f"*{dtype}", "factor_ptr": "*fp32", "n_elements": "i64"},
     {"BLOCK": _BLOCK}, {"num_warps": 8})
    for dtype in ("fp16", "bf16", "fp32")
]
