"""Attention of new queries over the static KV cache, with the mask of a left-padded batch.

Slots and positions (see :mod:`.static_cache`): row ``b``'s prompt occupies slots ``pad[b] .. P - 1``
of a batch padded on the left to ``P`` columns; the token of step ``t`` sits in slot ``t`` and has
position ``t - pad[b]``. A query in slot ``q`` may see slot ``s`` when::

    pad[b] <= s <= q   and   s > q - W   (sliding-window layers of window W; HF's rule)

or when ``s == q`` (itself): a padding query (``q < pad[b]``) then still sees one slot, so its
softmax stays finite; nothing real ever reads its output, since every real query hides slots
``< pad[b]``. Slots ``> q`` (not yet written, or stale from an earlier request) are hidden.

One decode step (``T = 1``), grouped-query attention without repeating keys: the ``rep = Hq / Hkv``
query heads that share a key/value head are laid out as ``rep`` query rows of that head,
``Q [B, Hq, 1, D] -> [B, Hkv, rep, D]``, and the step's mask row serves all of them (a broadcast view).
Then::

    S = scaling * Q K^T                          [B, Hkv, rep, kv_length]
    S = c * tanh(S / c)                          attention soft-cap (Gemma 2), explicit fp32 softmax
    O = softmax(S masked) V                      PyTorch SDPA when there is no soft-cap

The prompt (``T > 1``) runs the training path's attention
(:func:`notebookkit.models.patching.patch_attention.attend`: the same scores, the mask broadcast over heads),
so a long prompt never materialises a mask per query head.

Attention sinks (gpt-oss: a learned logit ``sink_h`` per query head, ``sinks``), prompt and decode step
alike: the sink is one more entry in the softmax's denominator that carries no value, so every visible
slot ``s`` of head ``h`` gets::

    p_s = exp(S_s - m) / ( sum_{s' visible} exp(S_s' - m) + exp(sink_h - m) ),   m = max(max_s' S_s', sink_h)
    O   = sum_s p_s V_s                                (the weights sum to less than 1: the rest is the sink's)

in fp32 (Hugging Face's eager ``softmax(cat([S, sink]))[..., :-1]``, without the concatenation). SDPA has
no such term, so this path forms the scores explicitly, ``[B, Hq, T, kv_length]`` in fp32 (as Hugging
Face's eager attention, gpt-oss's only implementation besides flex / flash kernels with sinks), with the
query heads grouped onto their key/value head (no repeated K/V). gpt-oss's alternating sliding window needs
nothing more: each layer's ``window`` (``None`` on its full-attention layers) picks its mask
(:func:`slot_mask`, Hugging Face's rule ``s > q - W``).

Everything has static shapes for a fixed ``kv_length`` and reads the step's slot from a device
tensor, so the decode step can be captured as a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..patching.patch_attention import attend

__all__ = ["slot_mask", "slot_bias", "cache_attention", "sink_attention"]


def slot_mask(query_slots: torch.Tensor, kv_length: int, pad_lengths: torch.Tensor,
              window: Optional[int]) -> torch.Tensor:
    """Boolean ``[B, 1, T, kv_length]`` mask (True = may attend) for queries in ``query_slots`` ``[T]``.

    ``pad_lengths`` ``[B]``: left padding of each row; ``window``: sliding window of the layer, or
    ``None`` for full causal attention (see the module docstring for the rule).
    """
    slots = torch.arange(kv_length, device=query_slots.device)
    query = query_slots.reshape(-1, 1)  # [T, 1]
    visible = slots <= query
    if window is not None:
        visible = visible & (slots > query - window)
    visible = visible & (slots >= pad_lengths.reshape(-1, 1, 1))  # [B, T, S]
    visible = visible | (slots == query)
    return visible[:, None]


def slot_bias(visible: torch.Tensor, dtype: torch.dtype, rep: int) -> torch.Tensor:
    """The additive form of a decode step's :func:`slot_mask` ``[B, 1, 1, S]`` (0 where visible, ``-inf``
    elsewhere) in ``dtype``, for the ``rep`` query rows of a key/value head: ``[B, 1, rep, S]``, the tensor SDPA
    makes of the boolean mask in every layer (one kernel a layer), made once a step and shared by the layers."""
    batch, _, _, kv_length = visible.shape
    bias = torch.zeros((batch, 1, rep, kv_length), dtype=dtype, device=visible.device)
    return bias.masked_fill_(~visible, float("-inf"))


def cache_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scaling: float,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, Hq, T, D]`` over cached ``keys``/``values`` ``[B, Hkv, S, D]``.

    ``visible``: the boolean ``[B, 1, T, S]`` mask of :func:`slot_mask`, or for a decode step (``T = 1``)
    without soft-cap or sinks its additive form (:func:`slot_bias`); ``scaling``: the score
    scale (``head_dim ** -0.5``, or ``query_pre_attn_scalar ** -0.5`` for Gemma 2/3); ``softcap``:
    ``c`` of ``c * tanh(S / c)`` on the scores, or ``None``; ``sinks``: ``[Hq]`` sink logits (gpt-oss,
    module docstring), or ``None``. Returns ``[B, Hq, T, D]``.
    """
    if visible.dtype != torch.bool and (sinks is not None or softcap is not None or q.shape[2] > 1):
        raise ValueError("cache_attention: an additive mask (slot_bias) is for a decode step without soft-cap or "
                         "sinks; pass the boolean slot_mask.")
    if sinks is not None:
        return sink_attention(q, keys, values, visible, scaling, sinks, softcap)
    batch, heads, length, head_dim = q.shape
    if length > 1:
        return attend(q, keys, values, visible, scaling, softcap=softcap)
    kv_heads, kv_length = keys.shape[1], keys.shape[2]
    rep = heads // kv_heads
    q = q.reshape(batch, kv_heads, rep, head_dim)
    mask = visible.expand(batch, 1, rep, kv_length)
    if mask.dtype != torch.bool and mask.dtype != q.dtype:  # SDPA takes an additive mask in the query's dtype
        mask = mask.to(q.dtype)
    if softcap is None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    else:
        scores = torch.matmul(q, keys.transpose(2, 3)) * scaling
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, values)
    return out.reshape(batch, heads, 1, head_dim)


def sink_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scaling: float,
                   sinks: torch.Tensor, softcap: Optional[float] = None) -> torch.Tensor:
    """:func:`cache_attention` with a sink logit a query head (module docstring): ``q [B, Hq, T, D]``,
    ``keys``/``values`` ``[B, Hkv, S, D]``, ``visible [B, 1, T, S]``, ``sinks [Hq]``; static shapes, no host read."""
    batch, heads, length, head_dim = q.shape
    kv_heads, kv_length = keys.shape[1], keys.shape[2]
    rep = heads // kv_heads
    # query head h = g rep + i reads key/value head g: its T rows become rows i T .. i T + T - 1 of group g
    qg = q.reshape(batch, kv_heads, rep * length, head_dim)
    scores = torch.matmul(qg, keys.transpose(2, 3)).float() * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = visible[:, :, None].expand(batch, 1, rep, length, kv_length).reshape(batch, 1, rep * length, kv_length)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().reshape(1, kv_heads, rep, 1).expand(1, kv_heads, rep, length).reshape(1, kv_heads, -1, 1)
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)  # finite: every query sees its own slot
    weights = torch.exp(scores - top)
    probs = weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top))
    out = torch.matmul(probs.to(values.dtype), values)
    return out.reshape(batch, heads, length, head_dim)
