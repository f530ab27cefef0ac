"""The experts of one sparse MoE block on PyTorch's grouped GEMM (``torch.nn.functional.grouped_mm``: CUTLASS
on sm_90 and newer), for training-sized calls in bf16; the same op, inputs, layouts and adapters as
:func:`notebookkit.kernels.moe_experts.moe_expert_mlp` (its docstring has the math and the backward), which
dispatches here when :func:`grouped_mm_applies`.

Why a second path: the Triton grouped kernels read ``x`` rows through the pair permutation and the weights
through any strides (gpt-oss's interleaved gate/up columns among them), and on the H200 they ran at 30-100
TFLOP/s where ``grouped_mm`` on expert-sorted rows runs at 230-400 (``benchmarks/moe_kernels.py``, 2026-12-04:
forward of the two GEMMs 0.68 / 1.03 ms at Qwen3-30B-A3B's / gpt-oss-20b's shape and 2,048 tokens, against
2.1 / 11.3 ms). The Triton kernels stay for fp16 (a T4 has no ``grouped_mm`` fast path), for decode steps
(few rows an expert, inside CUDA graphs) and for every GPU before sm_90.

In expert-sorted order (row ``s`` of the ``N = T k`` pairs, ``p = perm[s]``, token ``t = p // k``, expert ``e``,
routing weight ``w_s``; ``gmm`` one grouped GEMM over the experts' row segments, fp32 accumulation, one rounding
to bf16 per product)::

    xs   = x[t]                                               gathered copy       [N, H]
    gu   = gmm(xs, Wgu^T) + s gmm(xa, Bgu^T) + bgu_e,  xa = gmm(xs, Agu^T)     (bias added by the activation kernel)
    h    = act(gate, up)                                      _gated_rows_fwd_kernel
    o    = gmm(h, Wd^T) + s gmm(ha, Bd^T),  ha = gmm(h, Ad^T)
    slot[p] = (o + bd_e) w_s                                  _combine_rows_kernel, fp32, one rounding
    y_t  = sum_j slot[t k + j]                                fp32, one rounding

Backward (``dys = dy[t]``)::

    dyb  = gmm(dys, Bd);   G = gmm(dys, Wd) + s gmm(dyb, Ad)
    dgu, h, <G, h> = act'(gu) (w_s G)                         _gated_rows_bwd_kernel (h recomputed, fp32)
    dgub = gmm(dgu, Bgu);  dxs = gmm(dgu, Wgu) + s gmm(dgub, Agu);  dx_t = sum_j dxs[slot t k + j]
    dBd = s gmm^T(dys, w ha)   dAd = s gmm^T(w dyb, h)   dBgu = s gmm^T(dgu, xa)   dAgu = s gmm^T(dgub, xs)

where ``gmm^T(l, r)[e] = sum_{s in e} l_s^T r_s`` (``grouped_mm`` of ``l^T`` and ``r`` with the segments along
the reduced dimension; an expert without rows gets exact zeros). Each GEMM output is rounded to bf16 before
the next addition (Hugging Face's experts round the same way), where the Triton kernels keep one fp32
accumulator per output tile: the two paths agree to bf16 rounding, not bit for bit.

NF4 experts (:class:`~notebookkit.kernels.nf4_stacked.NF4Stacked`) are decoded a chunk of whole experts at a
time (:mod:`notebookkit.expert_chunks`, the view's ``chunk_bytes``: the card's budget), each chunk's ``gmm`` over
its experts' rows copied into the output; an expert range without rows is not decoded. A weight whose experts
all fit one chunk is decoded whole and its ``gmm`` is the output. The chunks need the segment bounds on the host:
one device-to-host copy of ``E + 1`` integers a call (so this path never runs under CUDA-graph capture). The host
then writes every chunk's ``grouped_mm`` offsets and sends them in one copy a GEMM, and knows whether any expert
is without rows (the weight gradients' zero mask is skipped when none is). With
``NOTEBOOKKIT_MOE_DEVICE_BOUNDS=1`` (:func:`~notebookkit.expert_chunks.device_bounds`) the bounds stay on the
device and each chunk reads a gathered copy of the rows from its first (:func:`_chunks_by_device_bounds`).

Memory (``n = T k``): it saves the Triton path's activations (``gu``, ``xa``, ``ha``) and its own bookkeeping
(the fp32 routing weights, int32 ``perm`` and expert ids per sorted row, the int32 offsets: ``12 n + 4 E``
bytes, no block schedule); :func:`notebookkit.memory.moe.sparse_block_saved_bytes` and
:func:`~notebookkit.memory.moe.sparse_block_working_sets` count it with ``grouped=True`` (the transients: the
gathered ``xs`` and ``dys``, the adapters' full-width products, ``o`` beside the pairs' slots).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..expert_chunks import chunk_ranges, device_bounds, grouped_mm_sizes
from .lora_projection import scale_
from .nf4_stacked import NF4Stacked

__all__ = ["grouped_mm_applies", "moe_expert_mlp_grouped", "expert_segments", "act_fwd", "act_bwd", "sum_slots"]

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_applies(x: torch.Tensor, pairs: int, num_experts: int, dims: tuple[int, ...],
                       weights: tuple = ()) -> bool:
    """Whether :func:`moe_expert_mlp_grouped` serves a call that trains (the caller's test: autograd on and something
    to differentiate; a prefill or a reference forward keeps the Triton path): a bf16 CUDA ``x`` on sm_90 or newer, training-sized
    (:func:`~notebookkit.expert_chunks.decodes_in_chunks`: 16 rows an expert on average), every dimension in
    ``dims`` (hidden, intermediate, ranks) a multiple of 8 (``grouped_mm``'s 16-byte strides), 16-bit weights in
    ``x``'s dtype, not while a CUDA graph is captured. ``NOTEBOOKKIT_MOE_GROUPED_MM=0`` turns it off (the
    benchmarks' comparison with the Triton path)."""
    if _grouped_mm is None or os.environ.get("NOTEBOOKKIT_MOE_GROUPED_MM", "1") == "0":
        return False
    if not x.is_cuda or x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    if torch.cuda.is_current_stream_capturing():
        return False
    if any(isinstance(w, torch.Tensor) and w.dtype != x.dtype for w in weights):
        return False
    return grouped_mm_sizes(pairs, num_experts, dims)


class ExpertSegments(NamedTuple):
    """The pairs sorted by expert: ``perm [N]`` (the pair slot ``t k + j`` of each sorted row, stable, int64),
    ``expert [N]`` (the sorted expert ids, in the narrow key dtype of :func:`expert_segments`),
    ``starts``/``ends [E]`` (each expert's sorted rows, int32)."""

    perm: torch.Tensor
    expert: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor


def expert_segments(topk_idx: torch.Tensor, num_experts: int) -> ExpertSegments:
    """Sort the pairs by expert (stable: by token inside an expert); each expert's segment from
    ``searchsorted`` (no host sync: ``bincount`` on CUDA reads its largest id on the host to size its output).

    The keys are sorted as uint8 (int16 past 256 experts): a radix sort on the GPU takes one pass per key byte,
    and int64 ids made eight."""
    key = torch.uint8 if num_experts <= 256 else torch.int16
    flat = topk_idx.reshape(-1).to(key)
    ordered, perm = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts, device=flat.device, dtype=key)
    return ExpertSegments(perm, ordered, torch.searchsorted(ordered, experts, out_int32=True),
                          torch.searchsorted(ordered, experts, right=True, out_int32=True))


