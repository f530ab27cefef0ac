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
      O    = attention(Q, cache[:kv_length], mask)                 soft-cap, sliding window, GQA
      a    = O Wo^T + s (O Ao^T) Bo^T   (post_attention_layernorm(a): sandwich norms, Gemma 2/3)
      h    = h + a
      m    = mlp(pre-MLP norm(h))       (post_feedforward_layernorm(m): sandwich norms)
      h    = h + m
    logits = lm_head(norm(h[:, -1]))    (c * tanh(logits / c): final soft-cap, Gemma 2)

Only the last position reaches the norm and the LM head (``[B, V]``, never ``[B, T, V]``).
With ``start_slot`` a one-element device tensor and ``kv_length`` fixed, every shape is static and
nothing reads the device from the host, so the ``T = 1`` step can be captured as a CUDA graph
(:mod:`.graph_runner`). Adapters in fp32 next to 16-bit compute are read from casts kept between
steps (:class:`.projections.AdapterCasts`, re-cast here when an optimizer step changed them, never
while a graph is being captured).

The MLP is ``down(act(gate(x)) * up(x))`` with the training path's fused activation kernel and the
same projections as attention (so it reads the kept adapter casts and, for 4-bit weights, the NF4
matrix-vector kernel); an MLP whose projections the fused path cannot take (DoRA, 8-bit, ...) or whose
activation has no fused kernel runs the model's own module.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn

from notebookkit.base_layers.kernel_ops import require

from ..patching.patch_mlp import activation_kernel
from .cache_attention import cache_attention, slot_mask
from .decoder_plan import DecoderPlan, LayerPlan
from .projections import AdapterCasts, fused_views, project
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
    ropes = {key: plan.rope.lookup(key, positions) for key in {lp.rope_key for lp in plan.layers}}

    hidden = _embed(plan, input_ids)
    for lp in plan.layers:
        x = lp.layer.input_layernorm(hidden)
        hidden = hidden + _attention(lp, x, cache, start_slot, kv_length, masks[lp.window], ropes[lp.rope_key],
                                     casts)
        mlp_out = _mlp(lp, lp.pre_mlp_norm(hidden), casts)
        if lp.sandwich:
            mlp_out = lp.layer.post_feedforward_layernorm(mlp_out)
        hidden = hidden + mlp_out
    logits = plan.lm_head(plan.final_norm(hidden[:, -1]))
    if plan.final_softcap is not None:
        logits = torch.tanh(logits / plan.final_softcap) * plan.final_softcap
    return logits


def _embed(plan: DecoderPlan, input_ids: torch.Tensor) -> torch.Tensor:
    hidden = plan.embed(input_ids)
    if plan.embed_scale is not None:
        hidden = hidden * torch.tensor(plan.embed_scale, dtype=hidden.dtype)
    return hidden


def _attention(lp: LayerPlan, x: torch.Tensor, cache: StaticKVCache, start_slot: Union[int, torch.Tensor],
               kv_length: int, visible: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               casts: AdapterCasts) -> torch.Tensor:
    batch, length, _ = x.shape
    attn = lp.attn
    q, k, v = project(x.reshape(batch * length, -1), (attn.q_proj, attn.k_proj, attn.v_proj), casts)
    q = q.reshape(batch, length, lp.heads, lp.head_dim)
    k = k.reshape(batch, length, lp.kv_heads, lp.head_dim)
    v = v.reshape(batch, length, lp.kv_heads, lp.head_dim).transpose(1, 2)
    if lp.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = rope
    q, k = require("rope", "apply_rope")(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    cache.write(lp.index, k, v, start_slot)
    keys, values = cache.read(lp.index, batch, kv_length)
    out = cache_attention(q, keys, values, visible, lp.scaling, lp.softcap)
    (y,) = project(out.transpose(1, 2).reshape(batch * length, -1), (attn.o_proj,), casts)
    y = y.reshape(batch, length, -1)
    return lp.layer.post_attention_layernorm(y) if lp.sandwich else y


def _mlp(lp: LayerPlan, x: torch.Tensor, casts: AdapterCasts) -> torch.Tensor:
    mlp = lp.layer.mlp
    act = activation_kernel(lp.activation) if lp.activation is not None else None
    if act is None or not fused_views((mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        return mlp(x)
    x2d = x.reshape(-1, x.shape[-1])
    gate, up = project(x2d, (mlp.gate_proj, mlp.up_proj), casts)
    (y,) = project(act(gate, up), (mlp.down_proj,), casts)
    return y.reshape(*x.shape[:-1], y.shape[-1])
