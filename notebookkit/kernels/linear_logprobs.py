r"""Per-token log-probabilities of the labels, straight from hidden states and the LM head, without
ever holding the ``[N, V]`` logits. The building block of DPO, ORPO and GRPO (which need one
log-probability per token, not a scalar loss).

For row :math:`t` (a token position): hidden state :math:`h_t \in \mathbb{R}^H`, LM head
:math:`W \in \mathbb{R}^{V \times H}`, optional bias :math:`b`, label :math:`y_t`, logit scale
:math:`s`, final-logit soft-cap :math:`c` (Gemma-2) and sampling temperature :math:`T` (GRPO)::

    x_t    = W h_t + b
    z_t    = c * tanh(s * x_t / c) / T          (z_t = s * x_t / T without soft-capping)
    lse_t  = log sum_j exp(z_tj)
    logp_t = z_t[y_t] - lse_t                   (0 where y_t == ignore_index)

Backward. With the upstream gradient :math:`g_t = \partial L / \partial \mathrm{logp}_t` and the
softmax :math:`p_t = \exp(z_t - \mathrm{lse}_t)`::

    d logp_t / d z_t  = e_{y_t} - p_t
    d z_tj / d x_tj   = (s / T) * (1 - tanh^2(s x_tj / c)) = (s / T) * (1 - (T z_tj / c)^2)
    G_t               = g_t * (e_{y_t} - p_t) * dz_t/dx_t          (a [V] row; 0 for ignored rows)

    dL/dh_t = G_t W        dL/dW = sum_t G_t^T h_t        dL/db = sum_t G_t

that is, ``d logp_t / d h_t = (e_label - softmax(z_t)) W`` scaled by the upstream gradient (and by
the soft-cap and temperature factors), and the same for ``W``.

The temperature folds into the soft-cap: ``c tanh(s x / c) / T = c' tanh(s' x / c')`` with
``c' = c / T`` and ``s' = s / T``, so the kernels see one scale and one cap.

How it runs. The rows go in chunks of ``C``. Forward, per chunk: one GEMM makes the ``[C, V]``
logits (in the compute dtype: autocast's, else the weight's), and a fold (a Triton kernel on CUDA,
torch ops on CPU; both fp32 math) turns them into ``logp`` and ``lse`` per row (and, on request,
the entropy ``lse - sum_j p_j z_j``, returned without gradient). Only ``lse`` (``[N]`` fp32) is kept
for backward, with the inputs. Backward, per chunk: the same GEMM recomputes the logits, a second
fold overwrites them with ``G`` (one sweep, thanks to the saved ``lse``), and two GEMMs give the
chunk's rows of ``dL/dh`` and add ``G^T h`` to an fp32 ``dL/dW`` accumulator (only when the weight
requires grad; likewise the bias). One ``[C, V]`` buffer exists at a time (the CPU fold adds two
fp32 ``[C, V]`` temporaries).

Unlike :mod:`notebookkit.kernels.fused_linear_cross_entropy`, the gradient cannot be made in the
forward: it depends on the per-row upstream gradient, known only in backward (DPO and GRPO weigh
each token differently). ``G`` already carries the upstream gradient (the loss scaler's factor
included) when it is rounded to the compute dtype, so its magnitude is the one plain PyTorch gives
its logits gradient in fp16: no extra headroom is needed.

CPU tensors run the chunked torch fold (not a materialised reference: the op exists to bound
memory, CPU notebooks included); :func:`linear_logprobs_reference` (full logits, ``log_softmax`` +
``gather``) is the test oracle. Labels are already shifted (row ``t`` scores ``labels[t]``).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from notebookkit.kernels.cross_entropy import grad_through_softcap, row_logsumexp, softcapped_scores
from notebookkit.kernels.fused_linear_cross_entropy import (
    backprop_lm_head_chunk,
    check_lm_head_inputs,
    choose_chunk_size,
    lm_head_compute_dtype,
)
from notebookkit.kernels.runtime import should_use_triton

__all__ = [
    "linear_logprobs",
    "linear_logprobs_reference",
    "LinearLogprobsFunction",
    "AOT_SPECS",
]


# --------------------------------------------------------------------------------------------
# Triton kernels (one program per row in forward; per (row, vocabulary block) in backward)
# --------------------------------------------------------------------------------------------


@triton.jit
def _logprobs_forward_kernel(
    x_ptr,  # [C, V] logits of one chunk (fp32 / fp16 / bf16), unit stride along V
    x_row_stride,
    labels_ptr,  # [C] integer labels
    logp_ptr,  # [C] fp32 out: log-probability of the label
    lse_ptr,  # [C] fp32 out: log-sum-exp of z (kept for backward)
    entropy_ptr,  # [C] fp32 out (only with HAS_ENTROPY)
    n_cols,
    ignore_index,
    scale,  # s / T
    softcap,  # c / T
    HAS_SOFTCAP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    label = tl.load(labels_ptr + row).to(tl.int64)
    if label == ignore_index:
        tl.store(logp_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        if HAS_ENTROPY:
            tl.store(entropy_ptr + row, 0.0)
        return

    lse, s, t = row_logsumexp(x_row, n_cols, scale, softcap, HAS_SOFTCAP, HAS_ENTROPY, BLOCK_V)

    in_range = (label >= 0) & (label < n_cols)
    z_y = softcapped_scores(tl.load(x_row + label, mask=in_range, other=0.0), scale, softcap, HAS_SOFTCAP)
    tl.store(logp_ptr + row, z_y - lse)
    tl.store(lse_ptr + row, lse)
    if HAS_ENTROPY:
        tl.store(entropy_ptr + row, lse - t / s)


@triton.jit
def _logprobs_backward_kernel(
    x_ptr,  # [C, V] recomputed logits, overwritten with G = dL/dx
    x_row_stride,
    labels_ptr,  # [C]
    lse_ptr,  # [C] fp32 from the forward
    grad_ptr,  # [C] fp32 upstream gradient dL/dlogp
    n_cols,
    ignore_index,
    scale,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < n_cols
    x_row = x_ptr + row * x_row_stride
    label = tl.load(labels_ptr + row).to(tl.int64)
    if label == ignore_index:
        zeros = tl.zeros([BLOCK_V], dtype=tl.float32)
        tl.store(x_row + offs, zeros.to(x_ptr.dtype.element_ty), mask=mask)
        return
    lse = tl.load(lse_ptr + row)
    g = tl.load(grad_ptr + row)
    z = softcapped_scores(tl.load(x_row + offs, mask=mask, other=0.0), scale, softcap, HAS_SOFTCAP)
    p = tl.exp(z - lse)
    dz = grad_through_softcap(g * (tl.where(offs == label, 1.0, 0.0) - p), z, softcap, HAS_SOFTCAP)
    tl.store(x_row + offs, (dz * scale).to(x_ptr.dtype.element_ty), mask=mask)


_MAX_FORWARD_BLOCK = 8192
_BACKWARD_BLOCK = 4096


def _forward_config(n_cols: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(max(n_cols, 1)), _MAX_FORWARD_BLOCK)
    return block, min(max(block // 512, 4), 16)


def _backward_config(n_cols: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(max(n_cols, 1)), _BACKWARD_BLOCK)
    return block, min(max(block // 512, 4), 8)


# --------------------------------------------------------------------------------------------
# Folds: one chunk of logits -> logp / lse (forward), -> G in place (backward)
# --------------------------------------------------------------------------------------------


def _fold_forward_triton(logits, labels, logp, lse, entropy, ignore_index, scale, softcap) -> None:
    n_rows, n_cols = logits.shape
    block, num_warps = _forward_config(n_cols)
    _logprobs_forward_kernel[(n_rows,)](
        logits, logits.stride(0), labels, logp, lse, entropy if entropy is not None else lse,
        n_cols, int(ignore_index), float(scale), float(softcap) if softcap is not None else 1.0,
        HAS_SOFTCAP=softcap is not None, HAS_ENTROPY=entropy is not None, BLOCK_V=block, num_warps=num_warps,
    )


def _fold_backward_triton(logits, labels, lse, grad, ignore_index, scale, softcap) -> None:
    n_rows, n_cols = logits.shape
    block, num_warps = _backward_config(n_cols)
    _logprobs_backward_kernel[(n_rows, triton.cdiv(n_cols, block))](
        logits, logits.stride(0), labels, lse, grad,
        n_cols, int(ignore_index), float(scale), float(softcap) if softcap is not None else 1.0,
        HAS_SOFTCAP=softcap is not None, BLOCK_V=block, num_warps=num_warps,
    )


def _scores(logits: torch.Tensor, scale: float, softcap: Optional[float]) -> torch.Tensor:
    """``z = c' tanh(s' x / c')`` (or ``s' x``) in fp32, a new tensor."""
    z = logits.to(torch.float32) * scale
    if softcap is not None:
        z = torch.tanh(z.div_(softcap)).mul_(softcap)
    return z


def _fold_forward_torch(logits, labels, logp, lse, entropy, ignore_index, scale, softcap) -> None:
    z = _scores(logits, scale, softcap)
    valid = labels != ignore_index
    row_lse = torch.logsumexp(z, dim=-1)
    z_y = z.gather(1, torch.where(valid, labels, 0).long()[:, None]).squeeze(1)
    logp.copy_(torch.where(valid, z_y - row_lse, 0.0))
    lse.copy_(torch.where(valid, row_lse, 0.0))
    if entropy is not None:
        p = torch.softmax(z, dim=-1)
        entropy.copy_(torch.where(valid, row_lse - (p * z).sum(-1), 0.0))


def _fold_backward_torch(logits, labels, lse, grad, ignore_index, scale, softcap) -> None:
    z = _scores(logits, scale, softcap)
    valid = labels != ignore_index
    g = torch.where(valid, grad, 0.0).to(z.dtype)
    dz = (z - lse.to(z.dtype)[:, None]).exp_().mul_(-g[:, None])  # -g p
    rows = torch.arange(z.shape[0], device=z.device)
    dz[rows, torch.where(valid, labels, 0).long()] += g  # + g e_y
    if softcap is not None:
        dz.mul_(z.div_(softcap).square_().neg_().add_(1.0))
    dz.mul_(scale)
    dz.masked_fill_(~valid[:, None], 0.0)  # exp(z - 0) of an ignored row may be inf; inf * 0 is NaN
    logits.copy_(dz)


# --------------------------------------------------------------------------------------------
# autograd.Function
# --------------------------------------------------------------------------------------------


def _chunk_logits(buffer: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    out = buffer[: h.shape[0]]
    if bias is not None:
        torch.addmm(bias, h, weight.t(), out=out)
    else:
        torch.mm(h, weight.t(), out=out)
    return out


class LinearLogprobsFunction(torch.autograd.Function):
    """Chunked ``lm_head`` + log-softmax + gather; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,  # [N, H] in the compute dtype
        weight: torch.Tensor,  # [V, H] in the compute dtype
        bias: Optional[torch.Tensor],
        labels: torch.Tensor,  # [N]
        ignore_index: int,
        scale: float,  # s / T
        softcap: Optional[float],  # c / T
        chunk_size: int,
        triton_fold: bool,
        want_entropy: bool,
    ):
        ctx.set_materialize_grads(False)
        n_rows = hidden.shape[0]
        device = hidden.device
        logp = torch.empty(n_rows, dtype=torch.float32, device=device)
        lse = torch.empty(n_rows, dtype=torch.float32, device=device)
        entropy = torch.empty(n_rows, dtype=torch.float32, device=device) if want_entropy else None
        fold = _fold_forward_triton if triton_fold else _fold_forward_torch
        if n_rows:
            buffer = torch.empty((min(chunk_size, n_rows), weight.shape[0]), dtype=hidden.dtype, device=device)
            for start in range(0, n_rows, chunk_size):
                end = min(start + chunk_size, n_rows)
                lg = _chunk_logits(buffer, hidden[start:end], weight, bias)
                fold(lg, labels[start:end], logp[start:end], lse[start:end],
                     entropy[start:end] if entropy is not None else None, ignore_index, scale, softcap)
            del buffer
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.options = (ignore_index, scale, softcap, chunk_size, triton_fold)
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Optional[torch.Tensor], _grad_entropy: Optional[torch.Tensor]):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_logp is None or not (need_h or need_w or need_b):
            return (None,) * 10
        ignore_index, scale, softcap, chunk_size, triton_fold = ctx.options
        fold = _fold_backward_triton if triton_fold else _fold_backward_torch
        n_rows, n_hidden = hidden.shape
        device = hidden.device
        grad = grad_logp.to(torch.float32).contiguous()
        grad_hidden = torch.empty_like(hidden) if need_h else None
        # Weight and bias gradients accumulate over the chunks in fp32, whatever the compute dtype.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_w else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=device) if need_b else None
        if n_rows:
            buffer = torch.empty((min(chunk_size, n_rows), weight.shape[0]), dtype=hidden.dtype, device=device)
            for start in range(0, n_rows, chunk_size):
                end = min(start + chunk_size, n_rows)
                h = hidden[start:end]
                lg = _chunk_logits(buffer, h, weight, bias)
                fold(lg, labels[start:end], lse[start:end], grad[start:end], ignore_index, scale, softcap)
                backprop_lm_head_chunk(lg, h, weight, grad_hidden[start:end] if need_h else None, grad_weight, grad_bias)
            del buffer
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return (grad_hidden, grad_weight, grad_bias) + (None,) * 7


