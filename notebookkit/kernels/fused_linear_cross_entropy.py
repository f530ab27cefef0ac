r"""Fused linear cross-entropy: ``cross_entropy(hidden @ weight.T + bias, labels)`` without ever
holding the ``[N, V]`` logits.

With hidden states :math:`h \in \mathbb{R}^{N \times H}`, the LM head :math:`W \in \mathbb{R}^{V
\times H}` and optional bias :math:`b`, the logits are :math:`X = h W^T + b` and the loss is
exactly the one of :mod:`notebookkit.kernels.cross_entropy` (same soft-cap, scaling, z-loss,
``ignore_index`` and ``n_items`` options)::

    L = sum_rows (lse_i - z_{i,y_i} + lambda * lse_i^2) / D,   z = c * tanh(s * X / c)

Writing :math:`G = dL/dX` (the cross-entropy gradient, see that module:
``G_ij = ((1 + 2 lambda lse_i) p_ij - [j == y_i]) * s * (1 - (z_ij / c)^2) / D``)::

    dL/dh = G W          dL/dW = G^T h          dL/db = sum_rows G

The forward walks the tokens in chunks of ``C`` rows. Per chunk: one GEMM makes the ``[C, V]``
logits, the Triton cross-entropy kernel turns them into per-row losses and overwrites them with
``G`` (fp32 math), and two more GEMMs turn ``G`` into the chunk's rows of ``dL/dh`` and add
``G^T h`` into an fp32 ``dL/dW`` accumulator (only when the weight requires grad; likewise the
bias). Only one ``[C, V]`` buffer ever exists. Backward then just multiplies the stored gradients
by the scalar ``grad_output``, on the device (no host sync) and in fp32
(:func:`notebookkit.kernels.scale_in_place.scale_in_place`).

fp16 headroom. The gradients are made before the loss scaler's factor ``S`` is known, so in float16
``G`` itself would be stored unscaled: ``p_ij / D`` is about ``1 / (V D)``, far under fp16's smallest
number for a 128K vocabulary (plain PyTorch, which gets ``G`` scaled by ``S`` in its backward, keeps
it). In float16 the kernel therefore stores ``c D G`` (the row gradient without ``1 / D``, times
``c = FP16_GRAD_HEADROOM = 2^8`` of :mod:`notebookkit.kernels.cross_entropy`, so every term sits in
fp16's normal range), the weight and bias gradients accumulate in fp32, and backward multiplies by
``grad_output / (c D)`` in fp32, which rounds each gradient to fp16 once, at its final scale.
``|c D G W| <= 2 c max|W|`` bounds the hidden-gradient buffer far under fp16's 65504 for any LM head.

Labels are already shifted by the caller (row ``i`` of ``hidden`` predicts ``labels[i]``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from notebookkit.kernels import cross_entropy as _ce
from notebookkit.kernels.cross_entropy import (
    FP16_GRAD_HEADROOM,
    NItems,
    SUPPORTED_DTYPES,
    check_labels_and_softcap,
    cross_entropy_reference,
    denominator,
    launch_cross_entropy,
)
from notebookkit.kernels.runtime import should_use_triton
from notebookkit.kernels.scale_in_place import scale_in_place

__all__ = [
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_reference",
    "FusedLinearCrossEntropyFunction",
    "choose_chunk_size",
    "AOT_SPECS",
]

# The Triton work of this op is the cross-entropy kernel; its AOT specs live in cross_entropy.py.
AOT_SPECS: list = []

_CPU_BUDGET_BYTES = 64 * 2**20
_CUDA_CAP_BYTES = 256 * 2**20
_CUDA_CAP_BYTES_WEIGHT_GRAD = 1024 * 2**20


def choose_chunk_size(
    n_rows: int,
    vocab: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    weight_grad: bool = False,
) -> int:
    """Rows per chunk for :func:`fused_linear_cross_entropy` (see the module docstring)."""
    if n_rows <= 0:
        return 1
    elem = torch.empty((), dtype=dtype).element_size()
    # Per chunk row: the logits/gradient row, the hidden-gradient row, loss and label scalars.
    row_bytes = vocab * elem + 2 * hidden * elem + 16
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cap = _CUDA_CAP_BYTES_WEIGHT_GRAD if weight_grad else _CUDA_CAP_BYTES
        budget = min(free // 4, cap)
    else:
        budget = _CPU_BUDGET_BYTES
    budget_rows = max(1, budget // row_bytes)
    # Chunk logits about the size of the hidden states: N / ceil(V / H) rows.
    vh_rows = math.ceil(n_rows / max(1, math.ceil(vocab / max(hidden, 1))))
    target = max(vh_rows, 1024 if weight_grad else 512)
    rows = max(1, min(n_rows, target, budget_rows))
    # Equal chunks, rounded up to a multiple of 8 rows (tensor-core friendly GEMM shapes).
    n_chunks = math.ceil(n_rows / rows)
    rows = math.ceil(n_rows / n_chunks)
    if rows > 8:
        rows = min(n_rows, math.ceil(rows / 8) * 8)
    return rows


def _accumulate_weight_grad(acc32: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``acc32 += g.T @ h`` with an fp32 accumulator, avoiding a [V, H] temporary when possible."""
    if acc32.dtype == g.dtype:
        acc32.addmm_(g.t(), h)
        return
    if g.is_cuda:
        try:  # torch >= 2.8 on CUDA: 16-bit GEMM with fp32 output and accumulator.
            torch.addmm(acc32, g.t(), h, out_dtype=torch.float32, out=acc32)
            return
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    if g.dtype == torch.float16:  # fp16 keeps c * D * G (module docstring): its 16-bit product may overflow
        acc32.addmm_(g.t().to(torch.float32), h.to(torch.float32))
        return
    acc32.add_(torch.mm(g.t(), h))