def sum_slots(buf: torch.Tensor, tokens: int, topk: int, dtype: torch.dtype) -> torch.Tensor:
    """``sum_j buf[t k + j]`` accumulated in fp32, one rounding to ``dtype``: the deterministic gather-sum of the
    pairs' rows, one launch (PyTorch's sum of 16-bit values accumulates in fp32 and writes the rounded sum)."""
    return buf.view(tokens, topk, buf.shape[1]).sum(1, dtype=dtype)


# --------------------------------------------------------------------------------------------------
# The activations (also read by the Triton grouped kernels of moe_experts.py)
# --------------------------------------------------------------------------------------------------


@triton.jit
def act_fwd(g, u, ACT: tl.constexpr, alpha, limit):
    """``h`` of the gated activation (fp32): ``ACT`` 0 SwiGLU ``silu(g) u``; 1 gpt-oss's clamped
    ``(clamp(u, -L, L) + 1) min(g, L) sigmoid(alpha min(g, L))``."""
    if ACT == 0:
        h = g * tl.sigmoid(g) * u
    else:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        h = (uc + 1.0) * (gc * tl.sigmoid(alpha * gc))
    return h


@triton.jit
def act_bwd(g, u, dh, ACT: tl.constexpr, alpha, limit):
    """``(h, dg, du)`` of the activation at ``(g, u)`` for the output gradient ``dh`` (fp32)."""
    if ACT == 0:
        sg = tl.sigmoid(g)
        a = g * sg
        h = a * u
        dg = dh * u * sg * (1.0 + g * (1.0 - sg))
        du = dh * a
    else:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        sig = tl.sigmoid(alpha * gc)
        glu = gc * sig
        h = (uc + 1.0) * glu
        dg = tl.where(g <= limit, dh * (uc + 1.0) * (sig + alpha * gc * sig * (1.0 - sig)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), dh * glu, 0.0)
    return h, dg, du


