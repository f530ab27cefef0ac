"""Plumbing shared by the two gated activations, ``h = act(e) * g`` (SwiGLU and GeGLU).

Not an op of its own: the kernels and the math live in :mod:`notebookkit.kernels.swiglu` and
:mod:`notebookkit.kernels.geglu`. Both ops are element-wise over ``e`` and ``g`` (gate and up
projection outputs of one shape) and their kernels take the same arguments::

    forward kernel:   (E, G, H, n_elements, n_cols, stride_eg, <op constexprs>, EG_STRIDED, BLOCK)
    backward kernel:  (DH, E, G, H_OUT, DE_OUT, DG_OUT, n_elements, n_cols, stride_eg, <op constexprs>,
                       STORE_H, EG_STRIDED, BLOCK)

so one launcher pair, one input check and one ``torch.autograd.Function`` serve both.

Layouts: ``dh`` and ``h`` are contiguous. ``e`` and ``g`` are contiguous, or both row slices of
larger row-major buffers with one row stride ``ld`` (unit column stride), e.g. the gate and up
outputs of the LoRA MLP's grouped FP8 forward, column blocks ``[:, :I]`` and ``[:, I:]`` of one
``[N, 2I]`` product. Then element ``i`` (row ``i // I``, column ``i % I``) of ``e``/``g`` lives at
``i + (i // I) (ld - I)`` (``EG_STRIDED``; one integer division per element, in a memory-bound kernel),
and an in-place backward writes ``de``/``dg`` at those same places. The forward launcher copies
``e``/``g`` of any other layout to contiguous first.

The autograd function saves only ``e`` and ``g``; its backward recomputes ``act(e)`` in the op's
backward kernel and writes ``de`` / ``dg`` into new buffers, or over ``e`` / ``g`` themselves with
``inplace_backward=True``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from notebookkit.kernels.runtime import mark_written

__all__ = [
    "block_config",
    "check_pair",
    "check_inplace_trio",
    "eg_row_stride",
    "eg_offsets",
    "accumulation_dtype",
    "launch_forward",
    "launch_backward",
    "GatedActivationFunction",
    "aot_forward_signature",
    "aot_backward_signature",
]


def block_config(t: torch.Tensor) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for an element-wise kernel over ``t``.

    GPU: 1024 elements, 4 warps (8 per thread: 16-byte accesses in 16-bit dtypes). The CPU
    interpreter runs programs one by one, so it gets fewer, larger ones.
    """
    return (1024, 4) if t.is_cuda else (4096, 4)


def check_pair(e: torch.Tensor, g: torch.Tensor, op: str) -> None:
    """Raise unless ``e`` and ``g`` have one shape, dtype and device (``op`` names the caller)."""
    if e.shape != g.shape or e.dtype != g.dtype or e.device != g.device:
        raise ValueError(
            f"{op}: e and g must have the same shape, dtype and device; got {tuple(e.shape)} {e.dtype} "
            f"{e.device} and {tuple(g.shape)} {g.dtype} {g.device}."
        )


def eg_row_stride(e: torch.Tensor, g: torch.Tensor) -> int | None:
    """The row stride ``ld`` (in elements) of ``e`` and ``g`` seen as ``[rows, cols]`` matrices: ``cols``
    when both are contiguous; their common row stride when both are row slices of larger row-major
    buffers (unit last stride, equal strides, uniformly spaced rows, e.g. column blocks of one
    ``[N, 2I]`` tensor, or such a block viewed as ``[B, T, I]``); None for any other layout."""
    cols = e.shape[-1] if e.dim() else 1
    if e.is_contiguous() and g.is_contiguous():
        return cols
    if e.dim() < 2 or e.stride() != g.stride() or e.stride(-1) != 1:
        return None
    for i in range(e.dim() - 2):  # outer dimensions step over whole rows: [.., T, I] -> [rows, I]
        if e.shape[i] > 1 and e.stride(i) != e.shape[i + 1] * e.stride(i + 1):
            return None
    return e.stride(-2)


# Device-only helpers, compiled as part of the SwiGLU/GeGLU kernels that call them (tests/kernels/aot.py).
AOT_HELPERS = ["eg_offsets", "load_gate_inputs"]


