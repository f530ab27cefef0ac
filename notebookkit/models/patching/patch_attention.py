"""Decoder self-attention instances -> fused projections, RoPE kernel and PyTorch SDPA.

For hidden states ``x`` of shape ``[B, T, H]`` the patched forward computes::

    Q, K, V = x Wq^T (+ s A_q^T B_q ...), x Wk^T ..., x Wv^T ...     kernels.lora_qkv (or the modules)
    Q, K    = q_norm(Q), k_norm(K)                                  Qwen3, Gemma3 (per head, RMSNorm)
    Q, K    = Q * cos + rotate_half(Q) * sin, same for K             kernels.apply_rope
    K, V    = cache.update(K, V)                                     generation with a KV cache
    S       = scaling * Q K^T  (+ soft-cap c * tanh(S / c): Gemma2)  masked, softmax, times V
              (+ a sink logit a head in the softmax's denominator: gpt-oss, kernels.attention_sinks)
    y       = O Wo^T (+ s A_o^T B_o)                                 kernels.lora_o (or o_proj)

``cos``/``sin`` come from the model's own rotary embedding, computed from ``position_ids`` (so they
already carry rope scaling such as Llama-3.1's and per-token positions of packed rows). The mask is
the one Hugging Face built for this layer (causal, padding, sliding window), or none for a plainly
causal forward (:func:`plain_causal_mask`), combined with a block-diagonal causal mask whenever
``position_ids`` restart inside a row (packed batches), so packed examples never attend to each
other; that mask is built once per forward (:func:`packed_mask_of_pass`). Scores go through
``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient backends on GPU)
except with a soft-cap, which SDPA cannot express: then an explicit fp32 softmax is used; with sinks,
:mod:`notebookkit.kernels.attention_sinks` (PyTorch's fused kernels plus a scale per row). A rotary embedding
that hands back half-width tables (gpt-oss) has them repeated to full width once a forward. Which SDPA
backend runs is PyTorch's choice unless ``NOTEBOOKKIT_SDPA_BACKEND`` names one to try first
(``cudnn``, ``flash`` or ``efficient``; the others stay as fall-backs).

Backward: SDPA's and the kernels' own autograd; nothing is hand-written here.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from notebookkit.base_layers.kernel_ops import kernel, require, why_missing
from notebookkit.base_layers.rebinding import rebind
from notebookkit.memory.grouped_kv import sdpa_repeats_kv

from . import forward_state
from .lora_fast_path import views

_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2] if p.isdigit()) >= (2, 5)


def plain_causal_mask(device: Any = None) -> torch.Tensor:
    """The mask a patched backbone passes for a plainly causal forward: a ``[0, 0, 0, 0]`` tensor.

    Hugging Face's mask builders (``create_causal_mask``, ``create_sliding_window_causal_mask``)
    return a 4-D ``attention_mask`` as it is, as an "already prepared" mask, before looking at the
    positions or the cache: so they build nothing and skip their check for packed rows (a host read
    of the positions, which waits for the GPU at the start of every forward). The patched attention
    reads this mask as plain causal attention (:func:`is_plain_causal`), which SDPA applies without
    a mask tensor (``is_causal``). A layer on Hugging Face's code would fail on it loudly, so the
    backbone passes it only when every decoder attention is notebookkit's.

    Why not the attention registries: masking_utils builds no mask for an implementation registered
    with ``AttentionInterface`` but not ``AttentionMaskInterface``, but the implementation is the
    config's, shared by every forward of the model (choosing it per forward means swapping the
    shared config again); one registered with ``AttentionMaskInterface`` has its positions checked
    for packed rows before its mask function runs (transformers 4.56 to 5.24). The mask argument is
    the only per-call way, and it reaches every layer of this forward only.
    """
    return torch.empty((0, 0, 0, 0), dtype=torch.bool, device=device)


def is_plain_causal(mask: Any) -> bool:
    """Whether ``mask`` is :func:`plain_causal_mask` (also after accelerate's hooks moved it to a layer's
    device: the check is by shape, no real mask has zero rows)."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.numel() == 0


