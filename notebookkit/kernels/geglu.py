"""GeGLU gate, ``h = gelu(e) * g``, exact (erf) or tanh-approximated, fused forward and backward.

``e`` is the gate projection output, ``g`` the up projection output (Gemma MLPs use the tanh form,
``gelu_pytorch_tanh``). Element-wise, in fp32::

    exact:  a = e * P(e),   P(e) = (1 + erf(e / sqrt(2))) / 2
            da/de = P(e) + e * exp(-e**2 / 2) / sqrt(2 * pi)
    tanh:   u = sqrt(2 / pi) * (e + 0.044715 * e**3),  t = tanh(u)
            a = e * (1 + t) / 2
            da/de = (1 + t) / 2 + e * (1 - t**2) / 2 * sqrt(2 / pi) * (1 + 3 * 0.044715 * e**2)

    h  = a * g
    dg = dh * a
    de = dh * g * da/de

``tanh`` is computed as ``2 * sigmoid(2u) - 1`` with ``u`` clamped to ``[-15, 15]`` (portable across
Triton versions, exact to fp32 rounding). The backward
recomputes ``a`` from ``e``; buffers as in :mod:`notebookkit.kernels.swiglu`:

* ``geglu_backward_(dh, e, g, approximate)`` overwrites ``dh`` with ``h``, ``e`` with ``de`` and
  ``g`` with ``dg`` (zero allocations; for the LoRA MLP).
* ``geglu(e, g)``'s autograd backward writes new buffers, or ``e``/``g`` with ``inplace_backward=True``.

The launchers and the autograd function are shared with SwiGLU
(:mod:`notebookkit.kernels.gated_activation`); this module holds the GeGLU kernels and math.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from notebookkit.kernels import gated_activation as gated
from notebookkit.kernels.runtime import should_use_triton

__all__ = ["geglu", "geglu_reference", "geglu_backward_", "geglu_forward", "geglu_backward_launch", "gelu_and_grad"]

_APPROX = {"none": 0, "tanh": 1}


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def gelu_and_grad(e, APPROX_TANH: tl.constexpr):
    """(gelu(e), d gelu / de) in fp32 (a device function, also compiled into :mod:`.gated_low_rank`'s kernel)."""
    if APPROX_TANH:
        k0 = 0.7978845608028654  # sqrt(2 / pi)
        k1 = 0.044715
        u = k0 * (e + k1 * e * e * e)
        u = tl.minimum(tl.maximum(u, -15.0), 15.0)  # tanh(+-15) == +-1 in fp32; keeps exp finite
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
        a = 0.5 * e * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * e * (1.0 - t * t) * k0 * (1.0 + 3.0 * k1 * e * e)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(e * 0.7071067811865476))
        a = e * cdf
        da = cdf + e * tl.exp(-0.5 * e * e) * 0.3989422804014327
    return a, da


