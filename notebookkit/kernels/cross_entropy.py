r"""Cross-entropy on materialised logits, any vocabulary size, gradient computed in the forward.

Notation, for one token row: raw logits :math:`x \in \mathbb{R}^V`, target :math:`y`, logit scale
:math:`s` (``logit_scale``), soft-cap :math:`c` (``softcap``, Gemma-2), z-loss weight
:math:`\lambda` (``z_loss``) and denominator :math:`D` (``n_items``, or the number of rows whose
label is not ``ignore_index``).

Forward::

    u_j   = s * x_j
    z_j   = c * tanh(u_j / c)            (soft-capping; z_j = u_j when softcap is None)
    lse   = log sum_j exp(z_j)           (online log-sum-exp over V in blocks, fp32)
    l     = lse - z_y + lambda * lse^2   (0 for rows with y == ignore_index)
    L     = sum_rows l / D

Gradient (p_j = exp(z_j - lse) is the softmax, [j == y] the one-hot)::

    dL/dz_j = ((1 + 2 * lambda * lse) * p_j - [j == y]) / D
    dz_j/dx_j = s * (1 - tanh^2(u_j / c)) = s * (1 - (z_j / c)^2)   (= s without soft-capping)
    dL/dx_j = dL/dz_j * dz_j/dx_j                                   (0 for ignored rows)

Because the gradient depends only on the row and on ``D``, the kernel writes it during the
forward pass (a second sweep over the row after the log-sum-exp sweep), and ``backward`` only
multiplies it by the incoming scalar ``grad_output`` (in fp32, on the device). All arithmetic is
fp32 whatever the logits' dtype; the gradient is stored in the logits' dtype.

**fp16 headroom.** The gradient is written before the loss scaler's factor is known, and in float16
``p_j / D`` (about ``1 / (V D)``) falls under fp16's smallest number for large vocabularies, where
plain PyTorch, which receives the scaled gradient, keeps it. In float16 the kernel therefore stores
``c * D * dL/dx`` with ``c = FP16_GRAD_HEADROOM = 2^8`` (every term at most ``c`` in magnitude, and in
fp16's normal range down to ``p_j = 2^-22``), and backward multiplies by ``grad_output / (c D)`` in
fp32: each gradient is rounded to fp16 once, at its final scale.

Conventions:

* **Labels are already shifted.** Row ``i`` of ``logits`` is scored against ``labels[i]``. For a
  causal LM that means the caller pairs ``logits[..., :-1, :]`` with ``labels[..., 1:]`` (or shifts
  the labels and pads the last position with ``ignore_index``) before calling.
* **Gradient accumulation.** Pass ``n_items`` = the number of label tokens (``!= ignore_index``)
  across *all* micro-batches of one optimizer step. Each micro-batch loss is then its share of the
  big-batch mean, so summing the micro-batch gradients gives exactly the big-batch gradient.
  ``n_items`` is a count: values below 1 are treated as 1, so an all-ignored batch gives loss 0
  and zero gradients, never NaN.
* **In-place gradient.** To avoid a second ``[N, V]`` buffer the gradient can overwrite the logits
  buffer (``inplace_grad=True``). This is safe when nothing reads the logits after the loss call:
  the usual ``logits = lm_head(h); loss = cross_entropy(logits, labels)`` where the logits are a
  throw-away intermediate. After the call the tensor holds ``dL/dlogits`` and its values are no
  longer logits, so compute metrics (accuracy, ...) *before* the loss, or pass
  ``inplace_grad=False``. If an autograd node saved the logits for its own backward (for example a
  ``tanh`` applied outside), PyTorch's version check raises at ``backward`` instead of returning
  wrong gradients. The default (``None``) writes in place only when the logits are a non-leaf
  autograd result, never into a leaf tensor you created yourself (or a view of one).

Offsets are int64 (row index times row stride), so ``N * V >= 2**31`` is fine.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from notebookkit.kernels.runtime import should_use_triton
from notebookkit.kernels.scale_in_place import scale_in_place

__all__ = [
    "cross_entropy",
    "cross_entropy_reference",
    "CrossEntropyFunction",
    "launch_cross_entropy",
    "FP16_GRAD_HEADROOM",
    "AOT_SPECS",
]

NItems = Union[int, float, torch.Tensor, None]

FP16_GRAD_HEADROOM = 2.0**8  # float16 gradients are stored as c * D * dL/dx (module docstring)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def tanh_from_exp(a):
    # tanh from exp (tl.math.tanh is not in every triton 3.x release): exact limits at +-inf.
    t = tl.exp(-2.0 * tl.abs(a))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(a >= 0, r, -r)


@triton.jit
def softcapped_scores(x, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """The scores a row's softmax is taken of, in fp32, from raw logits ``x``: ``z = c tanh(s x / c)``
    with a soft-cap ``c`` (``HAS_SOFTCAP``), else ``z = s x`` (``s`` the scale)."""
    z = x.to(tl.float32) * scale
    if HAS_SOFTCAP:
        z = softcap * tanh_from_exp(z / softcap)
    return z


@triton.jit
def grad_through_softcap(dz, z, softcap, HAS_SOFTCAP: tl.constexpr):
    """``dL/du`` from ``dL/dz`` for ``z = c tanh(u / c)``: ``dL/dz * (1 - (z / c)^2)``; unchanged without a
    soft-cap."""
    if HAS_SOFTCAP:
        t = z / softcap
        dz = dz * (1.0 - t * t)
    return dz


@triton.jit
def row_logsumexp(x_row, n_cols, scale, softcap, HAS_SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    """``(lse, s, t)`` of one row's scores ``z_j`` (:func:`softcapped_scores` of ``x_row[0 .. n_cols)``), read
    once in blocks of ``BLOCK_V``: the online log-sum-exp with running max ``m``, ``s = sum_j exp(z_j - m)``,
    ``lse = m + log s``; with ``WITH_ENTROPY`` also ``t = sum_j exp(z_j - m) z_j`` (entropy ``lse - t / s``),
    else ``t = 0``. All in fp32."""
    cols = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s = 0.0
    t = 0.0
    for start in range(0, n_cols, BLOCK_V):
        offs = start + cols
        mask = offs < n_cols
        z = softcapped_scores(tl.load(x_row + offs, mask=mask, other=0.0), scale, softcap, HAS_SOFTCAP)
        z_in = tl.where(mask, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z_in, axis=0))
        m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)  # all -inf so far: keep exp() finite
        alpha = tl.exp(m - m_ref)
        e = tl.exp(z_in - m_ref)
        s = s * alpha + tl.sum(e, axis=0)
        if WITH_ENTROPY:
            t = t * alpha + tl.sum(e * tl.where(mask, z, 0.0), axis=0)  # 0 * -inf would be NaN
        m = m_new
    return m + tl.log(s), s, t


@triton.jit
def _cross_entropy_kernel(
    x_ptr,  # [N, V] logits (fp32 / fp16 / bf16), unit stride along V
    x_row_stride,
    g_ptr,  # [N, V] gradient output (may alias x_ptr), unit stride along V
    g_row_stride,
    labels_ptr,  # [N] integer labels
    loss_ptr,  # [N] fp32 per-row loss (unnormalised)
    denom_ptr,  # [] fp32 denominator D
    n_cols,
    ignore_index,
    logit_scale,
    softcap,
    z_loss,
    HAS_SOFTCAP: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    g_row = g_ptr + row * g_row_stride
    label = tl.load(labels_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)

    if label == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if COMPUTE_GRAD:
            zeros = tl.zeros([BLOCK_V], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_V):
                offs = start + cols
                tl.store(g_row + offs, zeros.to(g_ptr.dtype.element_ty), mask=offs < n_cols)
        return

    # Sweep 1: online log-sum-exp of z over the row.
    lse, _, _ = row_logsumexp(x_row, n_cols, logit_scale, softcap, HAS_SOFTCAP, False, BLOCK_V)

    in_range = (label >= 0) & (label < n_cols)
    z_y = softcapped_scores(tl.load(x_row + label, mask=in_range, other=0.0), logit_scale, softcap, HAS_SOFTCAP)
    loss = lse - z_y
    if HAS_Z_LOSS:
        loss += z_loss * lse * lse
    tl.store(loss_ptr + row, loss)

    # Sweep 2: dL/dx, written over the row (in place when g_ptr aliases x_ptr: each block is read
    # before it is written, and sweep 2 never needs an earlier block again).
    if COMPUTE_GRAD:
        inv_d = 1.0 / tl.load(denom_ptr)
        coef = 1.0
        if HAS_Z_LOSS:
            coef = 1.0 + 2.0 * z_loss * lse
        scale = logit_scale * inv_d
        for start in range(0, n_cols, BLOCK_V):
            offs = start + cols
            mask = offs < n_cols
            z = softcapped_scores(tl.load(x_row + offs, mask=mask, other=0.0), logit_scale, softcap, HAS_SOFTCAP)
            p = tl.exp(z - lse)
            dz = grad_through_softcap(coef * p - tl.where(offs == label, 1.0, 0.0), z, softcap, HAS_SOFTCAP)
            g = dz * scale
            tl.store(g_row + offs, g.to(g_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


_MAX_BLOCK_V = 8192


def new_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised output buffer (one place, so tests can poison every output with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _block_config(n_cols: int, block_size: Optional[int]) -> tuple[int, int]:
    if block_size is None:
        block_size = min(triton.next_power_of_2(max(n_cols, 1)), _MAX_BLOCK_V)
    block_size = triton.next_power_of_2(block_size)
    num_warps = min(max(block_size // 512, 4), 16)
    return block_size, num_warps


def denominator(labels: torch.Tensor, ignore_index: int, n_items: NItems, device: torch.device) -> torch.Tensor:
    """The loss denominator ``D`` as a 0-dim fp32 tensor on ``device`` (no host sync).

    ``n_items`` when given (int, float or tensor), else the number of labels != ``ignore_index``;
    clamped below at 1 so an all-ignored batch divides 0 by 1.
    """
    if n_items is None:
        d = (labels != ignore_index).sum().to(device=device, dtype=torch.float32)
    elif isinstance(n_items, torch.Tensor):
        if n_items.numel() != 1:
            raise ValueError(
                f"n_items must be a single number (the count of label tokens in the optimizer step), "
                f"got a tensor of shape {tuple(n_items.shape)}."
            )
        d = n_items.detach().reshape(()).to(device=device, dtype=torch.float32)
    else:
        if not n_items > 0:
            raise ValueError(
                f"n_items={n_items!r}: it must be the positive number of label tokens (labels != "
                f"ignore_index) across all micro-batches of the optimizer step."
            )
        d = torch.tensor(float(n_items), device=device, dtype=torch.float32)
    return d.clamp(min=1.0)


def launch_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    denom: torch.Tensor,
    loss_rows: torch.Tensor,
    grad: Optional[torch.Tensor],
    *,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    z_loss: float = 0.0,
    block_size: Optional[int] = None,
) -> None:
    """Run the Triton kernel on 2-D ``logits [N, V]`` (unit stride along V).

    Writes the unnormalised per-row losses into ``loss_rows`` (fp32 ``[N]``) and, when ``grad`` is
    given (``[N, V]``, unit stride along V, may be ``logits`` itself), ``dL/dlogits`` for
    ``L = sum(loss_rows) / denom``. Also used chunk by chunk by the fused linear cross-entropy.
    """
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    assert logits.stride(1) == 1 and (grad is None or grad.stride(1) == 1)
    block, num_warps = _block_config(n_cols, block_size)
    compute_grad = grad is not None
    _cross_entropy_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        grad if compute_grad else logits,
        grad.stride(0) if compute_grad else logits.stride(0),
        labels,
        loss_rows,
        denom,
        n_cols,
        int(ignore_index),
        float(logit_scale),
        float(softcap) if softcap is not None else 1.0,
        float(z_loss),
        HAS_SOFTCAP=softcap is not None,
        HAS_Z_LOSS=z_loss != 0.0,
        COMPUTE_GRAD=compute_grad,
        BLOCK_V=block,
        num_warps=num_warps,
    )


def is_exactly_one(t: torch.Tensor) -> bool:
    """True when the scalar ``t`` equals 1 (lets backward skip a pass); False while graph-capturing."""
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return bool((t == 1).all())


# --------------------------------------------------------------------------------------------
# autograd.Function
# --------------------------------------------------------------------------------------------


class CrossEntropyFunction(torch.autograd.Function):
    """Triton cross-entropy; the gradient is made in forward and scaled by ``grad_output`` in backward."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int,
        softcap: Optional[float],
        logit_scale: float,
        z_loss: float,
        n_items: NItems,
        compute_grad: bool,
        inplace_grad: bool,
        block_size: Optional[int],
    ) -> torch.Tensor:
        n_cols = logits.shape[-1]
        x = logits.reshape(-1, n_cols)
        if x.stride(-1) != 1:
            x = x.contiguous()
        y = labels.reshape(-1)
        if not y.is_contiguous():
            y = y.contiguous()
        grad = None
        if compute_grad:
            grad = x if inplace_grad else new_buffer(x.shape, x.dtype, x.device)
        loss_rows = new_buffer((x.shape[0],), torch.float32, x.device)
        denom = denominator(y, ignore_index, n_items, x.device)
        # float16 stores c * D * G (fp16 headroom, module docstring); backward divides by c * D.
        fp16 = x.dtype == torch.float16
        grad_denom = torch.full((), 1.0 / FP16_GRAD_HEADROOM, device=x.device) if fp16 else denom
        ctx.pending_denom = denom * FP16_GRAD_HEADROOM if fp16 else None
        launch_cross_entropy(
            x, y, grad_denom, loss_rows, grad,
            ignore_index=ignore_index, softcap=softcap, logit_scale=logit_scale,
            z_loss=z_loss, block_size=block_size,
        )
        ctx.grad_logits = grad.detach() if grad is not None else None
        ctx.logits_shape = logits.shape
        ctx.consumed = False
        return loss_rows.sum() / denom

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad = ctx.grad_logits
        if grad is None:
            if ctx.consumed:
                raise RuntimeError(
                    "cross_entropy's backward ran twice (retain_graph=True?). Its gradient lives in "
                    "a single buffer that the first backward hands over; compute the loss again "
                    "instead of backpropagating through it twice."
                )
            return (None,) * 10
        ctx.grad_logits = None
        ctx.consumed = True
        # In fp32 (a loss scale of 65536 rounded to fp16 is inf). Keeps the host check (a sync) of
        # grad_output == 1, unlike fused_linear_cross_entropy: skipping a pass over [N, V] is worth it.
        if ctx.pending_denom is not None:
            scale_in_place(grad, grad_output.to(torch.float32) / ctx.pending_denom)
        elif not is_exactly_one(grad_output):
            scale_in_place(grad, grad_output.to(torch.float32))
        return (grad.view(ctx.logits_shape),) + (None,) * 9


