"""Attention with a learned sink logit per query head (gpt-oss) on PyTorch's fused attention kernels, forward
and backward, never forming the ``[B, H, T, S]`` scores.

Math. For query ``i`` of head ``h``, scores ``S_ij = scale q_i . k_j`` over the keys ``j`` it may attend,
``Z_i = sum_j exp(S_ij)`` and ``lse_i = log Z_i``, the sink ``c_h`` joins the softmax's denominator and carries
no value (Hugging Face's eager ``softmax(cat([S, c]))[..., :-1] V``)::

    O^s_i = sum_j exp(S_ij) v_j / (Z_i + exp(c_h)) = g_i O_i,     g_i = Z_i / (Z_i + exp(c_h)) = sigmoid(lse_i - c_h)

with ``O_i`` plain attention's output. The forward is one fused attention call that also returns ``lse``
(PyTorch's flash kernel on a CPU; its memory-efficient kernel on CUDA, which runs on sm_50 and newer, a T4
included), then a scale per row.

Backward, with ``dO^s`` arriving::

    dO_i   = g_i dO^s_i                                   (into plain attention)
    dlse_i = g_i (1 - g_i) (dO^s_i . O_i)
    dc_h   = - sum_{b, i} (1 - g_i) (dO^s_i . O^s_i)

The kernels' backward forms ``dS_ij = P_ij (dO_i . v_j - D_i)`` with ``D_i = dO_i . out_i`` from the ``out``
it is handed, and the ``lse`` term adds ``dlse_i P_ij``: the same as ``D_i`` becoming ``D_i - dlse_i =
g_i^2 (dO^s_i . O_i)``. Handing the kernel ``out = O^s = g O`` beside ``dO = g dO^s`` gives exactly that ``D``,
so ``dq``, ``dk``, ``dv`` are one call of the kernel's own backward; the sink's gradient is a row sum.

Masks: ``mask`` ``[B, 1 or H, T, S]`` boolean (True: may attend), or ``None`` for plainly causal attention
(``is_causal``; with ``T < S``, a chunk at the end of a cache, aligned to the last key) or none at all. A query
row that may attend no key (a left-padded row) gets ``O^s = 0`` and no gradient, as in the eager attention,
whose sink then takes all the weight: the kernel sees that row open to every key and its ``g`` is 0.

Grouped keys (``Hkv < H``): key/value head ``g`` serves query heads ``g r .. g r + r - 1`` (Hugging Face's
``repeat_kv``); the kernels take equal head counts, so ``k``, ``v`` are repeated for the call (again in the
backward, not saved) and their gradients summed over each group.

dtypes: q, k, v in fp16, bf16 or fp32 (the kernels accumulate in fp32); ``g`` and the sink's gradient in fp32,
returned in the sink's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["attention_with_sinks", "attention_with_sinks_reference"]

_BIAS_ALIGNMENT = 16  # the memory-efficient kernel reads an additive bias whose rows start 16-element aligned


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float,
                         mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
    """``O^s`` ``[B, H, T, D]`` (module docstring) for ``q`` ``[B, H, T, D]``, ``k``, ``v`` ``[B, Hkv, S, D]``,
    ``sinks`` ``[H]``; ``mask`` boolean ``[B, 1 or H, T, S]`` (True: may attend) or ``None`` (``is_causal``)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not split into groups of {k.shape[1]} key/value heads.")
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"attention_with_sinks takes a boolean mask (True: may attend), not {mask.dtype}.")
    return _AttentionWithSinks.apply(q, k, v, sinks, float(scale), mask, bool(is_causal))


def attention_with_sinks_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                                   scale: float, mask: Optional[torch.Tensor] = None,
                                   is_causal: bool = False) -> torch.Tensor:
    """The same in plain PyTorch ops, scores in fp32 (the tests' oracle)."""
    rep = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(rep, dim=1).float(), v.repeat_interleave(rep, dim=1).float()
    scores = torch.matmul(q.float(), keys.transpose(2, 3)) * scale
    allowed = _allowed(mask, is_causal, q.shape[2], k.shape[2], q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.float().reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, values).to(q.dtype)


def _allowed(mask: Optional[torch.Tensor], is_causal: bool, length: int, kv_length: int,
             device: torch.device) -> Optional[torch.Tensor]:
    """The boolean mask a call means (``is_causal``: query ``i`` sees keys up to ``i + kv_length - length``)."""
    if mask is not None or not is_causal:
        return mask
    return torch.ones(length, kv_length, dtype=torch.bool, device=device).tril(kv_length - length)