def backprop_lm_head_chunk(
    g: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    grad_hidden_rows: Optional[torch.Tensor],
    grad_weight: Optional[torch.Tensor],
    grad_bias: Optional[torch.Tensor],
) -> None:
    """Chain rule through ``X = h W^T + b`` for one chunk with logits gradient ``g = dL/dX``:
    ``grad_hidden_rows = g W``, ``grad_weight += g^T h``, ``grad_bias += sum_rows g`` (each skipped when ``None``)."""
    if grad_hidden_rows is not None:
        torch.mm(g, weight, out=grad_hidden_rows)
    if grad_weight is not None:
        _accumulate_weight_grad(grad_weight, g, h)
    if grad_bias is not None:
        grad_bias.add_(g.sum(dim=0, dtype=torch.float32))


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Chunked ``lm_head`` + Triton cross-entropy; gradients made in forward, scaled in backward."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        labels: torch.Tensor,
        ignore_index: int,
        softcap: Optional[float],
        logit_scale: float,
        z_loss: float,
        n_items: NItems,
        chunk_size: Optional[int],
        needs: tuple[bool, bool, bool],
        block_size: Optional[int],
    ) -> torch.Tensor:
        need_h, need_w, need_b = needs
        n_rows, n_hidden = hidden.shape
        vocab = weight.shape[0]
        device, dtype = hidden.device, hidden.dtype
        y = labels.reshape(-1)
        if not y.is_contiguous():
            y = y.contiguous()
        if chunk_size is None:
            chunk_size = choose_chunk_size(n_rows, vocab, n_hidden, dtype, device, weight_grad=need_w)
        chunk_size = max(1, min(int(chunk_size), max(n_rows, 1)))
        n_chunks = math.ceil(n_rows / chunk_size) if n_rows else 0
        any_grad = need_h or need_w or need_b

        denom = denominator(y, ignore_index, n_items, device)
        # What the kernel divides the gradient by, and what backward still divides by (fp16 headroom).
        fp16 = dtype == torch.float16
        grad_denom = torch.full((), 1.0 / FP16_GRAD_HEADROOM, device=device) if fp16 else denom
        ctx.pending_denom = denom * FP16_GRAD_HEADROOM if fp16 else None
        loss_rows = _ce.new_buffer((n_rows,), torch.float32, device)
        grad_hidden = _ce.new_buffer((n_rows, n_hidden), dtype, device) if need_h else None
        grad_weight = None
        if need_w:
            # One chunk: the GEMM itself accumulates in fp32. Several (or fp16): an fp32 accumulator.
            if n_chunks > 1 or fp16:
                grad_weight = torch.zeros((vocab, n_hidden), dtype=torch.float32, device=device)
            else:
                grad_weight = torch.zeros((vocab, n_hidden), dtype=weight.dtype, device=device)
        grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if need_b else None

        logits = _ce.new_buffer((min(chunk_size, n_rows), vocab), dtype, device)
        w_t = weight.t()
        for start in range(0, n_rows, chunk_size):
            end = min(start + chunk_size, n_rows)
            h = hidden[start:end]
            lg = logits[: end - start]
            if bias is not None:
                torch.addmm(bias, h, w_t, out=lg)
            else:
                torch.mm(h, w_t, out=lg)
            launch_cross_entropy(
                lg, y[start:end], grad_denom, loss_rows[start:end], lg if any_grad else None,
                ignore_index=ignore_index, softcap=softcap, logit_scale=logit_scale,
                z_loss=z_loss, block_size=block_size,
            )
            backprop_lm_head_chunk(lg, h, weight, grad_hidden[start:end] if need_h else None, grad_weight, grad_bias)
        del logits

        if not fp16:  # fp16 keeps fp32 accumulators until backward has scaled them
            if grad_weight is not None and grad_weight.dtype != weight.dtype:
                grad_weight = grad_weight.to(weight.dtype)
            if grad_bias is not None:
                grad_bias = grad_bias.to(bias.dtype)
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.grad_dtypes = (dtype, weight.dtype, bias.dtype if bias is not None else None)
        return loss_rows.sum() / denom

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(
                "fused_linear_cross_entropy's backward ran twice (retain_graph=True?). Its gradients "
                "are computed once in the forward and handed over by the first backward; compute "
                "the loss again instead."
            )
        ctx.grads = None
        # Always scale, on the device and in fp32: testing grad_output == 1 first would read it on the
        # host, a sync that drains the GPU queue every step, to skip one pass over [N, H] (and, when the
        # weight is trained, [V, H]); rounding grad_output to fp16 would turn a loss scale of 65536 into
        # inf. In place: these buffers were made in forward for this backward alone, so no extra memory,
        # and x * 1 == x exactly.
        factor = grad_output.to(torch.float32)
        if ctx.pending_denom is not None:
            factor = factor / ctx.pending_denom
        scaled = []
        for g, out_dtype in zip(grads, ctx.grad_dtypes):
            if g is not None:
                g = scale_in_place(g, factor)
                g = g if g.dtype == out_dtype else g.to(out_dtype)
            scaled.append(g)
        return tuple(scaled) + (None,) * 9