# --------------------------------------------------------------------------------------------
# Reference (CPU runtime path and test oracle)
# --------------------------------------------------------------------------------------------


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                            softcap: Optional[float] = None, logit_scale: float = 1.0, z_loss: float = 0.0,
                            n_items: NItems = None) -> torch.Tensor:
    """Plain-PyTorch cross-entropy with the same options, differentiable by autograd.

    Math in float32 (float64 when the logits are float64, which makes it the test oracle). Without
    z-loss the rows go through ``torch.nn.functional.cross_entropy`` (one fused log-softmax + NLL,
    the CPU training path); the explicit log-sum-exp form is used only for the z-loss term.
    """
    n_cols = logits.shape[-1]
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    z = logits.reshape(-1, n_cols).to(compute_dtype)
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    y = labels.reshape(-1).to(z.device)
    if z_loss == 0.0:
        total = torch.nn.functional.cross_entropy(z, y.long(), ignore_index=ignore_index, reduction="sum")
        return total / denominator(y, ignore_index, n_items, z.device).to(compute_dtype)
    valid = y != ignore_index
    lse = torch.logsumexp(z, dim=-1)
    z_y = z.gather(1, torch.where(valid, y, 0).long()[:, None]).squeeze(1)
    rows = lse - z_y + z_loss * lse * lse
    rows = torch.where(valid, rows, torch.zeros_like(rows))
    denom = denominator(y, ignore_index, n_items, z.device).to(compute_dtype)
    return rows.sum() / denom


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def _owned_by_user(t: torch.Tensor) -> bool:
    """True when ``t`` is a leaf tensor or a view of one: writing into it would clobber user data."""
    base = t
    while base._base is not None:
        base = base._base
    return base.grad_fn is None or t.grad_fn is None


