"""Attention of one decode step over the KV cache, split along the cache's slots (flash-decoding).

For row ``b``, key/value head ``g`` and the ``R = Hq / Hkv`` query heads grouped on it (query rows ``r``),
over the ``S`` cache slots with the step's additive mask ``bias[b, s]`` (0 where the slot is visible,
``-inf`` where it is hidden: :func:`notebookkit.models.generation.cache_attention.slot_bias`)::

    z[r, s] = scale * q[r] . k[s] + bias[s]                                fp32
    o[r]    = sum_s exp(z[r, s] - m[r]) v[s]  /  sum_s exp(z[r, s] - m[r]),    m[r] = max_s z[r, s]

A decode step has one query a row, so PyTorch's SDPA runs one program per (row, key/value head): eight
programs for an 8B model at batch 1, each reading all ``S`` slots, on a GPU of more than a hundred SMs.
Here the slots are cut into ``P`` splits of ``C`` slots and program ``(b g, p)`` computes, for its split
(the online softmax over tiles of ``BLOCK_S`` slots)::

    m_p[r] = max_{s in p} z[r, s],   l_p[r] = sum_{s in p} exp(z[r, s] - m_p[r]),
    a_p[r] = sum_{s in p} exp(z[r, s] - m_p[r]) v[s]                       fp32, stored

and a second launch combines the splits in a fixed order (the same result every run)::

    m = max_p m_p,   o = sum_p exp(m_p - m) a_p  /  sum_p exp(m_p - m) l_p      rounded once to q's dtype

A split whose slots are all hidden has ``m_p = -inf`` and contributes nothing (its exponentials are taken
against 0 instead). Every query sees at least its own slot, so ``m`` is finite. The products
``q k^T`` and ``p V`` run on the tensor cores (``tl.dot``, fp32 sums); the probabilities are rounded to
the cache's dtype before ``p V``, as flash attention does. The query rows are padded to 16 (``tl.dot``'s
smallest size).

Graph-safe: static shapes for a fixed ``S``, no host reads; the only allocations are the output and the
splits' fp32 partial sums. No backward: decoding runs without gradients; under autograd, on the CPU, or
for a soft-capped or sink layer the caller keeps PyTorch's attention (:func:`decode_attention_reference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from notebookkit.kernels.runtime import should_use_triton, sm_count

__all__ = ["decode_attention", "decode_attention_reference", "decode_attention_splits", "AOT_SPECS"]

_BLOCK_R = 16  # query rows of a program, padded (tl.dot's smallest size)
_BLOCK_S = 64  # cache slots a loop step
_MAX_SPLITS = 64


@triton.jit
def _split_kernel(
    Q, K, V, BIAS, PART_A, PART_ML,
    R, S, slots_per_split, scale,
    sq_b, sq_g, sq_r, sk_b, sk_g, sk_s, sv_b, sv_g, sv_s, sbias_b,
    n_kv_heads, n_splits,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program ``(b g, p)``: ``m_p``, ``l_p`` and ``a_p`` of its split (module docstring), fp32."""
    bg = tl.program_id(0)
    split = tl.program_id(1)
    b = (bg // n_kv_heads).to(tl.int64)
    g = (bg % n_kv_heads).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < R
    d_ok = d < D
    q = tl.load(Q + b * sq_b + g * sq_g + r[:, None] * sq_r + d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                other=0.0)
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    first = split * slots_per_split
    last = tl.minimum(first + slots_per_split, S)
    for start in range(first, last, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        s_ok = s < last
        k = tl.load(K + b * sk_b + g * sk_g + s[:, None] * sk_s + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0)
        bias = tl.load(BIAS + b * sbias_b + s, mask=s_ok, other=float("-inf")).to(tl.float32)
        z = tl.dot(q, tl.trans(k)) * scale + bias[None, :]  # [BLOCK_R, BLOCK_S]
        m_new = tl.maximum(m, tl.max(z, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile hidden so far: exp(-inf) = 0, no NaN
        p = tl.exp(z - shift[:, None])
        rescale = tl.exp(m - shift)
        l = l * rescale + tl.sum(p, axis=1)
        v = tl.load(V + b * sv_b + g * sv_g + s[:, None] * sv_s + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    row = bg * n_splits + split
    tl.store(PART_A + (row * BLOCK_R + r[:, None]) * BLOCK_D + d[None, :], acc)
    tl.store(PART_ML + (row * BLOCK_R + r) * 2, m)
    tl.store(PART_ML + (row * BLOCK_R + r) * 2 + 1, l)


@triton.jit
def _combine_kernel(
    PART_A, PART_ML, OUT, R, n_kv_heads, n_splits, so_b, so_g, so_r,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Program ``b g``: the splits' sums combined in order and rounded once (module docstring)."""
    bg = tl.program_id(0)
    b = (bg // n_kv_heads).to(tl.int64)
    g = (bg % n_kv_heads).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    p = tl.arange(0, BLOCK_P)
    p_ok = p < n_splits
    rows = bg * n_splits + p  # [BLOCK_P]
    ml = PART_ML + (rows[:, None] * BLOCK_R + r[None, :]) * 2
    m_p = tl.load(ml, mask=p_ok[:, None], other=float("-inf"))  # [BLOCK_P, BLOCK_R]
    l_p = tl.load(ml + 1, mask=p_ok[:, None], other=0.0)
    m = tl.max(m_p, axis=0)  # [BLOCK_R]
    shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(m_p - shift[None, :])  # [BLOCK_P, BLOCK_R]: a hidden split weighs 0
    total = tl.sum(w * l_p, axis=0)
    out = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for i in range(0, n_splits):  # in split order: the same sum every run
        w_i = tl.sum(tl.where(p[:, None] == i, w, 0.0), axis=0)  # [BLOCK_R]
        a = tl.load(PART_A + ((bg * n_splits + i) * BLOCK_R + r[:, None]) * BLOCK_D + d[None, :])
        out += w_i[:, None] * a
    out = out / tl.where(total == 0.0, 1.0, total)[:, None]
    r_ok = r < R
    tl.store(OUT + b * so_b + g * so_g + r[:, None] * so_r + d[None, :], out.to(OUT.dtype.element_ty),
             mask=r_ok[:, None] & (d < D)[None, :])


def decode_attention_splits(rows_heads: int, slots: int, sms: int) -> int:
    """Splits along the slots: enough programs for two per SM, each at least ``_BLOCK_S`` slots, at most
    ``_MAX_SPLITS`` (a power of two)."""
    splits = 1
    while splits < _MAX_SPLITS and rows_heads * splits < 2 * sms and slots > splits * _BLOCK_S:
        splits *= 2
    return splits


def _check(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> None:
    if q.dim() != 4 or keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(f"decode_attention: q [B, Hkv, R, D] and keys, values [B, Hkv, S, D] expected; got q "
                         f"{tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}.")
    batch, kv_heads, rows, head_dim = q.shape
    if keys.shape[0] != batch or keys.shape[1] != kv_heads or keys.shape[3] != head_dim:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} and keys {tuple(keys.shape)} must share batch, "
                         "key/value heads and head_dim.")
    if rows > _BLOCK_R:
        raise ValueError(f"decode_attention: at most {_BLOCK_R} query heads a key/value head, got {rows}.")
    if bias.shape != (batch, keys.shape[2]) or not bias.is_floating_point():
        raise ValueError(f"decode_attention: bias must be the additive mask [B, S] = [{batch}, {keys.shape[2]}] "
                         f"(0 visible, -inf hidden), got {tuple(bias.shape)} {bias.dtype}.")


def decode_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Plain PyTorch (SDPA with the additive mask), the CPU path and the tests' oracle; same arguments as
    :func:`decode_attention`."""
    _check(q, keys, values, bias)
    mask = bias[:, None, None, :].to(q.dtype)
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One decode step's attention, the query heads grouped on their key/value head (module docstring).

    Args:
        q: ``[B, Hkv, R, D]``, the ``R`` query heads of each key/value head (at most 16), unit last stride.
        keys, values: the cache's ``[B, Hkv, S, D]`` (views of a longer cache are fine), unit last stride.
        bias: ``[B, S]`` additive mask, 0 where a slot is visible and ``-inf`` where hidden (any float dtype).
        scale: the score scale (``head_dim ** -0.5``, or the family's).

    Returns:
        ``[B, Hkv, R, D]`` in ``q``'s dtype. CUDA tensors run the two Triton launches, CPU tensors and inputs
        under autograd the reference.
    """
    _check(q, keys, values, bias)
    differentiating = torch.is_grad_enabled() and any(t.requires_grad for t in (q, keys, values))
    if not should_use_triton(q) or differentiating:
        return decode_attention_reference(q, keys, values, bias, scale)
    for t in (q, keys, values, bias):
        if t.stride(-1) != 1:
            raise ValueError("decode_attention: every input needs a unit last stride.")
    batch, kv_heads, rows, head_dim = q.shape
    slots = keys.shape[2]
    out = torch.empty_like(q)
    if batch == 0 or rows == 0:
        return out
    splits = decode_attention_splits(batch * kv_heads, slots, sm_count(q.device))
    per_split = triton.cdiv(triton.cdiv(slots, splits), _BLOCK_S) * _BLOCK_S
    splits = triton.cdiv(slots, per_split)
    block_d = max(16, triton.next_power_of_2(head_dim))
    part_a = torch.empty(batch * kv_heads * splits * _BLOCK_R * block_d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(batch * kv_heads * splits * _BLOCK_R * 2, dtype=torch.float32, device=q.device)
    warps = 4 if block_d <= 128 else 8
    _split_kernel[(batch * kv_heads, splits)](
        q, keys, values, bias, part_a, part_ml, rows, slots, per_split, float(scale),
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), bias.stride(0), kv_heads, splits,
        D=head_dim, BLOCK_D=block_d, BLOCK_R=_BLOCK_R, BLOCK_S=_BLOCK_S, num_warps=warps)
    _combine_kernel[(batch * kv_heads,)](
        part_a, part_ml, out, rows, kv_heads, splits, out.stride(0), out.stride(1), out.stride(2),
        D=head_dim, BLOCK_D=block_d, BLOCK_R=_BLOCK_R, BLOCK_P=max(2, triton.next_power_of_2(splits)), num_warps=4)
    return out


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py): (kernel, signature, constexprs, options)
# --------------------------------------------------------------------------------------------------
def _aot_specs() -> list:
    specs = []
    # Llama-3-8B's decode step (8 key/value heads of 128, 4 query heads each): fp16 on the T4, bf16 from sm_80
    for dt, targets in (("fp16", [75, 90]), ("bf16", [90])):
        split_sig = {"Q": f"*{dt}", "K": f"*{dt}", "V": f"*{dt}", "BIAS": f"*{dt}", "PART_A": "*fp32",
                     "PART_ML": "*fp32", "R": "i32", "S": "i32", "slots_per_split": "i32", "scale": "fp32"}
        split_sig.update({name: "i32" for name in ("sq_b", "sq_g", "sq_r", "sk_b", "sk_g", "sk_s", "sv_b", "sv_g",
                                                   "sv_s", "sbias_b", "n_kv_heads", "n_splits")})
        specs.append((_split_kernel, split_sig, {"D": 128, "BLOCK_D": 128, "BLOCK_R": _BLOCK_R, "BLOCK_S": _BLOCK_S},
                      {"num_warps": 4, "targets": targets}))
        combine_sig = {"PART_A": "*fp32", "PART_ML": "*fp32", "OUT": f"*{dt}", "R": "i32", "n_kv_heads": "i32",
                       "n_splits": "i32", "so_b": "i32", "so_g": "i32", "so_r": "i32"}
        specs.append((_combine_kernel, combine_sig, {"D": 128, "BLOCK_D": 128, "BLOCK_R": _BLOCK_R, "BLOCK_P": 16},
                      {"num_warps": 4, "targets": targets}))
    return specs


AOT_SPECS = _aot_specs()