def packed_mask_of_pass(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """The block-diagonal mask of ``position_ids`` (:func:`packed_causal_mask`), built once per forward.

    Inside a patched backbone's forward the pass keeps it for all its layers, and takes Hugging Face's
    own positions as unpacked without reading them (:meth:`forward_state.ForwardPass.packed_mask`).
    Outside one (a layer called on its own) it is built on every call.
    """
    forward = forward_state.current()
    if forward is None:
        return packed_causal_mask(position_ids)
    return forward.packed_mask(position_ids, packed_causal_mask)


def packed_causal_mask(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Block-diagonal causal mask ``[B, 1, T, T]`` (True = may attend) for packed rows, else ``None``.

    A new example starts wherever a position is not the previous one plus one (so rows whose
    positions restart at 0 split into segments); a query attends to earlier keys of its segment only.
    """
    pos = position_ids if position_ids.dim() == 2 else position_ids.reshape(1, -1)
    if pos.shape[-1] < 2:
        return None
    boundary = torch.ones_like(pos, dtype=torch.bool)
    boundary[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    segment = boundary.cumsum(-1)
    if bool((segment[:, -1] == 1).all()):
        return None
    T = pos.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=pos.device).tril()
    return ((segment[:, :, None] == segment[:, None, :]) & causal)[:, None]


def boolean_mask_of_pass(mask: Optional[torch.Tensor], q_len: int, kv_len: int) -> Optional[torch.Tensor]:
    """Hugging Face's layer mask as a boolean one (:func:`_as_bool_mask`), made once per mask tensor inside a
    patched backbone's forward (:meth:`forward_state.ForwardPass.boolean_mask`); outside one, on every call."""
    forward = forward_state.current()
    if forward is None or not isinstance(mask, torch.Tensor):
        return _as_bool_mask(mask, q_len, kv_len)
    return forward.boolean_mask(mask, (q_len, kv_len), lambda: _as_bool_mask(mask, q_len, kv_len))


def _as_bool_mask(mask: Optional[torch.Tensor], q_len: int, kv_len: int) -> Optional[torch.Tensor]:
    """Hugging Face's layer mask as a boolean ``[B, 1|H, q, kv]`` (True = may attend), or None."""
    if mask is None or not isinstance(mask, torch.Tensor):
        return None
    if mask.dim() == 2:  # flash-attention style [B, kv] padding mask
        pad = mask[:, None, None, :].bool()
        offset = kv_len - q_len
        causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril(diagonal=offset)
        return pad & causal
    if mask.dtype == torch.bool:
        return mask[..., :kv_len]
    return (mask > torch.finfo(mask.dtype).min / 2)[..., :kv_len]


@functools.lru_cache(maxsize=None)
def _preferred_backends(name: str) -> tuple:
    from torch.nn.attention import SDPBackend

    first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}.get(name)
    if first is None:
        raise ValueError(f"NOTEBOOKKIT_SDPA_BACKEND={name!r}: use 'cudnn', 'flash' or 'efficient', or unset it.")
    rest = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return (first, *[b for b in rest if b != first])


def _sdpa_backend(q: torch.Tensor):
    """Context choosing the SDPA backend order (``NOTEBOOKKIT_SDPA_BACKEND``), or a no-op."""
    name = os.environ.get("NOTEBOOKKIT_SDPA_BACKEND", "").strip().lower()
    if not name or not q.is_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    try:
        return sdpa_kernel(list(_preferred_backends(name)), set_priority=True)
    except TypeError:  # torch without set_priority: the listed backends, in PyTorch's order
        return sdpa_kernel(list(_preferred_backends(name)))


def repeats_kv(q: torch.Tensor, masked: bool) -> bool:
    """Whether :func:`attend` repeats grouped K/V for SDPA for queries ``q [B,H,T,D]`` on their device."""
    on_cuda = q.is_cuda
    capability = torch.cuda.get_device_capability(q.device) if on_cuda else (0, 0)
    return sdpa_repeats_kv(on_cuda=on_cuda, masked=masked, capability=capability, dtype_bytes=q.element_size(),
                           head_dim=q.shape[-1])


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    scaling: float,
    softcap: Optional[float] = None,
    dropout: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of ``q [B,Hq,T,D]`` over ``k, v [B,Hkv,S,D]``; ``mask`` boolean or None.

    ``mask=None`` means plain causal attention aligned to the end of the keys (a cache prefix
    before the queries is fully visible). Rows with no visible key (padding) attend to everything,
    so they stay finite; their outputs are never used. ``sinks`` ``[Hq]``: a sink logit a query head
    (gpt-oss), :mod:`notebookkit.kernels.attention_sinks` (its rows with no visible key give 0).
    """
    q_len, kv_len = q.shape[2], k.shape[2]
    n_rep = q.shape[1] // k.shape[1]
    if sinks is not None:
        attention_with_sinks = require("attention_sinks", "attention_with_sinks")
        return attention_with_sinks(q, k, v, sinks, scaling, mask, is_causal=mask is None and q_len > 1)
    if mask is not None:
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    if softcap is None:
        # enable_gqa skips materialising repeated K/V where SDPA's flash kernel takes it; elsewhere on
        # CUDA (a mask, a T4, fp32) it would fall back to the math kernel (memory/grouped_kv.py).
        use_gqa = _HAS_GQA and n_rep > 1 and not repeats_kv(q, masked=mask is not None)
        if not use_gqa:
            k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
        extra: dict[str, Any] = {"enable_gqa": True} if use_gqa else {}
        with _sdpa_backend(q):
            if mask is None:
                if q_len == 1:
                    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, **extra)
                if q_len == kv_len:
                    return F.scaled_dot_product_attention(
                        q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, **extra
                    )
                mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(diagonal=kv_len - q_len)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, **extra)
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None and q_len > 1:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(diagonal=kv_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout > 0:
        probs = F.dropout(probs, p=dropout, training=True)
    return torch.matmul(probs, v)


def full_width_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables ``[..., head_dim]`` for the rotate-half kernel. A rotary embedding that hands back half-width
    tables (gpt-oss: ``(x1 cos - x2 sin, x2 cos + x1 sin)`` on the two halves of a head) is the same rotation
    with each table repeated to full width, made once a forward pass (:meth:`forward_state.ForwardPass.rope_tables`)."""
    if cos.shape[-1] * 2 != head_dim:
        return cos, sin
    forward = forward_state.current()
    return forward.rope_tables(cos, sin, _repeated_tables) if forward is not None else _repeated_tables(cos, sin)


def _repeated_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def make_attention_forward(softcap: Optional[float], qk_norm: bool, sinks: bool = False):
    """The patched forward of one decoder self-attention module (``sinks``: its ``sinks`` parameter, a
    logit a query head, joins the softmax: gpt-oss)."""
    apply_rope = kernel("rope", "apply_rope")
    lora_qkv = kernel("lora_qkv", "lora_qkv")
    lora_o = kernel("lora_o", "lora_o")

    def attention_forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Any = None,
        cache_position: Optional[torch.Tensor] = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        cache = kwargs.pop("cache", None)
        if cache is None:
            cache = past_key_values
        bsz, q_len = hidden_states.shape[:2]
        head_dim = self.head_dim

        q = k = v = None
        if lora_qkv is not None:
            parts, _ = views(self.q_proj, self.k_proj, self.v_proj)
            if parts is not None:
                q, k, v = lora_qkv(hidden_states, parts[0].projection, parts[1].projection, parts[2].projection,
                                   biases=tuple(part.bias for part in parts))
        if q is None:
            q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)

        q = q.view(bsz, q_len, -1, head_dim)
        k = k.view(bsz, q_len, -1, head_dim)
        # V is saved for backward as it is (Q and K leave RoPE as new tensors). When it is a column block
        # of one q/k/v product (the grouped FP8 forward), it gets its own storage: a saved view would keep
        # the whole [N, O_q + O_k + O_v] product alive. No copy when it is already contiguous.
        v = v.contiguous().view(bsz, q_len, -1, head_dim).transpose(1, 2)
        if qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)

        cos, sin = position_embeddings
        q, k = apply_rope(q, k, *full_width_tables(cos, sin, head_dim))

        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, {"sin": sin, "cos": cos, "cache_position": cache_position})

        kv_len = k.shape[2]
        if is_plain_causal(attention_mask):
            mask = None
        elif sinks:  # saved for the backward: one per mask tensor for all the layers (forward_state)
            mask = boolean_mask_of_pass(attention_mask, q_len, kv_len)
        else:
            mask = _as_bool_mask(attention_mask, q_len, kv_len)
        position_ids = kwargs.get("position_ids")
        if isinstance(position_ids, torch.Tensor) and q_len == kv_len and q_len > 1:
            packed = packed_mask_of_pass(position_ids)
            if packed is not None:
                mask = packed if mask is None else mask & packed
        dropout = float(getattr(self, "attention_dropout", 0.0) or 0.0) if self.training else 0.0
        out = attend(q, k, v, mask, float(self.scaling), softcap=softcap, dropout=dropout,
                     sinks=self.sinks if sinks else None)
        out = out.transpose(1, 2).reshape(bsz, q_len, -1)

        if lora_o is not None:
            parts, _ = views(self.o_proj)
            if parts is not None:
                return lora_o(out, parts[0].projection, parts[0].bias), None
        return self.o_proj(out), None

    return attention_forward


def attention_ready(module: nn.Module, sinks: bool = False) -> Optional[str]:
    """None when this attention module can be patched, else the reason it cannot."""
    if kernel("rope", "apply_rope") is None:
        return "notebookkit.kernels.rope is unavailable"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx") + (("sinks",) if sinks else ()):
        if not hasattr(module, name):
            return f"{type(module).__name__} has no {name}"
    if not math.isfinite(float(module.scaling)):
        return "non-finite attention scaling"
    if sinks and (missing := why_missing("attention_sinks", "attention_with_sinks")):
        return missing
    if sinks and float(getattr(module, "attention_dropout", 0.0) or 0.0) > 0:
        return "attention dropout with sinks (the fused sink attention has no dropout)"
    return None


def patch_attention(module: nn.Module, softcap: Optional[float], qk_norm: bool, sinks: bool = False) -> None:
    """Rebind one self-attention instance."""
    rebind(module, make_attention_forward(softcap, qk_norm, sinks), "attention")
