"""Rotary position embedding (rotate-half layout) for Q and K in one launch.

Math, for one head vector ``x`` of even length ``D`` split into halves ``x1 = x[:D/2]``,
``x2 = x[D/2:]``, and the per-token tables ``c = cos[b, t]``, ``s = sin[b, t]`` (halves ``c1, c2, s1,
s2``), as HF ``apply_rotary_pos_emb``  (``x * cos + rotate_half(x) * sin``)::

    o1 = x1 * c1 - x2 * s1
    o2 = x2 * c2 + x1 * s2

Backward is the transpose of that linear map::

    dx1 = do1 * c1 + do2 * s2
    dx2 = do2 * c2 - do1 * s1

which, for the usual tables (``c1 == c2``, ``s1 == s2``), is the same rotation with ``-sin``.

Positions live only in the tables: ``cos``/``sin`` are ``[B, T, D]`` (one row per token, so packed
sequences whose position ids restart at 0, Llama-3.1 / YaRN / linear scaling are all just different
tables) or ``[T, D]`` shared by the batch. ``q`` is ``[B, Hq, T, D]`` and ``k`` ``[B, Hkv, T, D]`` with any
strides (e.g. the transposed views of ``[B, T, H, D]`` projection outputs), ``Hq != Hkv`` allowed. One
program handles one token: it loads that token's table row once and rotates all its Q and K heads.

In place or not: the forward writes fresh outputs (same strides as ``q``/``k``) instead of rotating
``q``/``k`` in place. The inputs are almost always views of a projection output; an in-place
``mark_dirty`` on a view makes autograd wrap the op in ``CopySlices``, whose backward allocates and
copies a full-size gradient of the base, costing more than it saves. With fresh outputs the
projection output is freed as soon as nothing else holds it, so the peak is the same as in place.
The backward rotates the incoming gradients into fresh buffers, or into the gradient buffers
themselves with ``inplace_backward=True`` (no allocation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from notebookkit.kernels.runtime import mark_written, should_use_triton

__all__ = ["apply_rope", "rope_reference", "rope_launch"]


# --------------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------------
# Device function: rotate the heads of one token (forward or transpose), ``x`` read from ``IN`` and the
# result stored to ``OUT`` in ``OUT``'s dtype; shared with notebookkit.kernels.rope_cache_write (the decode
# step's RoPE + KV-cache write), so both round exactly alike.
@triton.jit
def rotate_heads(
    IN, OUT, in_base, out_base, stride_in_h, stride_out_h, n_heads,
    c1, c2, s1, s2, d, d_ok,
    HALF: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H).to(tl.int64)
    mask = (h < n_heads)[:, None] & d_ok[None, :]
    in_ptr = IN + in_base + h[:, None] * stride_in_h + d[None, :]
    out_ptr = OUT + out_base + h[:, None] * stride_out_h + d[None, :]
    x1 = tl.load(in_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(in_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = x1 * c1[None, :] + x2 * s2[None, :]
        o2 = x2 * c2[None, :] - x1 * s1[None, :]
    else:
        o1 = x1 * c1[None, :] - x2 * s1[None, :]
        o2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(out_ptr, o1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(out_ptr + HALF, o2.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, COS, SIN, QO, KO,
    seq_len, n_q_heads, n_k_heads,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
    sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t,
    sc_b, sc_t,
    HALF: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    b = (token // seq_len).to(tl.int64)
    t = (token % seq_len).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    table = b * sc_b + t * sc_t + d
    c1 = tl.load(COS + table, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(COS + table + HALF, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + table, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + table + HALF, mask=d_ok, other=0.0).to(tl.float32)
    rotate_heads(Q, QO, b * sq_b + t * sq_t, b * sqo_b + t * sqo_t, sq_h, sqo_h, n_q_heads,
                  c1, c2, s1, s2, d, d_ok, HALF, BACKWARD, BLOCK_HQ)
    rotate_heads(K, KO, b * sk_b + t * sk_t, b * sko_b + t * sko_t, sk_h, sko_h, n_k_heads,
                  c1, c2, s1, s2, d, d_ok, HALF, BACKWARD, BLOCK_HK)


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------
def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _table(t: torch.Tensor, batch: int, seq_len: int, head_dim: int, name: str) -> torch.Tensor:
    """cos/sin as a ``[1 or B, T, D]`` tensor with unit last stride."""
    if t.dim() == 4 and t.shape[1] == 1:
        t = t[:, 0]
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3 or t.shape[0] not in (1, batch) or tuple(t.shape[1:]) != (seq_len, head_dim):
        raise ValueError(
            f"apply_rope: {name} has shape {tuple(t.shape)}; expected [B, T, D] = [{batch}, {seq_len}, "
            f"{head_dim}] or [T, D] = [{seq_len}, {head_dim}] (what the model's rotary_emb returns)."
        )
    return _unit_last_stride(t)


def _check(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"apply_rope: q and k must be [B, H, T, D]; got {tuple(q.shape)} and {tuple(k.shape)}. "
            "Transpose [B, T, H, D] projections with .transpose(1, 2) (no copy needed)."
        )
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"apply_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, sequence length "
            "and head_dim (only the number of heads may differ)."
        )
    if q.shape[3] % 2:
        raise ValueError(f"apply_rope: head_dim must be even for rotate-half RoPE, got {q.shape[3]}.")


def rope_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    backward: bool = False,
) -> None:
    """Rotate ``q``/``k`` into ``q_out``/``k_out`` (``backward=True``: apply the transpose rotation).

    All are ``[B, H, T, D]`` with unit last stride; outputs may alias the inputs exactly (same
    tensor), since each program reads a head vector before writing it. ``cos``/``sin`` are
    ``[1 or B, T, D]`` with unit last stride and equal strides.
    """
    batch, n_q, seq_len, head_dim = q.shape
    n_k = k.shape[1]
    if batch * seq_len == 0:
        return
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    block_hq = triton.next_power_of_2(max(n_q, 1))
    block_hk = triton.next_power_of_2(max(n_k, 1))
    work = (block_hq + block_hk) * block_d * 2
    num_warps = 1 if work <= 512 else 2 if work <= 2048 else 4 if work <= 8192 else 8
    sc_b = cos.stride(0) if cos.shape[0] > 1 else 0
    _rope_kernel[(batch * seq_len,)](
        q, k, cos, sin, q_out, k_out,
        seq_len, n_q, n_k,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        sc_b, cos.stride(1),
        HALF=half, BACKWARD=backward, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d,
        num_warps=num_warps,
    )


class _RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, inplace_backward):
        q = _unit_last_stride(q)
        k = _unit_last_stride(k)
        q_out = torch.empty_like(q)
        k_out = torch.empty_like(k)
        rope_launch(q, k, cos, sin, q_out, k_out, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.inplace_backward = inplace_backward
        ctx.set_materialize_grads(False)  # an unused output arrives as None: skip its rotation
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        present = dq_out if dq_out is not None else dk_out
        if present is None:
            return None, None, None, None, None

        def prepare(g):
            if g is None:  # that output was unused: its input gets no gradient (zero heads rotated)
                empty = present[:, :0]
                return empty, empty
            g_in = _unit_last_stride(g)
            writable = g_in is g and all(st or n == 1 for st, n in zip(g.stride(), g.shape))  # not expanded
            return g_in, (g_in if ctx.inplace_backward and writable else torch.empty_like(g_in))

        (dq_in, dq), (dk_in, dk) = prepare(dq_out), prepare(dk_out)
        rope_launch(dq_in, dk_in, cos, sin, dq, dk, backward=True)
        for out, g in ((dq, dq_out), (dk, dk_out)):
            if out is g:
                mark_written(g)
        return (dq if dq_out is not None else None), (dk if dk_out is not None else None), None, None, None


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch RoPE (the CPU path and the test oracle), computed in fp32 (fp64 for fp64 inputs)."""
    _check(q, k)
    batch, _, seq_len, head_dim = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    c = _table(cos, batch, seq_len, head_dim, "cos").to(acc).unsqueeze(1)
    s = _table(sin, batch, seq_len, head_dim, "sin").to(acc).unsqueeze(1)
    qf, kf = q.to(acc), k.to(acc)
    q_rot = qf * c + _rotate_half(qf) * s
    k_rot = kf * c + _rotate_half(kf) * s
    return q_rot.to(q.dtype), k_rot.to(k.dtype)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embeddings to queries and keys (rotate-half layout, as HF Llama).

    Args:
        q: queries ``[B, Hq, T, D]``, any strides (e.g. ``q_proj(x).view(B, T, Hq, D).transpose(1, 2)``).
        k: keys ``[B, Hkv, T, D]``; ``Hkv`` may differ from ``Hq`` (grouped-query attention).
        cos, sin: ``[B, T, D]`` or ``[T, D]`` tables as returned by the model's ``rotary_emb``; the
            positions of every token are already in them, so packed sequences work unchanged.
        inplace_backward: rotate the incoming gradients in their own buffers instead of allocating
            new ones. Only safe when the gradients of ``q_rot``/``k_rot`` are used by nothing else
            (true when they feed attention directly).

    Returns:
        ``(q_rot, k_rot)``, new tensors with the dtypes (and strides) of ``q`` and ``k``. The tables
        get no gradient (they are derived from position ids, not trained).
    """
    _check(q, k)
    if should_use_triton(q) and not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)):
        batch, _, seq_len, head_dim = q.shape
        cos_t = _table(cos, batch, seq_len, head_dim, "cos")
        sin_t = _table(sin, batch, seq_len, head_dim, "sin")
        if cos_t.stride() != sin_t.stride() or cos_t.shape != sin_t.shape:
            cos_t, sin_t = cos_t.expand(sin_t.shape).contiguous(), sin_t.expand(cos_t.shape).contiguous()
        return _RoPEFunction.apply(q, k, cos_t, sin_t, bool(inplace_backward))
    return rope_reference(q, k, cos, sin)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py): (kernel, signature, constexprs, options)
# --------------------------------------------------------------------------------------------------
def _aot_specs() -> list:
    strides = ("sq_b", "sq_h", "sq_t", "sk_b", "sk_h", "sk_t", "sqo_b", "sqo_h", "sqo_t",
               "sko_b", "sko_h", "sko_t", "sc_b", "sc_t")
    specs = []
    for dt, table_dt, backward in (("fp16", "fp16", False), ("bf16", "bf16", True), ("bf16", "fp32", False)):
        sig = {"Q": f"*{dt}", "K": f"*{dt}", "COS": f"*{table_dt}", "SIN": f"*{table_dt}",
               "QO": f"*{dt}", "KO": f"*{dt}", "seq_len": "i32", "n_q_heads": "i32", "n_k_heads": "i32"}
        sig.update({name: "i32" for name in strides})
        specs.append((
            _rope_kernel, sig,
            {"HALF": 64, "BACKWARD": backward, "BLOCK_HQ": 32, "BLOCK_HK": 8, "BLOCK_D": 64},
            {"num_warps": 8},
        ))
    return specs


AOT_SPECS = _aot_specs()
