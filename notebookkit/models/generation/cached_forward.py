"""One forward of a causal LM over the static KV cache: the prompt (prefill) and each decode step.

For ``T`` new tokens per row (``T = P`` for the prompt, ``T = 1`` per decode step) in slots
``start .. start + T - 1`` (:mod:`.cache_attention` for slots, positions and the mask)::

    h      = embed(ids)  (* sqrt(hidden) when the backbone scales: .decoder_plan.embedding_scale)
    per layer:
      x    = input_layernorm(h)                                   the model's own (patched) norm
      Q,K,V = x W^T + s (x A^T) B^T                                LoRA unmerged (.projections)
      Q,K  = q_norm(Q), k_norm(K)                                  Qwen3, Gemma 3
      Q,K  = rope(Q, K, cos[pos], sin[pos])                        the model's rotary tables, kernels.rope
      cache[slots] = K, V                                          .static_cache
      O    = attention(Q, cache[:kv_length], mask)                 soft-cap, sliding window, GQA, sinks
      a    = O Wo^T + s (O Ao^T) Bo^T   (post_attention_layernorm(a): sandwich norms, Gemma 2/3)
      h    = h + a
      m    = mlp(pre-MLP norm(h))       (post_feedforward_layernorm(m): sandwich norms; or the sparse block)
      h    = h + m
    logits = lm_head(norm(h[:, -1]))    (c * tanh(logits / c): final soft-cap, Gemma 2)

Only the last position reaches the norm and the LM head (``[B, V]``, never ``[B, T, V]``).

Fused on the way (forward only: decoding runs without gradients), each a kernel instead of several small ones:

* residual add + the norm after it, ``h = h + a; x = norm(h)`` (:mod:`notebookkit.kernels.add_rms_norm`), for
  the attention residual with the pre-MLP norm and for the MLP residual with the next layer's input norm,
  where the plan allows it (:class:`.decoder_plan.FusedNorm`: plain RMSNorms, no sandwich norms); the last
  layer's MLP residual with the final norm only when ``T == 1`` (a prompt
  normalises only its last position, as before);
* for one row (batch-1 decode), the adapters' rank-space inputs ``U = x A^T`` of the projections that read an op's
  output, made by that op's launch (:func:`.projections.rank_factor`): q/k/v's and gate/up's ``U_cat`` by the fused
  norm before them (:mod:`notebookkit.kernels.add_rms_norm_low_rank`), down's ``U`` by the gated activation
  (:mod:`notebookkit.kernels.gated_low_rank`); o's stays a thin product of its own (the attention before it is
  SDPA's);
* RoPE of q and k + the cache write of k and v, for the decode step (``T == 1``, device-tensor slot:
  :meth:`.static_cache.StaticKVCache.write_rotated`); the prompt keeps ``apply_rope`` and a slice copy.
  Qwen3 / Gemma 3's q/k norms come before RoPE and stay where they are; the fused kernel takes their outputs.

* the step's attention mask in the additive form SDPA would make of the boolean one in every layer
  (:func:`.cache_attention.slot_bias`, once a step: 31 kernels fewer a step for an 8B model; soft-capped and
  sink layers keep the boolean mask).

Each fused op is looked up like every kernel of the model layer: ``NOTEBOOKKIT_DISABLE_KERNELS=add_rms_norm,
rope_cache_write,add_rms_norm_low_rank,gated_low_rank`` (or a module that does not import) gives the unfused step,
computing the same function.

With ``start_slot`` a one-element device tensor and ``kv_length`` fixed, every shape is static and
nothing reads the device from the host, so the ``T = 1`` step can be captured as a CUDA graph
(:mod:`.graph_runner`). Adapters in fp32 next to 16-bit compute are read from casts kept between
steps (:class:`.projections.AdapterCasts`, re-cast here when an optimizer step changed them, never
while a graph is being captured).

The MLP is ``down(act(gate(x)) * up(x))`` with the training path's fused activation kernel and the
same projections as attention (so it reads the kept adapter casts and, for 4-bit weights, the NF4
matrix-vector kernel); an MLP whose projections the fused path cannot take (DoRA, 8-bit, ...) or whose
activation has no fused kernel runs the model's own module.

A mixture of experts' sparse block (Qwen3-MoE, gpt-oss: :class:`notebookkit.families.MoE`), for the
``N = B T`` tokens ``x [N, H]`` of the forward::

    z, w, idx = router(x)          the training path's fp32 routing (moe_routing.routed: the family's rule,
                                   norm_topk_prob for Qwen3-MoE, the router bias for gpt-oss)
    y_t = sum_j w[t, j] expert_{idx[t, j]}(x_t)
        expert_e(x) = (act(x Wgu_e^T + bgu_e + s (x Agu_e^T) Bgu_e^T)) Wd_e^T + bd_e + s (h Ad_e^T) Bd_e^T

through the training path's grouped expert kernel, :func:`notebookkit.kernels.moe_experts.moe_expert_mlp`
(its inputs from :func:`notebookkit.models.patching.patch_moe.experts_view`: the stacked weights, NF4 ones as
:class:`~notebookkit.kernels.nf4_stacked.NF4Stacked` views decoded tile by tile, gpt-oss's biases and its
clamped interleaved SwiGLU, PEFT's ``ParamWrapper`` adapters unmerged, read from the kept casts). Why that
kernel and not a gather of the ``k`` experts' weights per token: it already is the gather, done in its weight
loads: the ``B k`` (token, expert) pairs are sorted by expert on the device and each selected expert's weight
tiles are read once for all the rows that chose it (a gather copies ``B k`` whole experts per step, ``2 I H``
and ``I H`` elements each, and decodes NF4 ones to 16-bit first), nothing is computed for the unselected
experts (a dense ``[N, E]`` mix would read all ``E``), and it has NF4, biases, both activations and LoRA
already. Its schedule has static shapes (at most ``cdiv(B k, BLOCK_M) + E`` row blocks, the unused ones exit
at once) and is computed with sort / ``searchsorted``, never a host read, so the decode step stays capturable
as a CUDA graph. On the CPU the kernel's PyTorch reference runs (a loop over the selected experts, which reads
the indices on the host: fine, nothing is captured there). A block the kernel cannot take (DoRA or several
adapters on the experts, trainable experts, ...: ``experts_view``'s reason) runs the model's own module, whose
expert loop reads the routing on the host: that step is not captured, it runs eagerly (the graph runner says
so once); NF4 experts there raise, as in training (:func:`~notebookkit.models.patching.patch_moe.check_stock_experts`).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn

from notebookkit.base_layers.kernel_ops import kernel, require

from ..patching.moe_routing import routed
from ..patching.patch_mlp import activation_kernel
from ..patching.patch_moe import check_stock_experts, experts_view
from .cache_attention import cache_attention, slot_bias, slot_mask
from .decoder_plan import DecoderPlan, FusedNorm, LayerPlan
from .projections import AdapterCasts, fused_views, project, rank_factor
from .state import decoder_plan, generation_state
from .static_cache import StaticKVCache

__all__ = ["cached_forward"]


def cached_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    cache: StaticKVCache,
    start_slot: Union[int, torch.Tensor],
    pad_lengths: torch.Tensor,
    kv_length: Optional[int] = None,
    position_offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Logits ``[B, V]`` of the last position of ``input_ids`` ``[B, T]``, written into ``cache`` on the way.

    Args:
        model: a causal LM of a family in notebookkit's table (PEFT-wrapped or not; see
            :func:`~.decoder_plan.plan_for` for what is read).
        input_ids: the tokens of slots ``start_slot .. start_slot + T - 1`` of each row.
        cache: the :class:`~.static_cache.StaticKVCache` (its first ``B`` rows are used).
        start_slot: the first slot, a Python int (prefill: 0) or a one-element device tensor (the
            captured decode step, ``T == 1``).
        pad_lengths: ``[B]`` left padding of each row (slots before it are hidden from every query).
        kv_length: how many cache slots the attention reads (``>`` the last slot written); default
            the slots written so far for an int ``start_slot``, the whole cache for a tensor one.
        position_offsets: ``[B]`` added to each row's RoPE positions (``slot - pad + offset``): Qwen2.5-VL's
            ``rope_deltas`` after an image prompt, whose (t, h, w) grid positions advance slower than the
            slots; ``None`` adds nothing.
    """
    plan = decoder_plan(model)
    casts = generation_state(model).casts
    batch, length = input_ids.shape
    device = input_ids.device
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        casts.refresh()
    if isinstance(start_slot, torch.Tensor):
        query_slots = start_slot.reshape(1) + torch.arange(length, device=device) if length > 1 else start_slot.reshape(1)
        kv_length = cache.capacity if kv_length is None else kv_length
    else:
        query_slots = torch.arange(start_slot, start_slot + length, device=device)
        kv_length = start_slot + length if kv_length is None else kv_length
        if start_slot + length > kv_length:
            raise ValueError(f"cached_forward: slots up to {start_slot + length - 1} are written but kv_length={kv_length}.")
    if kv_length > cache.capacity or batch > cache.batch:
        raise ValueError(
            f"cached_forward: {batch} rows x {kv_length} slots do not fit the cache of {cache.batch} rows x "
            f"{cache.capacity} slots."
        )
    plan.rope.ensure(cache.capacity, plan.hidden_dtype(), device)
    positions = query_slots[None, :] - pad_lengths.reshape(-1, 1)  # [B, T]
    if position_offsets is not None:
        positions = positions + position_offsets.reshape(-1, 1)
    positions = positions.clamp_min(0)
    masks = {window: slot_mask(query_slots, kv_length, pad_lengths, window) for window in plan.windows}
    # a decode step's SDPA layers share the masks' additive form (module docstring)
    biases: dict = {}  # (window, query rows a key/value head) -> slot_bias, made at its first layer
    ropes = {key: plan.rope.lookup(key, positions) for key in {lp.rope_key for lp in plan.layers}}

    hidden = _embed(plan, input_ids)
    x = plan.layers[0].layer.input_layernorm(hidden)  # nothing is added before the first layer
    u_qkv = None  # x A_cat^T of the layer's q/k/v adapters, when the norm before them made it
    last = None
    for i, lp in enumerate(plan.layers):
        visible = masks[lp.window]
        if length == 1 and lp.softcap is None and lp.sinks is None:
            key = (lp.window, lp.heads // lp.kv_heads)
            if key not in biases:
                biases[key] = slot_bias(visible, plan.hidden_dtype(), key[1])
            visible = biases[key]
        attn_out = _attention(lp, x, cache, start_slot, kv_length, visible, ropes[lp.rope_key], casts, u_qkv)
        hidden, mlp_in, u_mlp = _add_and_norm(hidden, attn_out, lp.pre_mlp_norm, lp.mlp_norm, _mlp_inputs(lp), casts)
        mlp_out = _sparse_block(lp, mlp_in, casts) if lp.moe is not None else _mlp(lp, mlp_in, casts, u_mlp)
        if lp.sandwich:
            mlp_out = lp.layer.post_feedforward_layernorm(mlp_out)
        if i + 1 < len(plan.layers):
            following = plan.layers[i + 1]
            hidden, x, u_qkv = _add_and_norm(hidden, mlp_out, following.layer.input_layernorm, following.input_norm,
                                             _qkv(following), casts)
        elif length == 1:
            hidden, normed, _ = _add_and_norm(hidden, mlp_out, plan.final_norm, plan.final_fused)
            last = normed[:, -1]
        else:
            hidden = hidden + mlp_out
    logits = plan.lm_head(plan.final_norm(hidden[:, -1]) if last is None else last)
    if plan.final_softcap is not None:
        logits = torch.tanh(logits / plan.final_softcap) * plan.final_softcap
    return logits


def _add_and_norm(hidden: torch.Tensor, delta: torch.Tensor, norm: nn.Module, fused: Optional[FusedNorm],
                  readers: tuple = (), casts: Optional[AdapterCasts] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(h + a, norm(h + a), U_cat)``: one kernel when the plan fuses ``norm`` (module docstring), else the add and
    the model's own norm module. For one row whose ``readers`` (the projections that read the norm's output) share
    an ``A_cat`` (:func:`.projections.rank_factor`), the same launch gives ``U_cat = norm(h + a) A_cat^T``
    (:mod:`notebookkit.kernels.add_rms_norm_low_rank`); otherwise ``U_cat`` is ``None`` and :func:`.projections.project`
    computes it."""
    add_rms_norm = kernel("add_rms_norm", "add_rms_norm") if fused is not None else None
    if add_rms_norm is None:
        hidden = hidden + delta
        return hidden, norm(hidden), None
    weight = fused.module.weight
    one_row = hidden.numel() == hidden.shape[-1]
    with_low_rank = kernel("add_rms_norm_low_rank", "add_rms_norm_low_rank") if readers and one_row else None
    a_cat = rank_factor(readers, hidden.dtype, casts) if with_low_rank is not None else None
    supported = kernel("add_rms_norm_low_rank", "add_rms_norm_low_rank_supported")
    if a_cat is None or not supported(hidden, delta, weight, fused.flavour, a_cat):
        return (*add_rms_norm(hidden, delta, weight, fused.eps, flavour=fused.flavour), None)
    return with_low_rank(hidden, delta, weight, fused.eps, fused.flavour, a_cat)


def _qkv(lp: LayerPlan) -> tuple:
    """The projections that read a layer's input norm."""
    attn = lp.attn
    return attn.q_proj, attn.k_proj, attn.v_proj


def _mlp_inputs(lp: LayerPlan) -> tuple:
    """The projections that read a layer's pre-MLP norm on the fused MLP path (:func:`_mlp`), none otherwise."""
    mlp = lp.layer.mlp
    if lp.moe is not None or lp.activation is None or not hasattr(mlp, "gate_proj"):
        return ()
    return mlp.gate_proj, mlp.up_proj


def _embed(plan: DecoderPlan, input_ids: torch.Tensor) -> torch.Tensor:
    hidden = plan.embed(input_ids)
    if plan.embed_scale is not None:
        hidden = hidden * torch.tensor(plan.embed_scale, dtype=hidden.dtype)
    return hidden


def _attention(lp: LayerPlan, x: torch.Tensor, cache: StaticKVCache, start_slot: Union[int, torch.Tensor],
               kv_length: int, visible: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               casts: AdapterCasts, u_qkv: Optional[torch.Tensor] = None) -> torch.Tensor:
    batch, length, _ = x.shape
    attn = lp.attn
    q, k, v = project(x.reshape(batch * length, -1), _qkv(lp), casts, u_qkv)
    q = q.reshape(batch, length, lp.heads, lp.head_dim)
    k = k.reshape(batch, length, lp.kv_heads, lp.head_dim)
    v = v.reshape(batch, length, lp.kv_heads, lp.head_dim).transpose(1, 2)
    if lp.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = rope
    if length == 1 and isinstance(start_slot, torch.Tensor) and kernel("rope_cache_write", "rope_cache_write"):
        q = cache.write_rotated(lp.index, q.transpose(1, 2), k.transpose(1, 2), v, cos, sin, start_slot)
    else:
        q, k = require("rope", "apply_rope")(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        cache.write(lp.index, k, v, start_slot)
    keys, values = cache.read(lp.index, batch, kv_length)
    out = cache_attention(q, keys, values, visible, lp.scaling, lp.softcap, lp.sinks)
    (y,) = project(out.transpose(1, 2).reshape(batch * length, -1), (attn.o_proj,), casts)
    y = y.reshape(batch, length, -1)
    return lp.layer.post_attention_layernorm(y) if lp.sandwich else y


def _mlp(lp: LayerPlan, x: torch.Tensor, casts: AdapterCasts, u_cat: Optional[torch.Tensor] = None) -> torch.Tensor:
    mlp = lp.layer.mlp
    act = activation_kernel(lp.activation) if lp.activation is not None else None
    # the groups project() runs below: their views are the ones kept for it (lora_fast_path.views)
    if act is None or not (fused_views((mlp.gate_proj, mlp.up_proj)) and fused_views((mlp.down_proj,))):
        return mlp(x)
    x2d = x.reshape(-1, x.shape[-1])
    gate, up = project(x2d, (mlp.gate_proj, mlp.up_proj), casts, u_cat)
    h, u_down = _gate(lp, gate, up, casts, act)
    (y,) = project(h, (mlp.down_proj,), casts, u_down)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _gate(lp: LayerPlan, gate: torch.Tensor, up: torch.Tensor, casts: AdapterCasts,
          act) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(h, U)``: ``h = act(gate) * up`` and, for one row whose down projection has an adapter, ``U = h A_down^T`` from
    the same launch (:mod:`notebookkit.kernels.gated_low_rank`); else ``act``'s kernel and ``U`` ``None``
    (:func:`.projections.project` computes it)."""
    with_low_rank = kernel("gated_low_rank", "gated_low_rank") if gate.shape[0] == 1 else None
    a_down = rank_factor((lp.layer.mlp.down_proj,), gate.dtype, casts) if with_low_rank is not None else None
    supported = kernel("gated_low_rank", "gated_low_rank_supported")
    if a_down is None or not supported(gate, up, a_down, lp.activation):
        return act(gate, up), None
    return with_low_rank(gate, up, a_down, lp.activation)


def _sparse_block(lp: LayerPlan, x: torch.Tensor, casts: AdapterCasts) -> torch.Tensor:
    """A mixture of experts' sparse block over ``x [B, T, H]`` (module docstring)."""
    moe, block = lp.moe, lp.layer.mlp
    x2d = x.reshape(-1, x.shape[-1])
    _, weights, idx = routed(getattr(block, moe.router), x2d, moe.routing)
    experts = getattr(block, moe.experts)
    view, reason = experts_view(experts, moe, cast=lambda t: casts(t, x2d.dtype))
    if view is None:
        check_stock_experts(experts, reason)
        out = block(x)
        return out[0] if moe.returns_scores else out
    y = require("moe_experts", "moe_expert_mlp")(
        x2d, idx, weights, view.gate_up, view.down, view.gate_up_bias, view.down_bias, view.gate_up_lora,
        view.down_lora, activation=moe.activation, alpha=view.alpha, limit=view.limit)
    return y.reshape(x.shape)