def check_lm_head_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor],
    softcap: Optional[float],
    chunk_size: Optional[int],
) -> None:
    """Argument checks shared by the ops on final hidden states and the LM head (this one and
    :mod:`notebookkit.kernels.linear_logprobs`): shapes, labels, soft-cap, chunk size."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be the [V, H] LM-head matrix, got shape {tuple(weight.shape)}.")
    vocab, n_hidden = weight.shape
    if hidden.shape[-1] != n_hidden:
        raise ValueError(
            f"hidden has last dimension {hidden.shape[-1]} but weight is [V={vocab}, H={n_hidden}]: "
            f"pass the final hidden states and lm_head.weight (not its transpose)."
        )
    check_labels_and_softcap("hidden", hidden, labels, softcap)
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"bias must have shape [{vocab}], got {tuple(bias.shape)}.")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows or None, got {chunk_size!r}.")


def lm_head_compute_dtype(op: str, hidden: torch.Tensor, weight: torch.Tensor, hint: str = "") -> torch.dtype:
    """One compute dtype for the LM-head GEMMs: autocast's when active, else the weight's (fp32/16/bf16)."""
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
    else:
        dtype = weight.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op} runs in float32, float16 or bfloat16, got {dtype}.{hint}")
    return dtype


def fused_linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                         bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                                         softcap: Optional[float] = None, logit_scale: float = 1.0,
                                         z_loss: float = 0.0, n_items: NItems = None,
                                         chunk_size: Optional[int] = None) -> torch.Tensor:
    """Plain PyTorch: fp32 logits ``hidden @ weight.T + bias`` then :func:`cross_entropy_reference`.

    Materialises the ``[N, V]`` logits (in float32, float64 for float64 inputs); ``chunk_size`` is
    accepted for signature parity and ignored.
    """
    compute_dtype = torch.promote_types(hidden.dtype, torch.float32)
    h = hidden.reshape(-1, hidden.shape[-1]).to(compute_dtype)
    logits = h @ weight.to(compute_dtype).t()
    if bias is not None:
        logits = logits + bias.to(compute_dtype)
    return cross_entropy_reference(logits, labels, ignore_index, softcap, logit_scale, z_loss, n_items)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    z_loss: float = 0.0,
    n_items: NItems = None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Causal-LM loss straight from the last hidden states, without materialising the logits.

    Equal to ``cross_entropy(hidden @ weight.T + bias, labels, ...)`` (see
    :func:`notebookkit.kernels.cross_entropy.cross_entropy` for the options) but only a
    ``[chunk_size, V]`` slice of logits exists at any time, which is what makes 128K-256K
    vocabularies fit on a small GPU. Returns a scalar fp32 loss.

    Args:
        hidden: ``[N, H]`` (or ``[..., H]``) final hidden states (after the final norm).
        weight: ``[V, H]`` LM-head weight (``lm_head.weight``). Its gradient is computed (in fp32,
            stored in the weight's dtype) only when it requires grad.
        labels: ``[N]`` (or ``[...]``) targets, **already shifted** (row ``i`` predicts ``labels[i]``).
        bias: optional ``[V]`` LM-head bias.
        ignore_index, softcap, logit_scale, z_loss, n_items: as in ``cross_entropy``.
        chunk_size: rows per chunk; ``None`` picks one from free GPU memory and ``V / H``.

    The gradients are computed during this call, so it costs about as much as forward + backward
    of ``lm_head`` + cross-entropy; ``loss.backward()`` afterwards is nearly free. CUDA tensors run
    the Triton path; CPU tensors run :func:`fused_linear_cross_entropy_reference` (which does
    materialise the logits) unless Triton is forced under the interpreter.
    """
    check_lm_head_inputs(hidden, weight, labels, bias, softcap, chunk_size)
    vocab, n_hidden = weight.shape
    n_rows = hidden.numel() // max(n_hidden, 1)

    if not should_use_triton(hidden):
        return fused_linear_cross_entropy_reference(
            hidden, weight, labels, bias, ignore_index, softcap, logit_scale, z_loss, n_items
        )

    dtype = lm_head_compute_dtype("fused_linear_cross_entropy", hidden, weight)
    h = hidden.reshape(n_rows, n_hidden).to(dtype)
    w = weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    labels = labels.to(h.device)
    grad_on = torch.is_grad_enabled()
    needs = (
        grad_on and h.requires_grad,
        grad_on and w.requires_grad,
        grad_on and b is not None and b.requires_grad,
    )
    with torch.autocast(h.device.type, enabled=False):
        return FusedLinearCrossEntropyFunction.apply(
            h, w, b, labels, int(ignore_index), softcap, float(logit_scale), float(z_loss),
            n_items, chunk_size, needs, None,
        )
