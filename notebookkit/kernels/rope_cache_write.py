"""The decode step's RoPE and KV-cache write in one kernel: rotate q and k, store k and v at the step's slot.

For one new token per row (``T = 1``), row ``b``, its table rows ``c = cos[b]``, ``s = sin[b]`` (halves
``c1, c2, s1, s2``) and the step's cache slot ``t`` (a one-element device tensor, read by the kernel, never
by the host: the step stays capturable as a CUDA graph), each head vector ``x = (x1, x2)`` becomes, as in
:mod:`notebookkit.kernels.rope`'s forward (the same device function, so the same fp32 math and rounding)::

    rot(x) = (x1 c1 - x2 s1,  x2 c2 + x1 s2)          fp32, rounded once to the output dtype

    q_out[b, h]            = rot(q[b, h])               returned, [B, Hq, 1, D]
    key_cache[b, g, t]     = rot(k[b, g])               written in place
    value_cache[b, g, t]   = v[b, g]                    written in place (a copy)

for query heads ``h < Hq`` and key/value heads ``g < Hkv``. One program handles one row: it loads the row's
table once and rotates all its query and key heads. This replaces three launches of the unfused step (the
RoPE kernel and two ``index_copy_`` writes into the cache) with one. A slot outside ``0 .. capacity - 1``
writes nothing (the kernel cannot raise without a host read; the caller keeps the slot in range).

The prompt (``T > 1``) keeps :func:`~notebookkit.kernels.rope.apply_rope` and a slice copy. No backward:
decoding runs without gradients; under autograd :func:`rope_cache_write` runs the PyTorch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from notebookkit.kernels.rope import rope_reference, rotate_heads
from notebookkit.kernels.runtime import should_use_triton

__all__ = ["rope_cache_write", "rope_cache_write_reference", "rope_cache_write_launch"]


@triton.jit
def _rope_cache_write_kernel(
    Q, K, V, COS, SIN, SLOT, QO, KC, VC,
    n_q_heads, n_k_heads, capacity,
    sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sqo_b, sqo_h,
    skc_b, skc_h, skc_t, svc_b, svc_h, svc_t, sc_b,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOT).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    table = b * sc_b + d
    c1 = tl.load(COS + table, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(COS + table + HALF, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + table, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + table + HALF, mask=d_ok, other=0.0).to(tl.float32)
    rotate_heads(Q, QO, b * sq_b, b * sqo_b, sq_h, sqo_h, n_q_heads,
                 c1, c2, s1, s2, d, d_ok, HALF, False, BLOCK_HQ)

    slot_d = slot + d * 0  # the slot broadcast over d (the interpreter takes no scalar-and-block masks)
    kv_ok = d_ok & (slot_d >= 0) & (slot_d < capacity)  # an out-of-range slot masks every cache store
    rotate_heads(K, KC, b * sk_b, b * skc_b + slot * skc_t, sk_h, skc_h, n_k_heads,
                 c1, c2, s1, s2, d, kv_ok, HALF, False, BLOCK_HK)
    g = tl.arange(0, BLOCK_HK).to(tl.int64)
    mask = (g < n_k_heads)[:, None] & kv_ok[None, :]
    src = V + b * sv_b + g[:, None] * sv_h + d[None, :]
    dst = VC + b * svc_b + slot * svc_t + g[:, None] * svc_h + d[None, :]
    tl.store(dst, tl.load(src, mask=mask, other=0.0).to(VC.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, tl.load(src + HALF, mask=mask, other=0.0).to(VC.dtype.element_ty), mask=mask)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           key_cache: torch.Tensor, value_cache: torch.Tensor, slot: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[2] != 1 or k.shape[2] != 1:
        raise ValueError(
            f"rope_cache_write: q [B, Hq, 1, D] and k, v [B, Hkv, 1, D] expected (one new token a row); got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}. A prompt (T > 1) takes apply_rope and "
            "StaticKVCache.write."
        )
    batch, _, _, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim or head_dim % 2:
        raise ValueError(f"rope_cache_write: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and an even "
                         "head_dim.")
    if cos.shape != sin.shape or cos.numel() not in (head_dim, batch * head_dim):
        raise ValueError(f"rope_cache_write: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be one row of "
                         f"{head_dim} per batch row ([B, 1, D]) or one shared row ([1, D]).")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4 or cache.shape[0] < batch or cache.shape[1] != k.shape[1] or cache.shape[3] != head_dim:
            raise ValueError(f"rope_cache_write: {name} {tuple(cache.shape)} is not a [rows >= {batch}, {k.shape[1]}, "
                             f"slots, {head_dim}] cache for k {tuple(k.shape)}.")
    if slot.numel() != 1 or slot.dtype.is_floating_point or slot.dtype.is_complex:
        raise ValueError(f"rope_cache_write: slot must be a one-element integer tensor, got {tuple(slot.shape)} "
                         f"{slot.dtype}.")


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_cache_write_launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot: torch.Tensor, q_out: torch.Tensor,
) -> None:
    """Run the kernel (module docstring): ``q_out`` gets ``rot(q)``; the caches get ``rot(k)`` and ``v`` at ``slot``.

    ``q`` ``[B, Hq, 1, D]``, ``k``/``v`` ``[B, Hkv, 1, D]`` with unit last stride, any other strides;
    ``cos``/``sin`` ``[1 or B, D]`` with unit last stride and equal strides; caches ``[rows >= B, Hkv, slots, D]``
    with unit last stride; ``slot`` a one-element integer tensor on the same device.
    """
    batch, n_q, _, head_dim = q.shape
    n_k = k.shape[1]
    if batch == 0:
        return
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    block_hq = triton.next_power_of_2(max(n_q, 1))
    block_hk = triton.next_power_of_2(max(n_k, 1))
    work = (block_hq + 2 * block_hk) * block_d * 2
    num_warps = 1 if work <= 512 else 2 if work <= 2048 else 4 if work <= 8192 else 8
    sc_b = cos.stride(0) if cos.shape[0] > 1 else 0
    _rope_cache_write_kernel[(batch,)](
        q, k, v, cos, sin, slot, q_out, key_cache, value_cache,
        n_q, n_k, key_cache.shape[2],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0), q_out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), sc_b,
        HALF=half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d, num_warps=num_warps,
    )


def rope_cache_write_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot: torch.Tensor,
) -> torch.Tensor:
    """Plain PyTorch: :func:`~notebookkit.kernels.rope.rope_reference` and two ``index_copy_`` writes at ``slot``
    (the CPU path and the test oracle; fp64 inputs compute in fp64). Returns the rotated ``q``."""
    _check(q, k, v, cos, sin, key_cache, value_cache, slot)
    batch, _, _, head_dim = q.shape
    table = lambda t: t.reshape(-1, 1, head_dim)  # noqa: E731  [1 or B, T = 1, D]
    q_rot, k_rot = rope_reference(q, k, table(cos), table(sin))
    index = slot.reshape(1).to(device=key_cache.device, dtype=torch.long)
    key_cache[:batch].index_copy_(2, index, k_rot.to(key_cache.dtype))
    value_cache[:batch].index_copy_(2, index, v.to(value_cache.dtype))
    return q_rot


def rope_cache_write(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot: torch.Tensor,
) -> torch.Tensor:
    """Rotate one token's queries and keys (RoPE, rotate-half) and store its keys and values in the KV cache.

    Args:
        q: queries ``[B, Hq, 1, D]``, any strides (e.g. ``q_proj(x).view(B, 1, Hq, D).transpose(1, 2)``).
        k, v: keys and values ``[B, Hkv, 1, D]``, any strides (keys not yet rotated).
        cos, sin: the token's table rows, ``[B, 1, D]`` (per row, as ``RopeTables.lookup`` gathers them) or
            ``[1, D]`` shared by the batch.
        key_cache, value_cache: one layer's cache ``[rows, Hkv, slots, D]`` (rows ``>= B``; rows ``0 .. B - 1``
            are written).
        slot: one-element integer tensor on the cache's device, the slot of this token (read on the device).

    Returns:
        the rotated queries ``[B, Hq, 1, D]`` (contiguous, ``q``'s dtype); the rotated keys and the values are
        in ``key_cache[:B, :, slot]`` and ``value_cache[:B, :, slot]`` (module docstring for the math). CUDA
        tensors run the Triton kernel, CPU tensors the reference (:mod:`notebookkit.kernels.runtime`), as do
        inputs under autograd (no backward here).
    """
    _check(q, k, v, cos, sin, key_cache, value_cache, slot)
    differentiating = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, cos, sin))
    if not should_use_triton(q) or differentiating:
        return rope_cache_write_reference(q, k, v, cos, sin, key_cache, value_cache, slot)
    devices = {t.device for t in (q, k, v, cos, sin, key_cache, value_cache, slot)}
    if len(devices) > 1:
        raise ValueError(f"rope_cache_write: every tensor must be on one device, got {sorted(map(str, devices))}.")
    head_dim = q.shape[3]
    cos2, sin2 = _unit_last_stride(cos.reshape(-1, head_dim)), _unit_last_stride(sin.reshape(-1, head_dim))
    if cos2.stride() != sin2.stride():
        cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rope_cache_write_launch(_unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v), cos2, sin2,
                            key_cache, value_cache, slot, q_out)
    return q_out


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py): (kernel, signature, constexprs, options)
# --------------------------------------------------------------------------------------------------
def _aot_specs() -> list:
    strides = ("sq_b", "sq_h", "sk_b", "sk_h", "sv_b", "sv_h", "sqo_b", "sqo_h",
               "skc_b", "skc_h", "skc_t", "svc_b", "svc_h", "svc_t", "sc_b")
    specs = []
    # Llama-3-8B's decode shapes (32 query heads, 8 key/value heads of 128): fp16 on the T4, bf16 from sm_80
    for dt, targets in (("fp16", [75, 90]), ("bf16", [90])):
        sig = {"Q": f"*{dt}", "K": f"*{dt}", "V": f"*{dt}", "COS": f"*{dt}", "SIN": f"*{dt}", "SLOT": "*i64",
               "QO": f"*{dt}", "KC": f"*{dt}", "VC": f"*{dt}", "n_q_heads": "i32", "n_k_heads": "i32",
               "capacity": "i32"}
        sig.update({name: "i32" for name in strides})
        specs.append((_rope_cache_write_kernel, sig,
                      {"HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 8, "BLOCK_D": 64},
                      {"num_warps": 4, "targets": targets}))
    return specs


AOT_SPECS = _aot_specs()
