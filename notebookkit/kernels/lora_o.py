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
    autograd_tensor_grads,
    autograd_tensors,
    compute_dtype,
    flatten_tokens,
    no_autocast,
    projection_reference,
    requested_adapter_grads,
    shared_input_backward,
    shared_input_forward,
)

__all__ = ["lora_o", "lora_o_reference", "LoRAOFunction"]


class LoRAOFunction(torch.autograd.Function):
    """Autograd function of :func:`lora_o`: inputs ``x, proj, *autograd_tensors([proj])``; the
    shared-input dispatch of :mod:`notebookkit.kernels.lora_projection` with one projection."""

    @staticmethod
    def forward(ctx, x, proj: LoRAProjection, *tensors):
        (y,), _ = shared_input_forward(flatten_tokens(x), (proj,))  # one projection: never a group
        ctx.save_for_backward(x, *tensors)
        ctx.proj = proj  # the same projection in backward: its adapter casts are reused
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x, *_ = ctx.saved_tensors  # unpacked also to check that no saved tensor changed in place
        need_dx, _, *tensor_needs = ctx.needs_input_grad  # x, proj, *autograd_tensors([proj])
        need_dA, need_dB = requested_adapter_grads(tensor_needs)
        with no_autocast(x.device.type):
            dy2d = flatten_tokens(dy).to(x.dtype)
            dx, adapter_grad_pairs = shared_input_backward(
                [dy2d], flatten_tokens(x), (ctx.proj,), None, need_dx, need_dA, need_dB
            )
        return (dx.view(x.shape) if dx is not None else None), None, *autograd_tensor_grads(adapter_grad_pairs)


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
        return LoRAOFunction.apply(x, o, *autograd_tensors([o]))


def lora_o_reference(x: torch.Tensor, o: LoRAProjection) -> torch.Tensor:
    """Plain PyTorch autograd composition of :func:`lora_o` (the test oracle)."""
    return projection_reference(x, o)
