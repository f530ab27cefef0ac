"""Gated LoRA MLP (gate / up / down projections around SwiGLU or GeGLU) as one autograd function.

With ``X [N, hidden]``, each projection ``P(Z) = Z W_P^T + s_P (Z A_P^T) B_P^T`` (see
:mod:`notebookkit.kernels.lora_projection`) and ``act`` = SiLU, exact GELU or tanh-GELU:

    forward     e = gate(X),   g = up(X),   h = act(e) * g,   Y = down(h)
                (saves X, e, g and the adapters; h is recomputed in backward)

    backward    U_d  = s_d (dY B_d)
                dh   = dY W_d + U_d A_d
                h, de, dg = act(e) g,  dh act'(e) g,  dh act(e)     (written over dh, e, g in place)
                dA_d = U_d^T h,        dB_d = s_d dY^T (h A_d^T)
                U_g  = s_g (de B_g),   U_u = s_u (dg B_u)
                dX   = de W_g + dg W_u + U_g A_g + U_u A_u          (one buffer, addmm_)
                dA_g = U_g^T X,  dB_g = s_g de^T (X A_g^T);  same for up with dg

gate and up read the same X and run through the shared-input dispatch of q/k/v
(:func:`notebookkit.kernels.lora_projection.shared_input_forward` and ``shared_input_backward``):
when both have adapters of one rank, their low-rank GEMMs are grouped
(:func:`notebookkit.kernels.lora_projection.adapter_group`), with ``A_cat = cat(A_g, A_u)`` ``[2r, in]``
built once and kept while neither ``A`` changes:

    forward     XA_cat = X A_cat^T;   e = X W_g^T + s_g XA_cat[:, :r] B_g^T,   g likewise with [:, r:]
    backward    U_cat  = [s_g (de B_g) | s_u (dg B_u)]               [N, 2r], one buffer
                dX     = de W_g + dg W_u + U_cat A_cat               (one addmm_ for both adapters)
                dA_cat = U_cat^T X                                   (rows: dA_g, dA_u)
                XA_cat = X A_cat^T (recomputed);  dB_g = s_g de^T XA_cat[:, :r],  dB_u likewise

That is 23 GEMM calls per forward + backward instead of 27 (fewer host launches; the down
projection reads h and stays alone).

The activation backward comes from :mod:`notebookkit.kernels.swiglu` / :mod:`notebookkit.kernels.geglu`
(in-place Triton kernels on CUDA).

FP8 forward (gate and up with ``fp8_forward``, ``hidden`` and ``I`` multiples of 16): the two base
products are one ``torch._scaled_mm`` of the FP8 ``X`` with ``[Q_Wg; Q_Wu]``
(:func:`notebookkit.kernels.lora_projection.grouped_fp8_base_forward`), and e, g are the column
blocks ``[:, :I]``, ``[:, I:]`` of its ``[N, 2I]`` output (views, not copies). The activation kernels
read them in place (row stride ``2I``), they are saved as such, and the in-place backward writes
de, dg back into those same column blocks (the two blocks do not overlap).

Base weights are frozen; ``B A`` is never formed. Because e and g are overwritten, the backward can
run once per forward (``retain_graph=True`` is refused).

The backward never reads ``Y``. A checkpointed decoder layer whose MLP output only enters the
residual sum (Llama, Mistral, Qwen, Gemma 1) recomputes its forward in the backward pass only to
rebuild what is saved, so there ``compute_output=False`` skips the down projection (a quarter of a
Llama layer's matmul work) and returns zeros of Y's shape for the graph to go through.
"""

from __future__ import annotations

from typing import Callable

import torch

from .geglu import geglu_backward_, geglu_forward, geglu_reference
from .lora_projection import (
    LoRAProjection,
    accumulate_input_grad_,
    adapter_grads,
    apply_in_compute_dtype,
    autograd_tensor_grads,
    flatten_tokens,
    lora_rank_grad,
    no_autocast,
    projection_forward,
    projection_reference,
    requested_adapter_grads,
    shared_input_backward,
    shared_input_forward,
)
from .runtime import should_use_triton
from .swiglu import swiglu_backward_, swiglu_forward, swiglu_reference

__all__ = ["lora_mlp", "lora_mlp_reference", "LoRAMLPFunction", "ACTIVATIONS"]

ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh")


# --------------------------------------------------------------------------------------------------
# Activation: forward h = act(e) * g, in-place backward (dh, e, g) -> (h, de, dg)
# --------------------------------------------------------------------------------------------------


def _torch_act(activation: str, e: torch.Tensor) -> torch.Tensor:
    if activation == "swiglu":
        return torch.nn.functional.silu(e)
    return torch.nn.functional.gelu(e, approximate="tanh" if activation == "geglu_tanh" else "none")


