"""SwiGLU gate, ``h = silu(e) * g``, fused forward and backward.

``e`` is the gate projection output, ``g`` the up projection output (Llama, Mistral, Qwen MLPs:
``down_proj(silu(gate_proj(x)) * up_proj(x))``). Element-wise, in fp32, with ``s = sigmoid(e)``::

    a  = e * s                       silu(e)
    h  = a * g

    dg = dh * a
    de = dh * g * s * (1 + e * (1 - s))      since d silu / de = s + e * s * (1 - s)

The backward recomputes ``s`` and ``a`` from ``e`` (nothing but ``e`` and ``g`` is saved) and writes
its results into buffers that already exist:

* ``swiglu_backward_(dh, e, g)`` (for the LoRA MLP, which owns all three) overwrites
  ``dh`` with ``h``, ``e`` with ``de`` and ``g`` with ``dg``: zero allocations, and ``h`` comes back
  for the down projection's LoRA gradient without having been saved.
* ``swiglu(e, g)``'s autograd backward writes ``de``/``dg`` into new buffers by default, or into
  ``e``/``g`` themselves with ``inplace_backward=True``.

The launchers and the autograd function are shared with GeGLU
(:mod:`notebookkit.kernels.gated_activation`); this module holds the SwiGLU kernels and math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from notebookkit.kernels import gated_activation as gated
from notebookkit.kernels.runtime import should_use_triton

__all__ = ["swiglu", "swiglu_reference", "swiglu_backward_", "swiglu_forward", "swiglu_backward_launch"]


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _swiglu_fwd_kernel(E, G, H, n_elements, n_cols, stride_eg, EG_STRIDED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask, eg, e, g = gated.load_gate_inputs(E, G, offs, n_elements, n_cols, stride_eg, EG_STRIDED)
    h = e * tl.sigmoid(e) * g
    tl.store(H + offs, h.to(H.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DH, E, G, H_OUT, DE_OUT, DG_OUT, n_elements, n_cols, stride_eg,
                       STORE_H: tl.constexpr, EG_STRIDED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask, eg, e, g = gated.load_gate_inputs(E, G, offs, n_elements, n_cols, stride_eg, EG_STRIDED)
    dh = tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(e)
    a = e * s
    dg = dh * a
    de = dh * g * s * (1.0 + e * (1.0 - s))
    if STORE_H:
        tl.store(H_OUT + offs, (a * g).to(H_OUT.dtype.element_ty), mask=mask)
    tl.store(DE_OUT + eg, de.to(DE_OUT.dtype.element_ty), mask=mask)
    tl.store(DG_OUT + eg, dg.to(DG_OUT.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------
def swiglu_forward(e: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the forward kernel on ``e``, ``g`` (contiguous, or row slices with one row stride: see
    :mod:`notebookkit.kernels.gated_activation`); ``out`` (contiguous, any values) is overwritten."""
    return gated.launch_forward(_swiglu_fwd_kernel, e, g, out)


def swiglu_backward_launch(dh: torch.Tensor, e: torch.Tensor, g: torch.Tensor, h_out: torch.Tensor | None,
                           de_out: torch.Tensor, dg_out: torch.Tensor) -> None:
    """Launch the backward kernel on tensors of one shape (``dh``, ``h_out`` contiguous; ``e``, ``g`` and
    ``de_out``, ``dg_out`` contiguous or row slices with one row stride). Outputs may be any of the inputs
    (element ``i`` of every output is written after element ``i`` of every input is read);
    ``h_out=None`` skips recomputing ``h``."""
    gated.launch_backward(_swiglu_bwd_kernel, dh, e, g, h_out, de_out, dg_out)


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------
def swiglu_reference(e: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch ``silu(e) * g`` in fp32 (fp64 for fp64 inputs), cast back once: the CPU path and oracle."""
    acc = gated.accumulation_dtype(e)
    return (F.silu(e.to(acc)) * g.to(acc)).to(e.dtype)


def swiglu(e: torch.Tensor, g: torch.Tensor, inplace_backward: bool = False) -> torch.Tensor:
    """SwiGLU gate ``silu(e) * g`` with a fused backward.

    Args:
        e: gate projection output ``[..., I]`` (fp32, fp16 or bf16).
        g: up projection output, same shape and dtype as ``e``.
        inplace_backward: let the backward overwrite ``e`` with ``de`` and ``g`` with ``dg`` (no new
            allocation). Only when nothing else uses ``e``/``g`` after this op (e.g. they are fresh
            projection outputs); it also rules out a second backward through the same graph.

    Returns:
        ``h`` with ``e``'s shape and dtype.
    """
    gated.check_pair(e, g, "swiglu")
    if should_use_triton(e):
        return gated.GatedActivationFunction.apply(
            e, g, swiglu_forward, swiglu_backward_launch, bool(inplace_backward)
        )
    return swiglu_reference(e, g)


@torch.no_grad()
def swiglu_backward_(dh: torch.Tensor, e: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In-place SwiGLU backward for callers that own the buffers (the LoRA MLP).

    Overwrites ``dh`` with ``h = silu(e) * g``, ``e`` with ``de`` and ``g`` with ``dg``, and returns
    ``(h, de, dg)``, which are those same three tensors. All three have one shape and dtype; ``dh``
    is contiguous, ``e`` and ``g`` contiguous or row slices of row-major buffers with one row stride
    (e.g. the column blocks of one ``[N, 2I]`` gate/up product). Allocates nothing on the Triton path.
    """
    gated.check_inplace_trio(dh, e, g, "swiglu_backward_")
    if should_use_triton(e):
        swiglu_backward_launch(dh, e, g, dh, e, g)
    else:
        acc = gated.accumulation_dtype(e)
        ef, gf, dhf = e.to(acc), g.to(acc), dh.to(acc)  # the tensors themselves when already in acc
        s = torch.sigmoid(ef)
        a = ef * s  # silu(e)
        de = torch.sub(1.0, s).mul_(a).add_(s).mul_(dhf).mul_(gf)  # dh g silu'(e), silu' = s + a (1 - s)
        dg = dhf * a
        h = a.mul_(gf)  # read e, g and dh before any of them is overwritten
        dh.copy_(h)
        e.copy_(de)
        g.copy_(dg)
    return dh, e, g


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py): (kernel, signature, constexprs, options)
# --------------------------------------------------------------------------------------------------
def _aot_specs() -> list:
    def fwd(dt, strided=False):
        return (_swiglu_fwd_kernel, gated.aot_forward_signature(dt), {"EG_STRIDED": strided, "BLOCK": 1024},
                {"num_warps": 4})

    def bwd(dt, store_h, strided=False):
        return (_swiglu_bwd_kernel, gated.aot_backward_signature(dt),
                {"STORE_H": store_h, "EG_STRIDED": strided, "BLOCK": 1024}, {"num_warps": 4})

    # strided: e, g as column blocks of the LoRA MLP's grouped FP8 product
    return [fwd("bf16"), bwd("fp16", True), bwd("bf16", False), fwd("bf16", True), bwd("bf16", True, True)]


AOT_SPECS = _aot_specs()
