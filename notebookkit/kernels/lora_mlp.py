"""Gated LoRA MLP (gate / up / down projections around SwiGLU or GeGLU) as one autograd function.

With ``X [N, hidden]``, each projection ``P(Z) = Z W_P^T + s_P (Z A_P^T) B_P^T (+ b_P)`` (see
:mod:`notebookkit.kernels.lora_projection`; the frozen biases ``b_P``, when given, of a vision tower's MLP add
to e, g and Y and change nothing in the backward) and ``act`` = SiLU, exact GELU or tanh-GELU:

    forward     e = gate(X),   g = up(X),   h = act(e) * g,   Y = down(h)
                (saves X, e, g, gate and up's XA = s X A^T and the adapters; h is recomputed in backward)

    backward    U_d  = s_d (dY B_d)
                dh   = dY W_d + U_d A_d
                h, de, dg = act(e) g,  dh act'(e) g,  dh act(e)     (written over dh, e, g in place)
                dA_d = U_d^T h,        dB_d = dY^T (s_d h A_d^T)    (from the rebuilt h: the same bits
                                                                    whether the MLP was kept or deferred)
                U_g  = s_g (de B_g),   U_u = s_u (dg B_u)
                dX   = de W_g + dg W_u + U_g A_g + U_u A_u          (one buffer, addmm_)
                dA_g = U_g^T X,  dB_g = de^T XA_g;  same for up with dg

gate and up read the same X and run through the shared-input dispatch of q/k/v
(:func:`notebookkit.kernels.lora_projection.shared_input_forward` and ``shared_input_backward``):
when both have adapters of one rank, their low-rank GEMMs are grouped
(:func:`notebookkit.kernels.lora_projection.adapter_group`), with ``A_cat = cat(A_g, A_u)`` ``[2r, in]``
built once and kept while neither ``A`` changes:

    forward     XA_cat = [s_g X A_g^T | s_u X A_u^T] (one GEMM, saved);   e = X W_g^T + XA_cat[:, :r] B_g^T,
                g likewise with [:, r:]
    backward    U_cat  = [s_g (de B_g) | s_u (dg B_u)]               [N, 2r], one buffer
                dX     = de W_g + dg W_u + U_cat A_cat               (one addmm_ for both adapters)
                dA_cat = U_cat^T X                                   (rows: dA_g, dA_u)
                dB_g   = de^T XA_cat[:, :r],  dB_u likewise

That is 22 GEMM calls per forward + backward instead of 25 (fewer host launches; the down
projection reads h and stays alone). A deferred MLP (below) saves no XA_cat: its backward makes it
with e and g, a tile at a time.

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
Llama layer's matmul work) and returns zeros of Y's shape for the graph to go through. It also defers
e and g: that forward saves only X, and the backward computes e, g and runs the steps above a tile of
tokens at a time (the MLP acts on each token alone), summing the adapters' gradients over the tiles.
The products are the same as without deferring; what changes is memory: the layer's recompute no longer
holds ``[N, I]`` e and g (3.5 GiB each at 131,072 tokens of an 8B model) while the rest of it runs, and
the backward holds ``[rows, I]`` tiles (:func:`notebookkit.sequence_tiles.mlp_tile_rows`: 9,216 rows for
an 8B model in bf16; a batch of at most that many tokens is one tile). A forward without autograd (an
offloaded layer's first pass, a reference model) runs a tile at a time as well.

Parked gate/up outputs (``parked``, an :class:`ParkedTiles` store): the layer's first forward (without
autograd) hands each tile's e and g to the store (which copies them to pinned host memory), and the
deferred backward takes them back instead of computing them again, skipping the gate and up GEMMs of the
recompute (a third of a Llama layer's recompute work). The tiles are those of the same ``tile_rows``, so
e and g are the bits the recompute would have computed from the same input.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import torch

from .geglu import geglu_backward_, geglu_forward, geglu_reference
from .lora_projection import (
    AdapterGroup,
    LoRAProjection,
    accumulate_input_grad_,
    adapter_group,
    adapter_grads,
    apply_in_compute_dtype,
    autograd_tensor_grads,
    compute_dtype,
    flatten_tokens,
    frozen_biases,
    lora_rank_grad,
    low_rank_input,
    no_autocast,
    projection_forward,
    projection_reference,
    requested_adapter_grads,
    shared_input_backward,
    shared_input_forward,
)
from .runtime import should_use_triton
from .swiglu import swiglu_backward_, swiglu_forward, swiglu_reference
from ..sequence_tiles import mlp_tile_rows

__all__ = ["lora_mlp", "lora_mlp_reference", "LoRAMLPFunction", "ParkedTiles", "ACTIVATIONS"]

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


class ParkedTiles(Protocol):
    """Where a layer's first forward leaves each tile's gate/up outputs for its backward (module docstring)."""

    def put(self, e: torch.Tensor, g: torch.Tensor) -> None:
        """Keep ``e`` and ``g`` of the next tile (in tile order); the caller does not use them again."""

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(e, g)`` of the next tile, in the order they were put, on the compute device and writable;
        ``None`` when none is left (the backward then computes that tile's e and g)."""