# --------------------------------------------------------------------------------------------
# Reference (test oracle: materialises the logits)
# --------------------------------------------------------------------------------------------


def linear_logprobs_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                              bias: Optional[torch.Tensor] = None, *, softcap: Optional[float] = None,
                              temperature: float = 1.0, logit_scale: float = 1.0, ignore_index: int = -100,
                              return_entropy: bool = False, compute_dtype: Optional[torch.dtype] = None):
    """Plain PyTorch: full logits, ``log_softmax``, ``gather`` (autograd differentiates it).

    The logits are made in ``compute_dtype`` (default: float32, float64 for float64 inputs) and the
    softmax runs in at least float32. Returns ``logp`` of ``labels.shape`` (0 where ignored), and the
    entropy too (detached) with ``return_entropy=True``. Materialises ``[N, V]``: for tests only.
    """
    if compute_dtype is None:
        compute_dtype = torch.promote_types(hidden.dtype, torch.float32)
    h = hidden.reshape(-1, hidden.shape[-1]).to(compute_dtype)
    x = h @ weight.to(compute_dtype).t()
    if bias is not None:
        x = x + bias.to(compute_dtype)
    z = x.to(torch.promote_types(compute_dtype, torch.float32)) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    y = labels.reshape(-1).to(z.device)
    valid = y != ignore_index
    logprobs = torch.log_softmax(z, dim=-1)
    logp = logprobs.gather(1, torch.where(valid, y, 0).long()[:, None]).squeeze(1)
    logp = torch.where(valid, logp, torch.zeros_like(logp)).reshape(labels.shape)
    if not return_entropy:
        return logp
    with torch.no_grad():
        entropy = -(logprobs.exp() * logprobs).sum(-1)
        entropy = torch.where(valid, entropy, torch.zeros_like(entropy)).reshape(labels.shape)
    return logp, entropy


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
    chunk_size: Optional[int] = None,
    return_entropy: bool = False,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Log-probability of each label under ``softmax(z)``, without materialising the logits, where
    ``z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature`` (math: module docstring).

    Args:
        hidden: ``[..., H]`` final hidden states (after the final norm), e.g. ``[B, T, H]``.
        weight: ``[V, H]`` LM-head weight (``lm_head.weight``); its gradient is computed (fp32
            accumulation, stored in its dtype) only when it requires grad.
        labels: ``[...]`` token ids, same leading shape as ``hidden``, **already shifted** (row ``t``
            scores ``labels[t]``). Rows equal to ``ignore_index`` give 0 and no gradient.
        bias: optional ``[V]`` LM-head bias.
        softcap: final-logit soft-cap ``c`` (Gemma-2's ``final_logit_softcapping``); ``None`` off.
        temperature: divide the (soft-capped) logits by this, as GRPO does with its sampling temperature.
        logit_scale: multiply the raw logits by this first (Cohere-style); 1 for the supported families.
        ignore_index: the label of positions that carry no log-probability (prompt, padding).
        chunk_size: rows per chunk; ``None`` picks one from free GPU memory and ``V / H``.
        return_entropy: also return the entropy of each row's distribution (no gradient through it).

    Returns:
        ``logp`` in float32 with the shape of ``labels`` (and ``entropy`` of the same shape with
        ``return_entropy=True``). CUDA tensors fold each chunk with Triton, CPU tensors with torch
        ops; both are chunked and differentiable (hidden, weight, bias).
    """
    check_lm_head_inputs(hidden, weight, labels, bias, softcap, chunk_size)
    if not temperature > 0:
        raise ValueError(f"temperature must be a positive number (the sampling temperature), got {temperature!r}.")
    vocab, n_hidden = weight.shape
    dtype = lm_head_compute_dtype("linear_logprobs", hidden, weight,
                                  hint=" For a float64 check use linear_logprobs_reference.")
    triton_fold = should_use_triton(hidden)
    n_rows = hidden.numel() // max(n_hidden, 1)
    h = hidden.reshape(n_rows, n_hidden).to(dtype)
    w = weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    y = labels.reshape(-1).to(h.device)
    if not y.is_contiguous():
        y = y.contiguous()
    if chunk_size is None:
        # The torch fold holds fp32 temporaries of the chunk: size the chunk for fp32 rows there.
        fold_dtype = dtype if triton_fold else torch.float32
        needs_w = torch.is_grad_enabled() and w.requires_grad
        chunk_size = choose_chunk_size(n_rows, vocab, n_hidden, fold_dtype, h.device, weight_grad=needs_w)
    chunk_size = max(1, min(int(chunk_size), max(n_rows, 1)))
    scale = float(logit_scale) / float(temperature)
    cap = float(softcap) / float(temperature) if softcap is not None else None
    with torch.autocast(h.device.type, enabled=False):
        logp, entropy = LinearLogprobsFunction.apply(
            h, w, b, y, int(ignore_index), scale, cap, chunk_size, triton_fold, bool(return_entropy)
        )
    logp = logp.view(labels.shape)
    if return_entropy:
        return logp, entropy.view(labels.shape)
    return logp


# --------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (T4 readiness, tests/kernels/aot.py), large-vocabulary configs
# --------------------------------------------------------------------------------------------


def _aot_forward_signature(dtype: str) -> dict[str, str]:
    return {
        "x_ptr": f"*{dtype}", "x_row_stride": "i64", "labels_ptr": "*i64", "logp_ptr": "*fp32",
        "lse_ptr": "*fp32", "entropy_ptr": "*fp32", "n_cols": "i32", "ignore_index": "i32",
        "scale": "fp32", "softcap": "fp32",
    }


def _aot_backward_signature(dtype: str) -> dict[str, str]:
    return {
        "x_ptr": f"*{dtype}", "x_row_stride": "i64", "labels_ptr": "*i64", "lse_ptr": "*fp32",
        "grad_ptr": "*fp32", "n_cols": "i32", "ignore_index": "i32", "scale": "fp32", "softcap": "fp32",
    }


AOT_SPECS = [
    (
        _logprobs_forward_kernel,
        _aot_forward_signature(dtype),
        {"HAS_SOFTCAP": softcap, "HAS_ENTROPY": softcap, "BLOCK_V": _MAX_FORWARD_BLOCK},
        {"num_warps": _forward_config(2**20)[1]},
    )
    for dtype in ("fp16", "bf16")
    for softcap in (False, True)
] + [
    (
        _logprobs_backward_kernel,
        _aot_backward_signature(dtype),
        {"HAS_SOFTCAP": softcap, "BLOCK_V": _BACKWARD_BLOCK},
        {"num_warps": _backward_config(2**20)[1]},
    )
    for dtype in ("fp16", "bf16")
    for softcap in (False, True)
]
