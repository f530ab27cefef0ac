"""LoRA attention output projection ``o_proj``: the shared-input LoRA autograd function of
:mod:`notebookkit.kernels.lora_projection` (the one of q/k/v) with one projection.

    forward     XA = s (X A^T),   Y = X W^T + XA B^T               (saves X, XA [N, r], A, B)

    backward    U  = s (dY B)                                     [N, r]
                dX = dY W + U A                                   (W re-dequantised if NF4)
                dA = U^T X,    dB = dY^T XA

The base weight ``W`` (16-bit or NF4) is frozen. See :mod:`notebookkit.kernels.lora_projection`
for the dtype rules (compute in the autocast dtype or ``x.dtype``; adapter grads in the adapters'
dtype).
"""

from __future__ import annotations

import torch

from .lora_projection import LoRAProjection, projection_reference, shared_input_lora

__all__ = ["lora_o", "lora_o_reference"]


def lora_o(x: torch.Tensor, o: LoRAProjection, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output projection with LoRA: ``x W^T (+ b) + s (x A^T) B^T`` for ``x [..., in]``.

    Args:
        x: attention output, ``[..., in_features]``.
        o: the ``o_proj`` layer as a :class:`LoRAProjection` (16-bit or NF4 base, adapter or none).
        bias: its frozen bias, or None (added by the base GEMM).

    Returns:
        ``[..., out_features]`` in the compute dtype (autocast dtype if autocast is on, else
        ``x.dtype``). Gradients flow to ``x``, ``o.lora_A`` and ``o.lora_B``; the base weight is frozen.
    """
    (y,) = shared_input_lora(x, (o,), (bias,))  # the shared-input dispatch with one projection: never a group
    return y


def lora_o_reference(x: torch.Tensor, o: LoRAProjection) -> torch.Tensor:
    """Plain PyTorch autograd composition of :func:`lora_o` (the test oracle)."""
    return projection_reference(x, o)