def _tiles(rows: int, tile_rows: int):
    """``(start, stop)`` of each tile of ``tile_rows`` tokens out of ``rows``."""
    return [(a, min(a + tile_rows, rows)) for a in range(0, rows, tile_rows)]


class MLPRows(NamedTuple):
    """What :func:`_mlp_rows` computes for a run of tokens: the output (None without it), the gate and up
    outputs, and the gate/up adapter group and rank-space inputs (:func:`shared_input_forward`'s)."""

    y: torch.Tensor | None
    e: torch.Tensor
    g: torch.Tensor
    group: AdapterGroup | None
    low_rank: list[torch.Tensor | None]


def _mlp_rows(x2d, projs, activation, compute_output=True, parked=None, biases=(None, None, None)) -> MLPRows:
    """The forward of the module docstring for the tokens ``x2d`` (with the frozen ``biases`` of gate, up and
    down added to e, g and Y); e and g go to ``parked`` too when given."""
    gate, up, down = projs
    act_forward, _ = _activation_ops(activation)
    (e, g), group, low_rank = shared_input_forward(x2d, (gate, up), biases[:2])
    if parked is not None:
        parked.put(e, g)
    if not compute_output:
        return MLPRows(None, e, g, group, low_rank)
    h = act_forward(e, g)
    A, B = down.adapters(x2d.dtype)
    y = projection_forward(h, down, low_rank_input(h, down, A), B, bias=biases[2])
    return MLPRows(y, e, g, group, low_rank)


def _backward_rows(dy2d, x2d, e, g, projs, group, activation, need_dx, need_dA, need_dB, low_rank=None):
    """``(dX, [(dA, dB) of gate, up, down])`` of the tokens ``x2d`` from ``dY`` (the backward of the module
    docstring; overwrites ``e`` and ``g``). ``low_rank``: gate and up's rank-space inputs from the forward
    (:class:`MLPRows`), computed again when None. The down projection's ``s_d h A_d^T`` is computed from the
    ``h`` the backward rebuilds, as a deferred MLP must: kept or deferred, the same bits."""
    gate, up, down = projs
    _, act_backward_ = _activation_ops(activation)
    A_d, B_d = down.adapters(x2d.dtype)
    u_d = lora_rank_grad(dy2d, down, B_d)
    dh = accumulate_input_grad_(None, dy2d, down, u_d, A_d)
    h, de, dg = act_backward_(dh, e, g)
    down_grads = adapter_grads(dy2d, h, u_d, down, A_d, need_dA[2], need_dB[2])
    del h, dh, u_d
    dx, (gate_grads, up_grads) = shared_input_backward(
        [de, dg], x2d, (gate, up), group, need_dx, need_dA[:2], need_dB[:2], low_rank,
    )
    return dx, [gate_grads, up_grads, down_grads]


def _summed(total, grads):
    """The adapters' ``(dA, dB)`` pairs of two tiles added (``total`` is ``None`` for the first)."""
    if total is None:
        return grads
    return [tuple(None if a is None else a.add_(b) for a, b in zip(pair_total, pair))
            for pair_total, pair in zip(total, grads)]