@triton.jit
def eg_offsets(offs, n_cols, stride_eg, EG_STRIDED: tl.constexpr):
    """Offsets of elements ``offs`` (row-major numbering) in ``e``/``g``: themselves when contiguous,
    else ``offs + (offs // n_cols) * (stride_eg - n_cols)`` (rows ``stride_eg`` apart)."""
    if EG_STRIDED:
        return offs + (offs // n_cols) * (stride_eg - n_cols)
    return offs


@triton.jit
def load_gate_inputs(E, G, offs, n_elements, n_cols, stride_eg, EG_STRIDED: tl.constexpr):
    """``(mask, eg, e, g)`` of the elements ``offs``: the in-range mask, their offsets in ``e``/``g``
    (:func:`eg_offsets`) and both values in fp32 (0 out of range)."""
    mask = offs < n_elements
    eg = eg_offsets(offs, n_cols, stride_eg, EG_STRIDED)
    e = tl.load(E + eg, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + eg, mask=mask, other=0.0).to(tl.float32)
    return mask, eg, e, g


def check_inplace_trio(dh: torch.Tensor, e: torch.Tensor, g: torch.Tensor, op: str) -> None:
    """Raise unless ``dh``, ``e``, ``g`` match each other, ``dh`` is contiguous and ``e``, ``g`` are
    contiguous or row slices with one row stride (:func:`eg_row_stride`) (in-place backward)."""
    check_pair(e, g, op)
    check_pair(dh, e, op)
    if not dh.is_contiguous() or eg_row_stride(e, g) is None:
        raise ValueError(
            f"{op}: dh, e and g are overwritten in place: dh must be contiguous, e and g contiguous or row "
            "slices of row-major buffers with one row stride (unit last stride); call .contiguous() first."
        )


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs (the test oracle), fp32 for everything else: the torch paths' math dtype."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def launch_forward(
    kernel, e: torch.Tensor, g: torch.Tensor, out: Optional[torch.Tensor] = None, **constexprs
) -> torch.Tensor:
    """Run a forward ``kernel`` on ``e``, ``g`` (contiguous, or row slices with one row stride; any other
    layout is copied to contiguous first); ``out`` (contiguous, any values) is overwritten, or
    allocated when ``None``. ``constexprs`` are the op's own (e.g. ``APPROX_TANH``)."""
    ld = eg_row_stride(e, g)
    if ld is None:
        e, g = e.contiguous(), g.contiguous()
        ld = e.shape[-1] if e.dim() else 1
    if out is None:
        out = torch.empty(e.shape, dtype=e.dtype, device=e.device)
    n = e.numel()
    if n:
        cols = e.shape[-1] if e.dim() else 1
        block, warps = block_config(e)
        kernel[(triton.cdiv(n, block),)](e, g, out, n, cols, ld, **constexprs, EG_STRIDED=ld != cols,
                                         BLOCK=block, num_warps=warps)
    return out


def launch_backward(
    kernel,
    dh: torch.Tensor,
    e: torch.Tensor,
    g: torch.Tensor,
    h_out: Optional[torch.Tensor],
    de_out: torch.Tensor,
    dg_out: torch.Tensor,
    **constexprs,
) -> None:
    """Run a backward ``kernel`` on tensors of one shape: ``dh`` and ``h_out`` contiguous, ``e``, ``g``
    contiguous or row slices with one row stride, and ``de_out``/``dg_out`` laid out as ``e``/``g``
    (typically ``e`` and ``g`` themselves). Outputs may be any of the inputs (element ``i`` of every
    output is written after element ``i`` of every input is read); ``h_out=None`` skips recomputing ``h``."""
    ld = eg_row_stride(e, g)
    if ld is None or de_out.stride() != e.stride() or dg_out.stride() != g.stride():
        raise ValueError(
            "gated activation backward: e and g must be contiguous or row slices with one row stride, and "
            f"de_out/dg_out laid out as them; got strides {e.stride()}, {g.stride()}, {de_out.stride()}, "
            f"{dg_out.stride()}."
        )
    n = e.numel()
    if n:
        cols = e.shape[-1] if e.dim() else 1
        block, warps = block_config(e)
        kernel[(triton.cdiv(n, block),)](
            dh, e, g, h_out if h_out is not None else de_out, de_out, dg_out, n, cols, ld,
            **constexprs, STORE_H=h_out is not None, EG_STRIDED=ld != cols, BLOCK=block, num_warps=warps,
        )


class GatedActivationFunction(torch.autograd.Function):
    """Autograd function of a gated activation, given the op's two launchers.

    ``apply(e, g, forward, backward_launch, inplace_backward)`` with ``forward(e, g) -> h`` and
    ``backward_launch(dh, e, g, h_out, de_out, dg_out)`` (the op's launchers, its options bound).
    """

    @staticmethod
    def forward(ctx, e, g, forward: Callable, backward_launch: Callable, inplace_backward: bool):
        e = e.contiguous()
        g = g.contiguous()
        h = forward(e, g)
        ctx.save_for_backward(e, g)
        ctx.backward_launch = backward_launch
        ctx.inplace_backward = inplace_backward
        return h

    @staticmethod
    def backward(ctx, dh):
        e, g = ctx.saved_tensors
        dh_c = dh.contiguous()
        if ctx.inplace_backward:
            de, dg = e, g
        else:
            # a contiguous copy of dh made just above is ours to overwrite
            de = dh_c if dh_c is not dh and dh_c.dtype == e.dtype else torch.empty_like(e)
            dg = torch.empty_like(g)
        ctx.backward_launch(dh_c, e, g, None, de, dg)
        if ctx.inplace_backward:
            mark_written(e, g)
        de = de if ctx.needs_input_grad[0] else None
        dg = dg if ctx.needs_input_grad[1] else None
        return de, dg, None, None, None


def aot_forward_signature(dt: str) -> dict:
    """Runtime-argument types of a forward kernel for one Triton dtype (``"fp16"``, ``"bf16"``)."""
    return {"E": f"*{dt}", "G": f"*{dt}", "H": f"*{dt}", "n_elements": "i32", "n_cols": "i32", "stride_eg": "i32"}


def aot_backward_signature(dt: str) -> dict:
    """Runtime-argument types of a backward kernel for one Triton dtype."""
    return {"DH": f"*{dt}", "E": f"*{dt}", "G": f"*{dt}", "H_OUT": f"*{dt}", "DE_OUT": f"*{dt}",
            "DG_OUT": f"*{dt}", "n_elements": "i32", "n_cols": "i32", "stride_eg": "i32"}