def _activation_ops(activation: str) -> tuple[Callable, Callable]:
    """``(forward(e, g) -> h, backward_(dh, e, g) -> (h, de, dg))`` for the activation name.

    The forward runs inside this module's autograd function (no graph of its own), so it calls the
    Triton launcher directly (or the PyTorch reference off Triton): ``e`` and ``g`` may be the column
    blocks of one grouped FP8 product (row slices with one row stride), which the launcher reads in
    place, where ``swiglu()``'s autograd function would first copy them to contiguous tensors.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}.")
    if activation == "swiglu":
        return (lambda e, g: swiglu_forward(e, g) if should_use_triton(e) else swiglu_reference(e, g)), swiglu_backward_
    approximate = "tanh" if activation == "geglu_tanh" else "none"
    return (
        lambda e, g: geglu_forward(e, g, approximate) if should_use_triton(e) else geglu_reference(e, g, approximate),
        lambda dh, e, g: geglu_backward_(dh, e, g, approximate),
    )


# --------------------------------------------------------------------------------------------------
# Autograd function
# --------------------------------------------------------------------------------------------------


class LoRAMLPFunction(torch.autograd.Function):
    """Autograd function of :func:`lora_mlp`: inputs ``x, projs, activation, compute_output,
    *autograd_tensors(projs)``."""

    @staticmethod
    def forward(ctx, x, projs, activation, compute_output, *tensors):
        gate, up, down = projs
        act_forward, _ = _activation_ops(activation)
        x2d = flatten_tokens(x)
        (e, g), group = shared_input_forward(x2d, (gate, up))
        if compute_output:
            h = act_forward(e, g)
            A, B = down.adapters(x.dtype)
            y = projection_forward(h, down, A, B)
            del h
        else:  # the caller only back-propagates through Y (see the module docstring)
            y = x2d.new_zeros(x2d.shape[0], down.out_features)
        ctx.save_for_backward(x, e, g, *tensors)
        ctx.projs = projs  # the same projections in backward: their adapter casts are reused
        ctx.group = group  # and the same A_cat of gate and up
        ctx.activation = activation
        ctx.consumed = False
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        if ctx.consumed:
            raise RuntimeError(
                "lora_mlp's backward overwrites its saved activations, so it can run only once per forward "
                "(retain_graph=True with a second backward is not supported). Run the forward again."
            )
        ctx.consumed = True
        x, e, g, *_ = ctx.saved_tensors
        need_dx, _, _, _, *tensor_needs = ctx.needs_input_grad  # x, projs, activation, compute_output, ...
        (need_dA_gate, need_dA_up, need_dA_down), (need_dB_gate, need_dB_up, need_dB_down) = (
            requested_adapter_grads(tensor_needs)
        )
        gate, up, down = ctx.projs
        _, act_backward_ = _activation_ops(ctx.activation)
        with no_autocast(x.device.type):
            dtype = x.dtype
            dy2d = flatten_tokens(dy).to(dtype)

            A_d, B_d = down.adapters(dtype)
            u_d = lora_rank_grad(dy2d, down, B_d)
            dh = accumulate_input_grad_(None, dy2d, down, u_d, A_d)
            h, de, dg = act_backward_(dh, e, g)
            down_grads = adapter_grads(dy2d, h, u_d, down, A_d, need_dA_down, need_dB_down)
            del h, dh, u_d

            dx, (gate_grads, up_grads) = shared_input_backward(
                [de, dg], flatten_tokens(x), (gate, up), ctx.group,
                need_dx, [need_dA_gate, need_dA_up], [need_dB_gate, need_dB_up],
            )
        grads = autograd_tensor_grads([gate_grads, up_grads, down_grads])
        return (dx.view(x.shape) if dx is not None else None), None, None, None, *grads


def lora_mlp(
    x: torch.Tensor,
    gate: LoRAProjection,
    up: LoRAProjection,
    down: LoRAProjection,
    activation: str = "swiglu",
    compute_output: bool = True,
) -> torch.Tensor:
    """Gated MLP with LoRA on each projection: ``down(act(gate(x)) * up(x))``.

    Args:
        x: hidden states ``[..., hidden]``.
        gate, up, down: the three projections as :class:`LoRAProjection` (16-bit or NF4 bases,
            adapters optional per projection).
        activation: ``"swiglu"`` (Llama, Mistral, Qwen), ``"geglu"`` (exact erf GELU) or
            ``"geglu_tanh"`` (tanh-approximated GELU, Gemma).
        compute_output: ``False`` skips the down projection and returns zeros; gradients are
            unchanged, because the backward never reads the output. Only for a recompute pass
            whose output value nobody reads.

    Returns:
        ``[..., hidden]`` in the compute dtype (autocast dtype if autocast is on, else ``x.dtype``).
        Gradients flow to ``x`` and every ``lora_A`` / ``lora_B``; base weights are frozen.
    """
    _activation_ops(activation)  # validates the name
    if gate.out_features != up.out_features or down.in_features != up.out_features:
        raise ValueError(
            f"MLP shapes do not chain: gate out {gate.out_features}, up out {up.out_features}, "
            f"down in {down.in_features} must all be the intermediate size."
        )
    return apply_in_compute_dtype(LoRAMLPFunction, x, (gate, up, down), activation, bool(compute_output))


def lora_mlp_reference(
    x: torch.Tensor,
    gate: LoRAProjection,
    up: LoRAProjection,
    down: LoRAProjection,
    activation: str = "swiglu",
) -> torch.Tensor:
    """Plain PyTorch autograd composition of :func:`lora_mlp` (the test oracle)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}.")
    e = projection_reference(x, gate)
    g = projection_reference(x, up)
    return projection_reference(_torch_act(activation, e) * g, down)