class LoRAMLPFunction(torch.autograd.Function):
    """Autograd function of :func:`lora_mlp`: inputs ``x, projs, activation, compute_output, tile_rows, parked,
    biases, *autograd_tensors(projs)``."""

    @staticmethod
    def forward(ctx, x, projs, activation, compute_output, tile_rows, parked, biases, *tensors):
        x2d = flatten_tokens(x)
        ctx.biases = biases  # frozen: no gradient, read again by a deferred backward's gate/up
        if compute_output:
            y, e, g, group, low_rank = _mlp_rows(x2d, projs, activation, biases=biases)
            ctx.save_for_backward(x, e, g, *low_rank, *tensors)
            ctx.low_rank_count = len(low_rank)
        else:  # deferred (module docstring): the caller only back-propagates through Y
            y = x2d.new_zeros(1, projs[2].out_features).expand(x2d.shape[0], -1)  # no [N, H] of zeros
            group = None
            ctx.save_for_backward(x, *tensors)
        ctx.deferred = not compute_output
        ctx.parked = parked if ctx.deferred else None  # e, g of the first forward (module docstring)
        ctx.tile_rows = tile_rows
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
        saved = ctx.saved_tensors  # read once: under torch's non-reentrant checkpoint a second read raises
        x = saved[0]
        need_dx, _, _, _, _, _, _, *tensor_needs = ctx.needs_input_grad  # x, projs, activation, compute_output,
        # tile_rows, parked, biases
        need_dA, need_dB = requested_adapter_grads(tensor_needs)
        with no_autocast(x.device.type):
            x2d, dy2d = flatten_tokens(x), flatten_tokens(dy).to(x.dtype)
            if not ctx.deferred:
                e, g = saved[1:3]
                low_rank = saved[3:3 + ctx.low_rank_count]
                dx, grads = _backward_rows(dy2d, x2d, e, g, ctx.projs, ctx.group, ctx.activation,
                                           need_dx, need_dA, need_dB, low_rank)
            else:
                dx = torch.empty_like(x2d) if need_dx else None
                grads = None
                for a, b in _tiles(x2d.shape[0], ctx.tile_rows):
                    pair = ctx.parked.take() if ctx.parked is not None else None
                    if pair is not None:  # parked e, g: the rank-space inputs are computed in the backward
                        (e, g), group, low_rank = pair, adapter_group(ctx.projs[:2], x2d.dtype), None
                    else:
                        _, e, g, group, low_rank = _mlp_rows(x2d[a:b], ctx.projs, ctx.activation,
                                                             compute_output=False, biases=ctx.biases)
                    dx_tile, tile_grads = _backward_rows(dy2d[a:b], x2d[a:b], e, g, ctx.projs, group,
                                                         ctx.activation, need_dx, need_dA, need_dB, low_rank)
                    del e, g
                    if dx is not None:
                        dx[a:b].copy_(dx_tile)
                    grads = _summed(grads, tile_grads)
        ctx.parked = None
        return (dx.view(x.shape) if dx is not None else None), None, None, None, None, None, None, \
            *autograd_tensor_grads(grads)


def _forward_without_grad(x, projs, activation, compute_output, tile_rows, parked, biases, *tensors):
    """The forward a tile of tokens at a time, when nothing will be back-propagated (module docstring);
    each tile's e and g go to ``parked`` when given."""
    x2d = flatten_tokens(x)
    if x2d.shape[0] <= tile_rows:
        return _mlp_rows(x2d, projs, activation, parked=parked, biases=biases).y.view(*x.shape[:-1], -1)
    y = x2d.new_empty(x2d.shape[0], projs[2].out_features)
    for a, b in _tiles(x2d.shape[0], tile_rows):
        y[a:b] = _mlp_rows(x2d[a:b], projs, activation, parked=parked, biases=biases).y
    return y.view(*x.shape[:-1], -1)


def lora_mlp(
    x: torch.Tensor,
    gate: LoRAProjection,
    up: LoRAProjection,
    down: LoRAProjection,
    activation: str = "swiglu",
    compute_output: bool = True,
    tile_rows: int | None = None,
    parked: ParkedTiles | None = None,
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None,
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
            whose output value nobody reads: its backward then runs a tile of tokens at a time.
        tile_rows: tokens per tile of that backward and of a forward without autograd (default:
            :func:`notebookkit.sequence_tiles.mlp_tile_rows`, which the memory model reads too).
        parked: a layer's gate/up outputs between its first forward and its backward (module docstring):
            the forward without autograd puts each tile's ``(e, g)`` there, and the deferred backward
            (``compute_output=False``) of the same layer's recompute takes them instead of computing them.
        biases: the frozen base biases ``(b_gate, b_up, b_down)`` (any of them ``None``), added to e, g and Y
            (a vision tower's MLP: Qwen2.5-VL's). They get no gradient, so the backward is the same.

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
    if tile_rows is None:
        tile_rows = mlp_tile_rows(up.out_features, compute_dtype(x).itemsize)
    if tile_rows < 1:
        raise ValueError(f"lora_mlp: tile_rows must be >= 1 (got {tile_rows}).")
    biases = frozen_biases(biases, (gate, up, down), "lora_mlp", ("gate", "up", "down"))
    forward = LoRAMLPFunction if torch.is_grad_enabled() or not compute_output else _forward_without_grad
    return apply_in_compute_dtype(forward, x, (gate, up, down), activation, bool(compute_output), int(tile_rows),
                                  parked, biases)


def lora_mlp_reference(
    x: torch.Tensor,
    gate: LoRAProjection,
    up: LoRAProjection,
    down: LoRAProjection,
    activation: str = "swiglu",
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Plain PyTorch autograd composition of :func:`lora_mlp` (the test oracle)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}.")
    b_gate, b_up, b_down = biases or (None, None, None)

    def biased(y, bias):
        return y if bias is None else y + bias.to(y.dtype)

    e = biased(projection_reference(x, gate), b_gate)
    g = biased(projection_reference(x, up), b_up)
    return biased(projection_reference(_torch_act(activation, e) * g, down), b_down)