@triton.jit
def _gated_rows_fwd_kernel(gu_ptr, stride_gu, h_ptr, stride_h, bias_ptr, stride_be, expert_ptr, inter, gu_step, up_off,
                           alpha, limit, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row ``s``, columns ``n``: gate at ``n gu_step``, up at ``n gu_step + up_off`` of ``gu``; with ``HAS_BIAS``
    ``gu += bias_e`` rounded and stored back (the pre-activation the backward reads); ``h = act(gate, up)``."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = n < inter
    gcol = n * gu_step
    ucol = gcol + up_off
    gate = tl.load(gu_ptr + row * stride_gu + gcol, mask=ok, other=0.0)
    up = tl.load(gu_ptr + row * stride_gu + ucol, mask=ok, other=0.0)
    if HAS_BIAS:
        e = tl.load(expert_ptr + row).to(tl.int64)
        gate = (gate.to(tl.float32) + tl.load(bias_ptr + e * stride_be + gcol, mask=ok, other=0.0).to(tl.float32)
                ).to(gu_ptr.dtype.element_ty)
        up = (up.to(tl.float32) + tl.load(bias_ptr + e * stride_be + ucol, mask=ok, other=0.0).to(tl.float32)
              ).to(gu_ptr.dtype.element_ty)
        tl.store(gu_ptr + row * stride_gu + gcol, gate, mask=ok)
        tl.store(gu_ptr + row * stride_gu + ucol, up, mask=ok)
    h = act_fwd(gate.to(tl.float32), up.to(tl.float32), ACT, alpha, limit)
    tl.store(h_ptr + row * stride_h + n, h.to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_rows_bwd_kernel(g_ptr, stride_g, gu_ptr, stride_gu, route_ptr, dgu_ptr, stride_dgu, h_ptr, stride_h,
                           part_ptr, stride_p, inter, gu_step, up_off, alpha, limit, ACT: tl.constexpr,
                           STORE_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row ``s``, columns ``n``: the activation's backward at the saved ``gu`` for ``dh = w_s G``: ``dgu`` in gu's
    layout, ``h`` (``STORE_H``) and ``part[s, tile] = <G, h>`` over the tile (fp32, the router's gradient)."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = n < inter
    gcol = n * gu_step
    ucol = gcol + up_off
    g = tl.load(g_ptr + row * stride_g + n, mask=ok, other=0.0).to(tl.float32)
    gate = tl.load(gu_ptr + row * stride_gu + gcol, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + ucol, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(route_ptr + row)
    h, dg, du = act_bwd(gate, up, g * w, ACT, alpha, limit)
    tl.store(dgu_ptr + row * stride_dgu + gcol, dg.to(dgu_ptr.dtype.element_ty), mask=ok)
    tl.store(dgu_ptr + row * stride_dgu + ucol, du.to(dgu_ptr.dtype.element_ty), mask=ok)
    if STORE_H:
        tl.store(h_ptr + row * stride_h + n, h.to(h_ptr.dtype.element_ty), mask=ok)
    tl.store(part_ptr + row * stride_p + tl.program_id(1), tl.sum(tl.where(ok, g * h, 0.0), axis=0))


@triton.jit
def _combine_rows_kernel(o_ptr, stride_o, bias_ptr, stride_be, expert_ptr, route_ptr, perm_ptr, out_ptr, stride_out,
                         n_cols, HAS_BIAS: tl.constexpr, HAS_ROUTE: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[perm[s]] = (o[s] + bias_e) w_s`` (``HAS_BIAS``, ``HAS_ROUTE``) in fp32, one rounding: the sorted rows
    back to their pair slots."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = n < n_cols
    v = tl.load(o_ptr + row * stride_o + n, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        e = tl.load(expert_ptr + row).to(tl.int64)
        v += tl.load(bias_ptr + e * stride_be + n, mask=ok, other=0.0).to(tl.float32)
    if HAS_ROUTE:
        v *= tl.load(route_ptr + row)
    slot = tl.load(perm_ptr + row).to(tl.int64)
    tl.store(out_ptr + slot * stride_out + n, v.to(out_ptr.dtype.element_ty), mask=ok)


def _row_grid(rows: int, cols: int) -> tuple[tuple[int, int], int]:
    block = min(1024, triton.next_power_of_2(max(cols, 16)))
    return (rows, triton.cdiv(cols, block)), block


# --------------------------------------------------------------------------------------------------
# Grouped GEMMs over the experts' segments
# --------------------------------------------------------------------------------------------------


class _Segments(NamedTuple):
    """What the grouped GEMMs read (int32, as saved for the backward)."""

    perm: torch.Tensor  # [N] the pair slot of each sorted row
    expert: torch.Tensor  # [N] its expert
    ends32: torch.Tensor  # [E] grouped_mm's offsets: each expert's segment end
    bounds: Optional[list[int]]  # [E + 1] host copy of the segment starts and N (NF4 chunks only)


def _gmm(a: torch.Tensor, b: torch.Tensor, sg: _Segments) -> torch.Tensor:
    """``a_s b_{e(s)}`` for every sorted row: ``a [N, K]``, ``b [E, K, M]`` (a small factor) -> ``[N, M]``."""
    return _grouped_mm(a, b, offs=sg.ends32)


def _every_expert_has_rows(sg: _Segments) -> bool:
    """Whether the host's segment bounds (NF4 experts) show that no expert is without rows (False when unknown)."""
    return sg.bounds is not None and all(lo < hi for lo, hi in zip(sg.bounds, sg.bounds[1:]))


def _gmm_t(l: torch.Tensor, r: torch.Tensor, sg: _Segments, scale: float) -> torch.Tensor:
    """``[E, P, Q]``: ``scale sum_{s in e} l_s^T r_s`` (``l [N, P]``, ``r [N, Q]``); an expert without rows gets
    exact zeros (not whatever an empty reduction leaves), unless the host's bounds show there is none."""
    if _every_expert_has_rows(sg):
        return scale_(_grouped_mm(l.t(), r, offs=sg.ends32), scale)
    # the empty mask before the product: its temporaries are gone when the [E, P, Q] result is allocated
    empty = torch.diff(sg.ends32, prepend=sg.ends32.new_zeros(1)) == 0
    return scale_(_grouped_mm(l.t(), r, offs=sg.ends32), scale).masked_fill_(empty[:, None, None], 0.0)


#: each device's int32 buffer of chunk offsets, reused by every call (stream order keeps a call's GEMMs before the
#: next call's copy into it): a few hundred bytes for the process, never a transient of a call
_OFFSETS: dict[torch.device, torch.Tensor] = {}


def _chunk_offsets(bounds: list[int], ranges: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """The ``grouped_mm`` offsets of every chunk of a call (its experts' segment ends counted from the chunk's
    first row), from the host's segment bounds, chunk after chunk in the device's offsets buffer: one copy to
    the device a call, where a subtraction a chunk made one launch each."""
    ends = [bounds[e + 1] - bounds[lo] for lo, hi in ranges for e in range(lo, hi)]
    buffer = _OFFSETS.get(device)
    if buffer is None or buffer.numel() < len(ends):
        buffer = _OFFSETS[device] = torch.empty(max(256, len(ends)), dtype=torch.int32, device=device)
    host = torch.tensor(ends, dtype=torch.int32, pin_memory=device.type == "cuda")
    return buffer[:len(ends)].copy_(host, non_blocking=True)


def _expert_gemm(a: torch.Tensor, w, sg: _Segments) -> torch.Tensor:
    """``a_s W_{e(s)}^T`` for every sorted row (``[N, out]``), ``w`` an ``[E, out, in]`` view: a tensor (one
    ``grouped_mm``), or NF4 experts decoded a chunk at a time (``w.chunk_bytes``), each chunk's ``grouped_mm``
    over its rows copied into the output (with the host's bounds, or :func:`_chunks_by_device_bounds`); every
    expert in one chunk: that chunk's ``grouped_mm`` is the output."""
    if not isinstance(w, NF4Stacked):
        return _grouped_mm(a, w.transpose(1, 2), offs=sg.ends32)
    E, n_out, n_in = w.shape
    chunks = chunk_ranges(E, n_out * n_in * a.element_size(), w.chunk_bytes)
    if len(chunks) == 1:
        return _grouped_mm(a, w.decode_experts(0, E, a.dtype).transpose(1, 2), offs=sg.ends32)
    if sg.bounds is None:
        return _chunks_by_device_bounds(a, w, chunks, sg.ends32)
    out = a.new_empty((a.shape[0], n_out))
    bounds = sg.bounds
    ranges = [(lo, hi) for lo, hi in chunks if bounds[lo] != bounds[hi]]  # experts without rows are not decoded
    offsets = _chunk_offsets(bounds, ranges, a.device)
    at = 0
    for lo, hi in ranges:
        r0, r1 = bounds[lo], bounds[hi]
        chunk = w.decode_experts(lo, hi, a.dtype)
        out[r0:r1] = _grouped_mm(a[r0:r1], chunk.transpose(1, 2), offs=offsets[at:at + hi - lo])
        at += hi - lo
        del chunk
    return out


def _chunks_by_device_bounds(a: torch.Tensor, w: NF4Stacked, chunks: list[tuple[int, int]],
                             ends32: torch.Tensor) -> torch.Tensor:
    """:func:`_expert_gemm` of NF4 experts in several chunks with the segment bounds left on the device (no host
    synchronisation; :func:`~notebookkit.expert_chunks.device_bounds`). ``grouped_mm`` multiplies rows from its
    input's first row, so chunk ``c`` (experts ``[lo, hi)``, sorted rows ``[f_c, l_c)``, known only on the device)
    reads a gathered copy ``a_c[i] = a[min(f_c + i, N - 1)]`` of ``N`` rows with the offsets ``ends[lo:hi] - f_c``:
    its ``grouped_mm`` computes the chunk's ``l_c - f_c`` rows and leaves the others unwritten. Those are set to
    zero and the product is added into the zeroed output at rows ``(f_c + i) mod N``: each output row gets its own
    chunk's value and exact zeros from the others, so the sum is that value whatever the order of the additions.
    Every chunk is decoded, rows or not; each costs an ``[N, in]`` gather and an ``[N, out]`` addition more than
    with the host's bounds."""
    n, n_out = a.shape[0], w.shape[1]
    device = a.device
    per, experts = chunks[0][1], chunks[-1][1]  # chunk_ranges: `per` experts a chunk, the last may hold fewer
    # made on the device (a copy from the host would wait for it): [E + 1] expert e's first sorted row, N last
    segment_starts = torch.cat([ends32.new_zeros(1), ends32]).long()
    los = torch.arange(0, experts, per, device=device)
    firsts, lasts = segment_starts[los], segment_starts[(los + per).clamp_(max=experts)]  # [C] each
    offsets = ends32 - firsts[torch.arange(experts, device=device) // per].to(ends32.dtype)  # [E] from each f_c
    rows = firsts[:, None] + torch.arange(n, device=device)  # [C, N]: chunk c's i-th row in sorted order
    outside = rows >= lasts[:, None]  # past the chunk's rows: unwritten by its grouped_mm
    del segment_starts, los, firsts, lasts
    targets = rows % n
    sources = rows.clamp_(max=n - 1)
    out = a.new_zeros((n, n_out))
    for c, (lo, hi) in enumerate(chunks):
        chunk = w.decode_experts(lo, hi, a.dtype)
        part = _grouped_mm(a.index_select(0, sources[c]), chunk.transpose(1, 2), offs=offsets[lo:hi])
        del chunk
        out.index_add_(0, targets[c], part.masked_fill_(outside[c, :, None], 0.0))
        del part
    return out


def _routed(a: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
    """``w_s a_s`` (fp32 product, one rounding to ``a``'s dtype) of a rank-sized ``[N, r]`` product: one launch
    (a 16-bit ``a`` times fp32 weights is taken in fp32 and written in ``a``'s dtype, no fp32 temporary)."""
    return torch.mul(a, route[:, None], out=torch.empty_like(a))


def _to_slots(o: torch.Tensor, sg: _Segments, bias: Optional[torch.Tensor] = None,
              route: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[N, cols]``: row ``perm[s]`` = ``(o[s] + bias_e) w_s`` (``_combine_rows_kernel``)."""
    n, cols = o.shape
    slots = o.new_empty((n, cols))
    grid, block = _row_grid(n, cols)
    _combine_rows_kernel[grid](o, o.stride(0), bias if bias is not None else o, bias.stride(0) if bias is not None else 0,
                               sg.expert, route if route is not None else o, sg.perm, slots, slots.stride(0), cols,
                               HAS_BIAS=bias is not None, HAS_ROUTE=route is not None, BLOCK_N=block)
    return slots


def _segments(topk_idx: torch.Tensor, num_experts: int, nf4: bool) -> _Segments:
    """The sorted rows' bookkeeping; the segment bounds copied to the host for NF4 experts (one synchronisation),
    unless :func:`~notebookkit.expert_chunks.device_bounds` keeps them on the device."""
    perm, expert, starts, ends = expert_segments(topk_idx, num_experts)
    bounds = starts.tolist() + [topk_idx.numel()] if nf4 and not device_bounds() else None
    i32 = torch.int32
    return _Segments(perm.to(i32), expert.to(i32), ends.to(i32), bounds)


class _MoEGroupedFunction(torch.autograd.Function):
    """Inputs as ``moe_experts._MoEExpertMLPFunction``: ``x, topk_idx, topk_w, gate_up [E, 2I, H], down [E, H, I],
    biases, gate_up A [E, r, H], B [E, 2I, r], down A [E, r, I], B [E, H, r], meta``."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_w, gate_up, down, gu_bias, d_bias, gu_A, gu_B, d_A, d_B, meta):
        gu_scale, d_scale, act, interleaved, alpha, limit = meta
        T, H = x.shape
        E, two_i, _ = gate_up.shape
        inter, k = two_i // 2, topk_idx.shape[1]
        n = T * k
        sg = _segments(topk_idx, E, isinstance(gate_up, NF4Stacked) or isinstance(down, NF4Stacked))
        perm, expert = sg.perm, sg.expert
        route = topk_w.reshape(-1).to(torch.float32)[perm]  # sorted rows' weights, fp32
        gu_Bc, d_Bc = (b.contiguous() if b is not None else None for b in (gu_B, d_B))  # PEFT's B views are strided
        xs = x.index_select(0, perm // k)
        gu = _expert_gemm(xs, gate_up, sg)
        xa = None
        if gu_A is not None:
            xa = _gmm(xs, gu_A.transpose(1, 2), sg)
            gu.add_(_gmm(xa, gu_Bc.transpose(1, 2), sg), alpha=gu_scale)
        del xs
        h = x.new_empty((n, inter))
        grid, block = _row_grid(n, inter)
        gu_step, up_off = (2, 1) if interleaved else (1, inter)
        _gated_rows_fwd_kernel[grid](gu, gu.stride(0), h, h.stride(0), gu_bias if gu_bias is not None else gu,
                                     gu_bias.stride(0) if gu_bias is not None else 0, expert, inter, gu_step, up_off,
                                     float(alpha), float(limit), ACT=act, HAS_BIAS=gu_bias is not None, BLOCK_N=block)
        ha = _gmm(h, d_A.transpose(1, 2), sg) if d_A is not None else None
        o = _expert_gemm(h, down, sg)
        del h
        if d_A is not None:
            o.add_(_gmm(ha, d_Bc.transpose(1, 2), sg), alpha=d_scale)
        del gu_Bc, d_Bc
        slots = _to_slots(o, sg, d_bias, route)
        del o
        y = sum_slots(slots, T, k, x.dtype)
        if any(ctx.needs_input_grad):
            nf4 = tuple(w if isinstance(w, NF4Stacked) else None for w in (gate_up, down))
            ctx.save_for_backward(x, topk_idx, *(None if q is not None else w for w, q in zip((gate_up, down), nf4)),
                                  d_bias, gu_A, gu_B, d_A, d_B, gu, xa, ha, route, perm, expert, sg.ends32)
            ctx.meta = (meta, nf4, sg.bounds, topk_w.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x, topk_idx, gate_up, down, d_bias, gu_A, gu_B, d_A, d_B, gu, xa, ha, route, perm, expert,
         ends32) = ctx.saved_tensors
        (gu_scale, d_scale, act, interleaved, alpha, limit), (gate_up_nf4, down_nf4), bounds, w_dtype = ctx.meta
        gate_up = gate_up_nf4 if gate_up_nf4 is not None else gate_up
        down = down_nf4 if down_nf4 is not None else down
        sg = _Segments(perm, expert, ends32, bounds)
        need = ctx.needs_input_grad
        T, H = x.shape
        k = topk_idx.shape[1]
        n, inter = T * k, gu.shape[1] // 2
        dy = dy.to(x.dtype)
        token = perm // k  # each sorted row's token, read twice below
        dys = dy.index_select(0, token)
        G = _expert_gemm(dys, down.transpose(1, 2), sg)  # dy_t Wd_e  [N, I]
        dyb = None
        if d_A is not None:
            dyb = _gmm(dys, d_B.contiguous(), sg)
            G.add_(_gmm(dyb, d_A, sg), alpha=d_scale)
        dgu = x.new_empty((n, 2 * inter))
        need_dA, need_dB = d_A is not None and need[9], d_B is not None and need[10]
        h = x.new_empty((n, inter)) if need_dA else None
        grid, block = _row_grid(n, inter)
        part = torch.empty((n, grid[1]), dtype=torch.float32, device=x.device)
        gu_step, up_off = (2, 1) if interleaved else (1, inter)
        _gated_rows_bwd_kernel[grid](G, G.stride(0), gu, gu.stride(0), route, dgu, dgu.stride(0),
                                     h if h is not None else dgu, h.stride(0) if h is not None else 0, part,
                                     part.stride(0), inter, gu_step, up_off, float(alpha), float(limit), ACT=act,
                                     STORE_H=h is not None, BLOCK_N=block)
        del G
        d_topk_w = None
        if need[2]:  # dw_p = <G_p, h_p> + <dy_t, bd_e>, back from sorted order to the pairs' slots
            dw = torch.empty(n, dtype=torch.float32, device=x.device)
            dw[perm] = part.sum(1)
            dw = dw.view(T, k)
            if d_bias is not None:
                dw = dw + (dy.float() @ d_bias.float().t()).gather(1, topk_idx.long())
            d_topk_w = dw.to(w_dtype)
        del part
        dB_d = _gmm_t(dys, _routed(ha, route), sg, d_scale) if need_dB else None
        dA_d = _gmm_t(_routed(dyb, route), h, sg, d_scale) if need_dA else None
        del dys, dyb, h
        dgub = _gmm(dgu, gu_B.contiguous(), sg) if gu_A is not None and (need[0] or need[7]) else None
        dx = None
        if need[0]:
            dxs = _expert_gemm(dgu, gate_up.transpose(1, 2), sg)  # dgu Wgu_e  [N, H]
            if gu_A is not None:
                dxs.add_(_gmm(dgub, gu_A, sg), alpha=gu_scale)
            slots = _to_slots(dxs, sg)
            del dxs
            dx = sum_slots(slots, T, k, x.dtype)
            del slots
        dB_gu = _gmm_t(dgu, xa, sg, gu_scale) if gu_B is not None and need[8] else None
        dA_gu = _gmm_t(dgub, x.index_select(0, token), sg, gu_scale) if gu_A is not None and need[7] else None
        return dx, None, d_topk_w, None, None, None, None, dA_gu, dB_gu, dA_d, dB_d, None


def moe_expert_mlp_grouped(x, topk_idx, topk_w, gate_up, down, gate_up_bias, down_bias, gu_A, gu_B, d_A, d_B,
                           meta) -> torch.Tensor:
    """``y [T, H]`` of the sparse block on ``grouped_mm`` (checked inputs, factors in ``x``'s dtype, ``meta`` =
    ``(gate_up scaling, down scaling, activation code, interleaved, alpha, limit)``, as
    :func:`~notebookkit.kernels.moe_experts.moe_expert_mlp` prepares them)."""
    return _MoEGroupedFunction.apply(x, topk_idx, topk_w, gate_up, down, gate_up_bias, down_bias, gu_A, gu_B, d_A,
                                     d_B, meta)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py): (kernel, signature, constexprs, options)
# --------------------------------------------------------------------------------------------------


def _aot_specs() -> list:
    """The three row kernels in bf16 (the path's dtype) and fp16 (so they compile for sm_75 too), both
    activations, with the bias (gpt-oss) and without."""
    specs = []
    for ty in ("bf16", "fp16"):
        p = f"*{ty}"
        for act, bias in ((0, False), (1, True)):
            specs.append((_gated_rows_fwd_kernel,
                          {"gu_ptr": p, "stride_gu": "i32", "h_ptr": p, "stride_h": "i32", "bias_ptr": p,
                           "stride_be": "i32", "expert_ptr": "*i32", "inter": "i32", "gu_step": "i32", "up_off": "i32",
                           "alpha": "fp32", "limit": "fp32"}, {"ACT": act, "HAS_BIAS": bias, "BLOCK_N": 1024}))
            specs.append((_gated_rows_bwd_kernel,
                          {"g_ptr": p, "stride_g": "i32", "gu_ptr": p, "stride_gu": "i32", "route_ptr": "*fp32",
                           "dgu_ptr": p, "stride_dgu": "i32", "h_ptr": p, "stride_h": "i32", "part_ptr": "*fp32",
                           "stride_p": "i32", "inter": "i32", "gu_step": "i32", "up_off": "i32", "alpha": "fp32",
                           "limit": "fp32"}, {"ACT": act, "STORE_H": True, "BLOCK_N": 1024}))
        specs.append((_combine_rows_kernel,
                      {"o_ptr": p, "stride_o": "i32", "bias_ptr": p, "stride_be": "i32", "expert_ptr": "*i32",
                       "route_ptr": "*fp32", "perm_ptr": "*i32", "out_ptr": p, "stride_out": "i32", "n_cols": "i32"},
                      {"HAS_BIAS": True, "HAS_ROUTE": True, "BLOCK_N": 1024}))
    return specs


AOT_SPECS = _aot_specs()