@triton.jit
def _geglu_fwd_kernel(E, G, H, n_elements, n_cols, stride_eg, APPROX_TANH: tl.constexpr,
                      EG_STRIDED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask, eg, e, g = gated.load_gate_inputs(E, G, offs, n_elements, n_cols, stride_eg, EG_STRIDED)
    a, _ = gelu_and_grad(e, APPROX_TANH)
    tl.store(H + offs, (a * g).to(H.dtype.element_ty), mask=mask)


@triton.jit
def _geglu_bwd_kernel(
    DH, E, G, H_OUT, DE_OUT, DG_OUT, n_elements, n_cols, stride_eg,
    APPROX_TANH: tl.constexpr, STORE_H: tl.constexpr, EG_STRIDED: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask, eg, e, g = gated.load_gate_inputs(E, G, offs, n_elements, n_cols, stride_eg, EG_STRIDED)
    dh = tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
    a, da = gelu_and_grad(e, APPROX_TANH)
    if STORE_H:
        tl.store(H_OUT + offs, (a * g).to(H_OUT.dtype.element_ty), mask=mask)
    tl.store(DE_OUT + eg, (dh * g * da).to(DE_OUT.dtype.element_ty), mask=mask)
    tl.store(DG_OUT + eg, (dh * a).to(DG_OUT.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------
def _approx_flag(approximate: str) -> int:
    if approximate not in _APPROX:
        raise ValueError(f"geglu: approximate must be 'none' (exact erf) or 'tanh', got {approximate!r}.")
    return _APPROX[approximate]


def geglu_forward(
    e: torch.Tensor, g: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None
) -> torch.Tensor:
    """Launch the forward kernel on ``e``, ``g`` (contiguous, or row slices with one row stride: see
    :mod:`notebookkit.kernels.gated_activation`); ``out`` (contiguous, any values) is overwritten."""
    return gated.launch_forward(_geglu_fwd_kernel, e, g, out, APPROX_TANH=_approx_flag(approximate))


def geglu_backward_launch(dh: torch.Tensor, e: torch.Tensor, g: torch.Tensor, h_out: torch.Tensor | None,
                          de_out: torch.Tensor, dg_out: torch.Tensor, approximate: str = "none") -> None:
    """Launch the backward kernel on tensors of one shape (``dh``, ``h_out`` contiguous; ``e``, ``g`` and
    ``de_out``, ``dg_out`` contiguous or row slices with one row stride); outputs may be any of the
    inputs (element-wise read-then-write). ``h_out=None`` skips recomputing ``h``."""
    gated.launch_backward(_geglu_bwd_kernel, dh, e, g, h_out, de_out, dg_out, APPROX_TANH=_approx_flag(approximate))


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------
def geglu_reference(e: torch.Tensor, g: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Plain-PyTorch ``gelu(e) * g`` in fp32 (fp64 for fp64 inputs), cast back once: the CPU path and oracle."""
    _approx_flag(approximate)
    acc = gated.accumulation_dtype(e)
    return (F.gelu(e.to(acc), approximate=approximate) * g.to(acc)).to(e.dtype)


def geglu(e: torch.Tensor, g: torch.Tensor, approximate: str = "none", inplace_backward: bool = False) -> torch.Tensor:
    """GeGLU gate ``gelu(e) * g`` with a fused backward.

    Args:
        e: gate projection output ``[..., I]`` (fp32, fp16 or bf16).
        g: up projection output, same shape and dtype as ``e``.
        approximate: ``"none"`` for the exact erf GELU, ``"tanh"`` for the tanh approximation
            (Gemma's ``gelu_pytorch_tanh``), as in ``torch.nn.functional.gelu``.
        inplace_backward: let the backward overwrite ``e`` with ``de`` and ``g`` with ``dg`` (no new
            allocation). Only when nothing else uses ``e``/``g`` after this op.

    Returns:
        ``h`` with ``e``'s shape and dtype.
    """
    gated.check_pair(e, g, "geglu")
    _approx_flag(approximate)
    if should_use_triton(e):
        forward = functools.partial(geglu_forward, approximate=approximate)
        backward_launch = functools.partial(geglu_backward_launch, approximate=approximate)
        return gated.GatedActivationFunction.apply(e, g, forward, backward_launch, bool(inplace_backward))
    return geglu_reference(e, g, approximate)


@torch.no_grad()
def geglu_backward_(
    dh: torch.Tensor, e: torch.Tensor, g: torch.Tensor, approximate: str = "none"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In-place GeGLU backward for callers that own the buffers (the LoRA MLP).

    Overwrites ``dh`` with ``h = gelu(e) * g``, ``e`` with ``de`` and ``g`` with ``dg``, and returns
    ``(h, de, dg)``, which are those same three tensors. All three have one shape and dtype; ``dh``
    is contiguous, ``e`` and ``g`` contiguous or row slices of row-major buffers with one row stride
    (e.g. the column blocks of one ``[N, 2I]`` gate/up product). Allocates nothing on the Triton path.
    """
    gated.check_inplace_trio(dh, e, g, "geglu_backward_")
    _approx_flag(approximate)
    if should_use_triton(e):
        geglu_backward_launch(dh, e, g, dh, e, g, approximate)
    else:
        acc = gated.accumulation_dtype(e)
        ef, gf, dhf = e.to(acc, copy=True), g.to(acc, copy=True), dh.to(acc, copy=True)
        if approximate == "tanh":
            k0, k1 = 0.7978845608028654, 0.044715
            t = torch.tanh(k0 * (ef + k1 * ef**3))
            a = 0.5 * ef * (1.0 + t)
            da = 0.5 * (1.0 + t) + 0.5 * ef * (1.0 - t * t) * k0 * (1.0 + 3.0 * k1 * ef * ef)
        else:
            cdf = 0.5 * (1.0 + torch.erf(ef * 0.7071067811865476))
            a = ef * cdf
            da = cdf + ef * torch.exp(-0.5 * ef * ef) * 0.3989422804014327
        dh.copy_(a * gf)
        e.copy_(dhf * gf * da)
        g.copy_(dhf * a)
    return dh, e, g


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py): (kernel, signature, constexprs, options)
# --------------------------------------------------------------------------------------------------
def _aot_specs() -> list:
    def fwd(dt, approx, strided=False):
        return (_geglu_fwd_kernel, gated.aot_forward_signature(dt),
                {"APPROX_TANH": approx, "EG_STRIDED": strided, "BLOCK": 1024}, {"num_warps": 4})

    def bwd(dt, approx, store_h, strided=False):
        return (_geglu_bwd_kernel, gated.aot_backward_signature(dt),
                {"APPROX_TANH": approx, "STORE_H": store_h, "EG_STRIDED": strided, "BLOCK": 1024}, {"num_warps": 4})

    # strided: e, g as column blocks of the LoRA MLP's grouped FP8 product
    return [fwd("fp16", 0), fwd("bf16", 1), bwd("fp16", 1, True), bwd("bf16", 0, False),
            fwd("bf16", 1, True), bwd("bf16", 1, True, True)]


AOT_SPECS = _aot_specs()
