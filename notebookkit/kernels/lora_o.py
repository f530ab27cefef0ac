"""LoRA attention output projection ``o_proj`` as one autograd function.

    forward     Y  = X W^T + s (X A^T) B^T                       (saves X, A, B only)

    backward    U  = s (dY B)                                     [N, r]
                dX = dY W + U A                                   (W re-dequantised if NF4)
                dA = U^T X,    dB = s dY^T (X A^T)

The base weight ``W`` (16-bit or NF4) is frozen. See :mod:`notebookkit.kernels.lora_projection`
for the dtype rules (compute in the autocast dtype or ``x.dtype``; adapter grads in the adapters'
dtype).
"""

from __future__ import annotations

import torch

from .lora_projection import (
    LoRAProjection,
    accumulate_input_grad_,
    adapter_grads,
    compute_dtype,
    flatten_tokens,
    lora_rank_grad,
    no_autocast,
    projection_forward,
    projection_reference,
)

__all__ = ["lora_o", "lora_o_reference", "LoRAOFunction"]


class LoRAOFunction(torch.autograd.Function):
    """Autograd function of :func:`lora_o`; tensors of the projection are passed explicitly."""

    @staticmethod
    def forward(ctx, x, proj: LoRAProjection, weight, lora_A, lora_B):
        x2d = flatten_tokens(x)
        A, B = proj.adapters(x.dtype)
        y = projection_forward(x2d, proj, A, B)
        ctx.save_for_backward(x, weight, lora_A, lora_B)
        ctx.proj = proj  # the same projection in backward: its adapter casts are reused
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x, *_ = ctx.saved_tensors  # unpacked also to check that no saved tensor changed in place
        proj = ctx.proj
        need_dx, _, _, need_dA, need_dB = ctx.needs_input_grad
        with no_autocast(x.device.type):
            x2d = flatten_tokens(x)
            dy2d = flatten_tokens(dy).to(x.dtype)
            A, B = proj.adapters(x.dtype)
            u = lora_rank_grad(dy2d, proj, B)
            dA, dB = adapter_grads(dy2d, x2d, u, proj, A, need_dA, need_dB)
            dx = accumulate_input_grad_(None, dy2d, proj, u, A).view(x.shape) if need_dx else None
        return dx, None, None, dA, dB


def lora_o(x: torch.Tensor, o: LoRAProjection) -> torch.Tensor:
    """Attention output projection with LoRA: ``x W^T + s (x A^T) B^T`` for ``x [..., in]``.

    Args:
        x: attention output, ``[..., in_features]``.
        o: the ``o_proj`` layer as a :class:`LoRAProjection` (16-bit or NF4 base, adapter or none).

    Returns:
        ``[..., out_features]`` in the compute dtype (autocast dtype if autocast is on, else
        ``x.dtype``). Gradients flow to ``x``, ``o.lora_A`` and ``o.lora_B``; the base weight is frozen.
    """
    o.check_frozen()
    dtype = compute_dtype(x)
    if x.dtype != dtype:
        x = x.to(dtype)
    with no_autocast(x.device.type):
        return LoRAOFunction.apply(x, o, o.weight, o.lora_A, o.lora_B)


def lora_o_reference(x: torch.Tensor, o: LoRAProjection) -> torch.Tensor:
    """Plain PyTorch autograd composition of :func:`lora_o` (the test oracle)."""
    return projection_reference(x, o)
