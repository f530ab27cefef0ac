"""LoRA q/k/v projections sharing one input, as one autograd function.

For ``P`` in ``{q, k, v}`` with base ``W_P``, adapter ``A_P [r, in]``, ``B_P [out_P, r]``, scaling ``s_P``:

    forward     P  = X W_P^T + s_P (X A_P^T) B_P^T                (saves X; the adapters' casts are reused)

    backward    U_P = s_P (dP B_P)                                 [N, r]
                dX  = dQ W_q + dK W_k + dV W_v + U_q A_q + U_k A_k + U_v A_v
                      (one buffer, accumulated with addmm_; each W re-dequantised just before use)
                dA_P = U_P^T X,    dB_P = s_P dP^T (X A_P^T)

Base weights (16-bit or NF4) are frozen; ``B A`` is never formed. See
:mod:`notebookkit.kernels.lora_projection` for the dtype rules.
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
    quantize_shared_input,
)

__all__ = ["lora_qkv", "lora_qkv_reference", "LoRAQKVFunction"]


class LoRAQKVFunction(torch.autograd.Function):
    """Autograd function of :func:`lora_qkv`; tensors of the projections are passed explicitly."""

    @staticmethod
    def forward(ctx, x, projs, *tensors):
        x2d = flatten_tokens(x)
        x_fp8 = quantize_shared_input(x2d, *projs)
        outs = []
        for proj in projs:
            A, B = proj.adapters(x.dtype)
            y = projection_forward(x2d, proj, A, B, x_fp8)
            outs.append(y.view(*x.shape[:-1], y.shape[-1]))
        del x_fp8
        ctx.save_for_backward(x, *tensors)
        ctx.projs = projs  # the same projections in backward: their adapter casts are reused
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grads_out: list = [None] * len(tensors)
        with no_autocast(x.device.type):
            x2d = flatten_tokens(x)
            dx = None
            for i, proj in enumerate(ctx.projs):
                dy2d = flatten_tokens(grads[i]).to(x.dtype)
                A, B = proj.adapters(x.dtype)
                u = lora_rank_grad(dy2d, proj, B)
                dA, dB = adapter_grads(dy2d, x2d, u, proj, A, needs[2 + 3 * i + 1], needs[2 + 3 * i + 2])
                grads_out[3 * i + 1], grads_out[3 * i + 2] = dA, dB
                if needs[0]:
                    dx = accumulate_input_grad_(dx, dy2d, proj, u, A)
        return (dx.view(x.shape) if dx is not None else None), None, *grads_out


def lora_qkv(
    x: torch.Tensor, q: LoRAProjection, k: LoRAProjection, v: LoRAProjection
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value projections with LoRA, sharing the input ``x [..., hidden]``.

    Each projection is ``x W^T + s (x A^T) B^T`` (16-bit or NF4 base; adapter optional per
    projection). Returns ``(Q, K, V)`` shaped ``[..., out_q]``, ``[..., out_k]``, ``[..., out_v]``
    in the compute dtype (autocast dtype if autocast is on, else ``x.dtype``). Gradients flow to
    ``x`` and to every ``lora_A`` / ``lora_B``; base weights are frozen.
    """
    projs = (q, k, v)
    for p in projs:
        p.check_frozen()
    dtype = compute_dtype(x)
    if x.dtype != dtype:
        x = x.to(dtype)
    tensors = [t for p in projs for t in (p.weight, p.lora_A, p.lora_B)]
    with no_autocast(x.device.type):
        return LoRAQKVFunction.apply(x, projs, *tensors)


def lora_qkv_reference(
    x: torch.Tensor, q: LoRAProjection, k: LoRAProjection, v: LoRAProjection
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain PyTorch autograd composition of :func:`lora_qkv` (the test oracle)."""
    return projection_reference(x, q), projection_reference(x, k), projection_reference(x, v)