def check_labels_and_softcap(
    rows_name: str, rows: torch.Tensor, labels: torch.Tensor, softcap: Optional[float]
) -> None:
    """Checks shared with the fused linear cross-entropy: one integer label per row of ``rows``
    (``[..., V]`` logits or ``[..., H]`` hidden states, called ``rows_name`` in the message) and a
    positive ``softcap`` or ``None``."""
    n_rows = rows.numel() // max(rows.shape[-1], 1)
    if labels.numel() != n_rows:
        raise ValueError(
            f"labels has {labels.numel()} entries but {rows_name} has {n_rows} rows (shape "
            f"{tuple(rows.shape)}). Row i is scored against labels[i]: shift the labels for "
            f"next-token prediction before calling ({rows_name}[..., :-1, :] with labels[..., 1:])."
        )
    if labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"labels must be an integer tensor (token ids), got {labels.dtype}.")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}.")


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    z_loss: float = 0.0,
    n_items: NItems = None,
    *,
    inplace_grad: Optional[bool] = None,
) -> torch.Tensor:
    """Token-level cross-entropy for causal-LM training; returns a scalar fp32 loss.

    Args:
        logits: ``[N, V]`` (or ``[..., V]``) scores in fp32, fp16 or bf16. Any ``V`` (Gemma's
            256000 / 262144 included).
        labels: ``[N]`` (or ``[...]``) integer targets, **already shifted** so that row ``i`` is
            scored against ``labels[i]``. Rows equal to ``ignore_index`` add nothing. Other labels
            must lie in ``[0, V)``: the Triton path does not check (that would cost a GPU sync) and
            scores an out-of-range label as if its logit were 0; the reference path raises.
        ignore_index: label value of positions that carry no loss (prompt tokens, padding).
        softcap: Gemma-2 final-logit soft-cap ``c``: scores become ``c * tanh(x / c)``. ``None``
            turns it off.
        logit_scale: multiply the logits by this before everything else (Cohere-style scaling).
        z_loss: weight of the auxiliary ``log(sum(exp(z)))**2`` term per token (PaLM z-loss); 0 off.
        n_items: the loss is ``sum over tokens / n_items``. Pass the number of label tokens across
            all micro-batches of the optimizer step so gradient accumulation equals one big batch;
            ``None`` divides by the number of labelled tokens in this call (a mean).
        inplace_grad: write the gradient into the ``logits`` buffer instead of a new one (saves one
            ``[N, V]`` allocation). ``None`` (default) does so when ``logits`` is an intermediate
            autograd result and not a tensor you created. After an in-place call ``logits`` holds
            the gradient, not the scores: read anything you need from them before the loss.

    CUDA tensors run the Triton kernel; CPU tensors run :func:`cross_entropy_reference` (unless
    Triton is forced with ``notebookkit.kernels.runtime.use_triton(True)`` under the interpreter).
    """
    if logits.dim() < 1:
        raise ValueError("cross_entropy expects logits of shape [N, V] (or [..., V]), got a scalar.")
    check_labels_and_softcap("logits", logits, labels, softcap)
    if not should_use_triton(logits):
        return cross_entropy_reference(logits, labels, ignore_index, softcap, logit_scale, z_loss, n_items)
    if logits.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"The Triton cross_entropy supports float32, float16 and bfloat16 logits, got {logits.dtype}. "
            f"Cast the logits (for example logits.float()) first."
        )
    labels = labels.to(logits.device)
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    if inplace_grad is None:
        inplace_grad = compute_grad and not _owned_by_user(logits)
    return CrossEntropyFunction.apply(
        logits, labels, int(ignore_index), softcap, float(logit_scale), float(z_loss), n_items,
        compute_grad, bool(inplace_grad), None,
    )


# --------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (T4 readiness, tests/kernels/aot.py):
# (jit kernel, runtime-argument types, constexprs, options) in the launcher's large-vocab config.
# --------------------------------------------------------------------------------------------


def _aot_signature(dtype: str) -> dict[str, str]:
    return {
        "x_ptr": f"*{dtype}",
        "x_row_stride": "i64",
        "g_ptr": f"*{dtype}",
        "g_row_stride": "i64",
        "labels_ptr": "*i64",
        "loss_ptr": "*fp32",
        "denom_ptr": "*fp32",
        "n_cols": "i32",
        "ignore_index": "i32",
        "logit_scale": "fp32",
        "softcap": "fp32",
        "z_loss": "fp32",
    }


AOT_SPECS = [
    (
        _cross_entropy_kernel,
        _aot_signature(dtype),
        {"HAS_SOFTCAP": softcap, "HAS_Z_LOSS": softcap, "COMPUTE_GRAD": True, "BLOCK_V": _MAX_BLOCK_V},
        {"num_warps": _block_config(2**20, None)[1]},
    )
    for dtype in ("fp16", "bf16")
    for softcap in (False, True)
]