def _repeat(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _kernel_mask(mask: Optional[torch.Tensor], q: torch.Tensor, kv_length: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(the additive bias the kernel reads, ``[B, H, T, S]`` or ``None``; the rows that may attend no key,
    ``[B, 1 or H, T]`` or ``None``). The bias is ``0`` / ``-inf`` in q's dtype, empty rows opened to every key,
    expanded over the heads as the kernel reads it."""
    if mask is None:
        return None, None
    empty = ~mask.any(dim=-1)
    opened = mask | empty[..., None]
    bias = _zeros_bias(opened.shape[:-1], kv_length, q).masked_fill_(~opened, float("-inf"))
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], kv_length), empty


def _zeros_bias(rows: torch.Size, kv_length: int, q: torch.Tensor) -> torch.Tensor:
    """A zero bias ``[*rows, kv_length]`` in q's dtype; on CUDA each row starts ``_BIAS_ALIGNMENT``-aligned (a
    wider buffer, sliced), as the memory-efficient kernel reads it."""
    width = -(-kv_length // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT if q.is_cuda else kv_length
    return torch.zeros(*rows, width, dtype=q.dtype, device=q.device)[..., :kv_length]


def _fused_forward(q, k, v, bias, is_causal: bool, scale: float):
    """(output ``[B, H, T, D]``, lse as the kernel keeps it, the random state its CUDA backward takes)."""
    if q.is_cuda:
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, is_causal, scale=scale)
        return out, lse, (seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale)
    return out, lse, ()


def _fused_backward(d_out, q, k, v, out, lse, bias, seeds, is_causal: bool, scale: float):
    """(dq, dk, dv) of the kernel's own backward."""
    if q.is_cuda:
        if bias is None:  # this backward takes a bias tensor: none is all zeros
            bias = _zeros_bias((1, 1, 1), k.shape[2], q).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            d_out, q, k, v, bias, out, lse, *seeds, 0.0, [True, True, True, False], is_causal, scale=scale)
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        d_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale)


def _row_scale(lse: torch.Tensor, length: int, sinks: torch.Tensor, empty: Optional[torch.Tensor]) -> torch.Tensor:
    """``g = sigmoid(lse - c)`` ``[B, H, T]`` in fp32, 0 on rows that may attend no key."""
    g = torch.sigmoid(lse[..., :length].float() - sinks.float().reshape(1, -1, 1))
    return g if empty is None else g.masked_fill(empty, 0.0)


def _scaled_rows(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``g x`` row by row, computed in fp32 and rounded once to ``x``'s dtype, in a ``[B, T, H, D]`` storage
    (a projection's layout: the o projection reads it as ``[B, T, H D]`` without a copy)."""
    batch, heads, length, head_dim = x.shape
    out = x.new_empty(batch, length, heads, head_dim).transpose(1, 2)
    return torch.mul(x, g[..., None], out=out)


class _AttentionWithSinks(torch.autograd.Function):
    """Saved for the backward: q, k, v (not repeated), ``O^s``, the kernel's lse and the boolean mask; the bias,
    ``g`` and the repeated k, v are made again there."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, scale, mask, is_causal):
        rep, length, kv_length = q.shape[1] // k.shape[1], q.shape[2], k.shape[2]
        if mask is None and is_causal and length != kv_length:  # the kernels align a causal mask to the first key
            mask, is_causal = _allowed(None, True, length, kv_length, q.device)[None, None], False
        bias, empty = _kernel_mask(mask, q, kv_length)
        out, lse, seeds = _fused_forward(q, _repeat(k, rep), _repeat(v, rep), bias, is_causal, scale)
        sinked = _scaled_rows(out, _row_scale(lse, length, sinks, empty))
        ctx.save_for_backward(q, k, v, sinks, sinked, lse, mask, *seeds)
        ctx.scale, ctx.is_causal, ctx.rep = scale, is_causal, rep
        return sinked

    @staticmethod
    def backward(ctx, d_sinked):
        q, k, v, sinks, sinked, lse, mask, *seeds = ctx.saved_tensors
        rep, length = ctx.rep, q.shape[2]
        bias, empty = _kernel_mask(mask, q, k.shape[2])
        g = _row_scale(lse, length, sinks, empty)
        d_out = torch.mul(d_sinked, g[..., None], out=torch.empty_like(sinked))  # dO = g dO^s, in O^s's layout
        dq, dk, dv = _fused_backward(d_out, q, _repeat(k, rep), _repeat(v, rep), sinked, lse, bias, seeds,
                                     ctx.is_causal, ctx.scale)
        del d_out, bias
        if rep > 1:
            dk = dk.reshape(k.shape[0], k.shape[1], rep, *k.shape[2:]).sum(2)
            dv = dv.reshape(v.shape[0], v.shape[1], rep, *v.shape[2:]).sum(2)
        d_sinks = None
        if ctx.needs_input_grad[3]:  # frozen in LoRA training: only a trained sink pays for these row sums
            rows = (d_sinked.float() * sinked.float()).sum(-1)  # dO^s . O^s  [B, H, T]
            d_sinks = -((1.0 - g) * rows).sum(dim=(0, 2)).to(sinks.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), d_sinks, None, None, None
