"""Mixture-of-experts expert MLP (the experts of one sparse block) with LoRA on the stacked expert
weights, as grouped GEMMs over the experts' rows with a hand-derived backward.

Inputs (``T`` tokens, hidden ``H``, ``E`` experts of intermediate size ``I``, ``k`` experts a token):
``x [T, H]``, the router's choice ``topk_idx [T, k]`` (int, each in ``[0, E)``) and ``topk_w [T, k]``,
the frozen stacked weights ``Wgu [E, 2I, H]`` and ``Wd [E, H, I]`` (16-bit, any strides: gpt-oss stores
them transposed, ``[E, H, 2I]`` and ``[E, I, H]``, and passes ``.transpose(1, 2)`` views), optional biases
``bgu [E, 2I]``, ``bd [E, H]`` (gpt-oss) and optional LoRA factors on each stacked weight in PEFT's
layout (below). For a token ``t`` and its ``j``-th expert ``e = topk_idx[t, j]`` (a *pair* ``p = (t, j)``,
``w_p = topk_w[t, j]``), with ``s`` each adapter's scaling::

    gu_p = x_t Wgu_e^T + bgu_e + s (x_t Agu_e^T) Bgu_e^T          [2I]   (never Wgu + s B A)
    h_p  = act(gate_p, up_p)                                     [I]
    o_p  = h_p Wd_e^T + bd_e + s (h_p Ad_e^T) Bd_e^T              [H]
    y_t  = sum_j w_p o_p                                         fp32, one rounding to x's dtype

every product accumulated in fp32, the routing weights applied in fp32; ``gu`` and ``h`` are rounded to
the compute dtype (``x``'s) on the way, as in Hugging Face's 16-bit module, so the backward reads back
the very pre-activations the forward's activation saw (for gpt-oss's clamps, whose gradient is all or
nothing, that matters: an fp32 ``gu`` forward with a 16-bit ``gu`` backward disagreed at the limits).

``gate``/``up`` are the halves of ``gu``: concatenated ``[gate; up]`` (Qwen3-MoE: ``.chunk(2, -1)``, gate
first) or interleaved ``gate = gu[0::2]``, ``up = gu[1::2]`` (gpt-oss). Activations (``a`` = alpha, ``L`` =
limit; gpt-oss: ``a = 1.702``, ``L = 7.0``)::

    "swiglu"    h = silu(g) u
    "gpt_oss"   gc = min(g, L), uc = clamp(u, -L, L), h = (uc + 1) gc sigmoid(a gc)

PEFT's layout (``LoraConfig(target_parameters=[...])`` -> ``peft.tuners.lora.layer.ParamWrapper``, peft 0.21):
for a 3-D parameter of ``E`` experts the adapter is two ``nn.Linear``, ``lora_A.weight [r E, in]`` and
``lora_B.weight [out, r E]``, where ``in``/``out`` are the projection's input and output features (PEFT
swaps the parameter's last two dimensions into that order unless the experts module says
``is_transposed``: both Qwen3-MoE ``[E, out, in]`` and gpt-oss ``[E, in, out]`` end up so). Expert ``e``'s
factors are ``A_e = lora_A.weight.reshape(E, r, in)[e]`` (rows ``e r .. e r + r - 1``) and
``B_e = lora_B.weight.reshape(out, r, E)[:, :, e]`` (columns ``j E + e``: rank-major, expert-minor), and
the parameter is used as ``W_e + s B_e A_e`` in the linear orientation (PEFT folds it by
``baddbmm(W, B, A, alpha=s)`` on ``[E, out, in]``, or its transpose for ``[E, in, out]``), ``s = alpha / r``
(``alpha / sqrt(r)`` with rsLoRA). :func:`expert_lora` makes these ``A [E, r, in]``, ``B [E, out, r]`` views
of PEFT's two weights (so gradients land in PEFT's parameters and adapters save and load as PEFT's);
:func:`peft_expert_lora` reads them off a ``ParamWrapper``.

Backward (hand-derived; ``dy [T, H]``; ``G_p`` the unweighted gradient reaching ``h_p``)::

    dyb_p   = dy_t Bd_e                                          [r]
    G_p     = dy_t Wd_e + s dyb_p Ad_e                           [I]   (= dy_t (Wd_e + s Bd_e Ad_e))
    dw_p    = <dy_t, o_p> = <G_p, h_p> + <dy_t, bd_e>                  the router's gradient
    dh_p    = w_p G_p
    dgate, dup = act'(gate_p, up_p) * dh_p                       [2I]  (recomputing h from the saved gu)
    dgub_p  = dgu_p Bgu_e                                        [r]
    dx_t    = sum_j ( dgu_p Wgu_e + s dgub_p Agu_e )
    dBd_e   = s sum_{p in e} (w_p dy_t)^T (h_p Ad_e^T)           [H, r]
    dAd_e   = s sum_{p in e} (w_p dyb_p)^T h_p                   [r, I]
    dBgu_e  = s sum_{p in e} dgu_p^T (x_t Agu_e^T)               [2I, r]
    dAgu_e  = s sum_{p in e} dgub_p^T x_t                        [r, H]

with ``silu' = s_g (1 + g (1 - s_g))`` (``s_g = sigmoid(g)``) for SwiGLU: ``dg = dh u silu'(g)``, ``du = dh silu(g)``;
for gpt-oss ``dg = dh (uc + 1) (sig + a gc sig (1 - sig)) [g <= L]``, ``du = dh gc sig [-L <= u <= L]``
(``sig = sigmoid(a gc)``; the clamps pass the gradient inside their closed range, as ``torch.clamp``).
The frozen expert weights and biases get no gradient; ``topk_idx`` none.

Implementation: the ``N = T k`` pairs are sorted by expert (``perm`` of a stable ``sort`` of
``topk_idx.flatten()``, plain torch; per-expert offsets from ``searchsorted`` on the sorted ids) and cut into
blocks of ``BLOCK_M`` rows inside one expert (a block schedule of at most ``cdiv(N, BLOCK_M) + E`` blocks,
computed on the device: no host sync, so the forward can be captured in a CUDA graph, as the decode step's
sparse block is). Every GEMM is a Triton grouped GEMM over those blocks, ``tl.dot`` with fp32 accumulation,
reading the rows of ``x`` / ``dy`` through ``perm`` (no permuted copy) and weights through their strides
(transposed operands are stride swaps):

* ``_moe_gate_up_kernel``: gate and up tiles of one block (two accumulators), the LoRA term
  ``s (x A^T) B^T`` from the precomputed ``[N, r]`` product, the bias, and the activation in the
  epilogue; writes ``h [N, I]`` and, when training, ``gu [N, 2I]`` (the one activation saved).
* ``_moe_linear_kernel``: the down projection (LoRA term, bias, times ``w_p`` in fp32) written to the
  pair's own row ``perm[p]`` of a ``[T k, H]`` buffer, then ``y = buffer.view(T, k, H).sum(1)`` in fp32:
  a deterministic gather-sum, no atomics. The same kernel computes the ``[N, r]`` LoRA products
  (``x A^T``, ``h A^T``, ``dy B``, ``dgu B``) and the input gradient ``dx`` (scattered, then summed as ``y``).
* ``_moe_down_grad_kernel``: ``G`` with the activation's backward in its epilogue (``dgu``, the
  recomputed ``h`` when the down adapter needs it, and ``<G, h>`` per column tile, summed in torch).
* ``_moe_wgrad_kernel``: the four LoRA factor gradients, one program per (expert, tile), reducing over
  the expert's rows in sorted order (deterministic; an expert without tokens gets exact zeros).

So the backward's GEMMs run through the same grouped kernels (transposed operands); nothing loops over
experts on the host. The CPU path and the test oracle is :func:`moe_expert_mlp_reference` (a loop over
experts in fp32, as Hugging Face's eager experts with the adapters' low-rank terms).

Memory (per layer; ``b`` bytes an element of the compute dtype, ``N = T k`` pairs, ``r`` the rank):

* bookkeeping: ``perm`` (``4 N`` bytes; the sort's int64 temporaries ``8 N`` on the way), the counts and
  offsets (O(E)), the block schedule (``12 (cdiv(N, BLOCK_M) + E)`` bytes), the fp32 routing weights (``4 N``);
* forward transients: ``h`` (``N I b``) and the pairs' output buffer (``N H b``), gone at the return;
* saved for the backward: ``gu`` (``2 N I b``) and, with adapters, ``x Agu^T`` and ``h Ad^T`` (``2 N r b``),
  i.e. ``k (2 I + 2 r) b + 8 k`` bytes a token: Qwen3-30B-A3B (bf16, k = 8, I = 768, H = 2048) 24 KiB a
  token a layer, against ``k H b`` = 32 KiB for the output buffer alone;
* backward transients: ``dgu`` (``2 N I b``), ``h`` again (``N I b``, with a down adapter), the ``[N, r]``
  products ``dy Bd`` and ``dgu Bgu``, the ``dx`` buffer (``N H b``), the ``<G, h>`` partials
  (``4 N cdiv(I, BLOCK_N)`` bytes);
* NF4 experts (:class:`~notebookkit.kernels.nf4_stacked.NF4Stacked`) at training sizes: one decoded chunk of
  experts at a time, held through the GEMM that reads it (:mod:`notebookkit.expert_chunks`: at most the card's
  chunk budget, 128 MiB up to 1 GiB, or one expert).

NF4 experts: with few rows an expert (a decode step) the weight-reading kernels decode the tiles in their
loads; from :data:`~notebookkit.expert_chunks.MIN_ROWS_PER_EXPERT` rows an expert on average they decode a
chunk of whole experts first and run the 16-bit kernels on it, once per chunk (each kernel's ``e_lo, e_hi``
skip the other experts' blocks). On the H200 (``benchmarks/moe_kernels.py``, 2,048 tokens, forward + backward
of one block) the decode in the loads took 103 ms at Qwen3-30B-A3B's shape and 234 ms at gpt-oss-20b's, the
chunks 5.7 and 18.2 ms, 16-bit experts 3.5 and 14.8 ms.

bf16 is GPU-only (``tl.dot`` on bf16 is wrong under triton 3.9's interpreter).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..expert_chunks import chunk_ranges, decodes_in_chunks
from .dequant_gemm import dot_acc
from .moe_experts_grouped import (act_bwd, act_fwd, expert_segments, grouped_mm_applies, moe_expert_mlp_grouped,
                                  sum_slots)
from .nf4_stacked import NF4Stacked, load_weight_tile, weight_operands
from .runtime import should_use_triton

__all__ = ["ExpertLoRA", "expert_lora", "peft_expert_lora", "moe_expert_mlp", "moe_expert_mlp_reference",
           "ACTIVATIONS", "AOT_SPECS"]

#: activation name -> constexpr code in the kernels
ACTIVATIONS = {"swiglu": 0, "gpt_oss": 1}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class ExpertLoRA(NamedTuple):
    """One adapter on a stacked expert weight, expert-major: ``A [E, r, in]``, ``B [E, out, r]`` and
    the scaling ``s``; expert ``e``'s weight is ``W_e + s B[e] A[e]`` (linear orientation ``[out, in]``)."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float


def expert_lora(lora_A_weight: torch.Tensor, lora_B_weight: torch.Tensor, num_experts: int,
                scaling: float) -> ExpertLoRA:
    """Views ``A [E, r, in]`` and ``B [E, out, r]`` of PEFT's ``lora_A.weight [r E, in]`` and
    ``lora_B.weight [out, r E]`` (``ParamWrapper.get_delta_weight``'s reshapes: ``A`` expert-major rows,
    ``B`` columns ``j E + e``); no copy, so gradients reach PEFT's parameters."""
    rE, fan_in = lora_A_weight.shape
    fan_out, rE_b = lora_B_weight.shape
    if rE != rE_b or rE % num_experts:
        raise ValueError(f"expert_lora: lora_A {tuple(lora_A_weight.shape)} and lora_B {tuple(lora_B_weight.shape)} "
                         f"are not the factors of one rank-r adapter over {num_experts} experts.")
    r = rE // num_experts
    A = lora_A_weight.reshape(num_experts, r, fan_in)
    B = lora_B_weight.reshape(fan_out, r, num_experts).permute(2, 0, 1)
    return ExpertLoRA(A, B, float(scaling))


def peft_expert_lora(wrapper, adapter_name: str = "default") -> ExpertLoRA:
    """:func:`expert_lora` of one adapter of a ``peft.tuners.lora.layer.ParamWrapper`` (one adapter, no
    dropout: PEFT refuses dropout on parameters)."""
    return expert_lora(wrapper.lora_A[adapter_name].weight, wrapper.lora_B[adapter_name].weight,
                       wrapper.num_experts, wrapper.scaling[adapter_name])


# --------------------------------------------------------------------------------------------------
# Reference (plain PyTorch: the CPU path and the test oracle)
# --------------------------------------------------------------------------------------------------


def _gate_up_split(gu: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if interleaved:
        return gu[..., 0::2], gu[..., 1::2]
    return gu.chunk(2, dim=-1)


def _activation_reference(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float,
                          limit: float) -> torch.Tensor:
    if activation == "swiglu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _lora_term(a: torch.Tensor, lora: Optional[ExpertLoRA], e: int, acc: torch.dtype) -> torch.Tensor | float:
    if lora is None:
        return 0.0
    return lora.scaling * ((a @ lora.A[e].to(acc).t()) @ lora.B[e].to(acc).t())


def _expert_weight(w, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e`` of a stacked weight: the tensor's slice, or an :class:`NF4Stacked` expert decoded to ``dtype``
    (the compute dtype, as the kernels round their decoded tiles): one expert's scratch at a time."""
    return w.expert(e, dtype) if isinstance(w, NF4Stacked) else w[e]


def moe_expert_mlp_reference(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None,
    gate_up_lora: Optional[ExpertLoRA] = None, down_lora: Optional[ExpertLoRA] = None,
    activation: str = "swiglu", interleaved: Optional[bool] = None, alpha: float = 1.702, limit: float = 7.0,
) -> torch.Tensor:
    """Same math in plain PyTorch, a loop over the experts that receive tokens, in fp32 (fp64 for fp64
    ``x``), with the kernels' roundings to ``x``'s dtype (the pre-activations ``gu``, as Hugging Face's
    16-bit module has them, ``h``, and ``y`` at the end); differentiable by autograd."""
    interleaved = _check(x, topk_idx, topk_w, gate_up, down, gate_up_bias, down_bias, gate_up_lora, down_lora,
                         activation, interleaved)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.zeros(x.shape, dtype=acc, device=x.device)
    for e in torch.unique(topk_idx).tolist():
        tok, j = torch.where(topk_idx == e)
        xe = x[tok].to(acc)
        gu = xe @ _expert_weight(gate_up, e, x.dtype).to(acc).t() + _lora_term(xe, gate_up_lora, e, acc)
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e].to(acc)
        gu = gu.to(x.dtype).to(acc)  # the kernels' roundings: gu and h are stored in x's dtype
        h = _activation_reference(*_gate_up_split(gu, interleaved), activation, alpha, limit).to(x.dtype).to(acc)
        o = h @ _expert_weight(down, e, x.dtype).to(acc).t() + _lora_term(h, down_lora, e, acc)
        if down_bias is not None:
            o = o + down_bias[e].to(acc)
        y = y.index_add(0, tok, o * topk_w[tok, j].to(acc)[:, None])
    return y.to(x.dtype)


def _check(x, topk_idx, topk_w, gate_up, down, gate_up_bias, down_bias, gate_up_lora, down_lora, activation,
           interleaved) -> bool:
    """Refuse inputs that do not fit one another; returns the gate/up layout (interleaved or not)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe_expert_mlp: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}.")
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"moe_expert_mlp: x must be [T, H] and the weights [E, 2I, H], [E, H, I]; got "
                         f"{tuple(x.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}.")
    E, two_i, H = gate_up.shape
    if x.shape[1] != H or two_i % 2 or tuple(down.shape) != (E, H, two_i // 2):
        raise ValueError(f"moe_expert_mlp: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)} and down "
                         f"{tuple(down.shape)} do not fit ([T, H], [E, 2I, H], [E, H, I]; gpt-oss passes its "
                         "[E, H, 2I] / [E, I, H] weights as .transpose(1, 2) views).")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] or topk_w.shape != topk_idx.shape:
        raise ValueError(f"moe_expert_mlp: topk_idx {tuple(topk_idx.shape)} and topk_w {tuple(topk_w.shape)} must "
                         f"both be [T, k] with T = {x.shape[0]}.")
    if topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool:
        raise ValueError(f"moe_expert_mlp: topk_idx must be an integer tensor, got {topk_idx.dtype}.")
    if x.dtype not in _DTYPES + (torch.float64,):
        raise ValueError(f"moe_expert_mlp: x must be float16, bfloat16 or float32, got {x.dtype}.")
    I = two_i // 2
    for name, bias, n in (("gate_up_bias", gate_up_bias, two_i), ("down_bias", down_bias, H)):
        if bias is not None and tuple(bias.shape) != (E, n):
            raise ValueError(f"moe_expert_mlp: {name} must be [{E}, {n}], got {tuple(bias.shape)}.")
    for name, lora, fan_in, fan_out in (("gate_up_lora", gate_up_lora, H, two_i), ("down_lora", down_lora, I, H)):
        if lora is None:
            continue
        r = lora.A.shape[1] if lora.A.dim() == 3 else -1
        if tuple(lora.A.shape) != (E, r, fan_in) or tuple(lora.B.shape) != (E, fan_out, r):
            raise ValueError(f"moe_expert_mlp: {name} must be A [{E}, r, {fan_in}], B [{E}, {fan_out}, r] (expert_lora "
                             f"of PEFT's weights), got {tuple(lora.A.shape)}, {tuple(lora.B.shape)}.")
    if torch.is_grad_enabled():
        for name, t in (("gate_up", gate_up), ("down", down), ("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
            if t is not None and t.requires_grad:
                raise ValueError(f"moe_expert_mlp: {name} requires grad, but the expert weights are frozen here "
                                 "(only the LoRA factors train); call requires_grad_(False) on it.")
    if not x.is_cuda and topk_idx.numel() and (int(topk_idx.min()) < 0 or int(topk_idx.max()) >= E):
        raise ValueError(f"moe_expert_mlp: topk_idx must lie in [0, {E}).")
    return activation == "gpt_oss" if interleaved is None else bool(interleaved)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _acc_rows_wt(acc, a_ptr, a_rows, stride_am, row_ok, w_ptr, w_base, stride_wn, stride_wk, cols, col_ok, K,
                 q_absmax_ptr, q_table_ptr, q_code2_ptr, q_absmax2_ptr, q_offset_ptr,
                 NF4: tl.constexpr, NESTED: tl.constexpr, QBLOCK: tl.constexpr, QBLOCK2: tl.constexpr,
                 BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """``acc + A[a_rows, :K] @ W[cols, :K]^T`` (``A`` unit column stride, ``W`` any strides from element
    ``w_base``, NF4-decoded when ``NF4``, cast to ``A``'s dtype)."""
    rk = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = load_weight_tile(w_ptr, w_base + kk[:, None] * stride_wk + cols[None, :] * stride_wn,
                             k_ok[:, None] & col_ok[None, :], q_absmax_ptr, q_table_ptr, q_code2_ptr, q_absmax2_ptr,
                             q_offset_ptr, NF4, NESTED, QBLOCK, QBLOCK2)
        acc = dot_acc(a, w.to(a.dtype), acc, IEEE)
    return acc


@triton.jit
def _block_rows(blk_start_ptr, blk_end_ptr, BLOCK_M: tl.constexpr):
    """Sorted rows ``[start, end)`` of this program's block, as ``BLOCK_M`` int64 indices and their mask."""
    b = tl.program_id(0)
    start = tl.load(blk_start_ptr + b).to(tl.int64)
    end = tl.load(blk_end_ptr + b).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_M)
    return rows, rows < end


@triton.jit
def _moe_linear_kernel(
    a_ptr, stride_am, a2_ptr, stride_a2m,
    w_ptr, stride_we, stride_wn, stride_wk,
    q_absmax_ptr, q_table_ptr, q_code2_ptr, q_absmax2_ptr, q_offset_ptr,
    w2_ptr, stride_w2e, stride_w2n, stride_w2k,
    bias_ptr, stride_be, route_ptr, out_ptr, stride_om,
    perm_ptr, blk_expert_ptr, blk_start_ptr, blk_end_ptr,
    n_out, k_in, rank, topk, lora_scale, e_lo, e_hi,
    A_GATHER: tl.constexpr, SCATTER: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROUTE_SCALE: tl.constexpr, NF4: tl.constexpr, NESTED: tl.constexpr, QBLOCK: tl.constexpr, QBLOCK2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
):
    """out[o(p), n] = (A[a(p)] W_e^T + s A2[p] W2_e^T + bias_e)[n] (* w_p) for the sorted pairs ``p`` of a block of
    expert ``e``; ``a(p)`` = the pair's token (A_GATHER) or ``p``, ``o(p)`` = the pair's slot ``perm[p]``
    (SCATTER) or ``p``. Only the blocks of experts ``[e_lo, e_hi)`` run; ``W`` holds those experts from ``e_lo``."""
    e = tl.load(blk_expert_ptr + tl.program_id(0))
    if (e < e_lo) | (e >= e_hi):
        return
    e = e.to(tl.int64)
    rows, ok = _block_rows(blk_start_ptr, blk_end_ptr, BLOCK_M)
    pair = tl.load(perm_ptr + rows, mask=ok, other=0).to(tl.int64)
    if A_GATHER:
        a_rows = pair // topk
    else:
        a_rows = rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _acc_rows_wt(acc, a_ptr, a_rows, stride_am, ok, w_ptr, (e - e_lo) * stride_we, stride_wn, stride_wk, cols, col_ok,
                       k_in, q_absmax_ptr, q_table_ptr, q_code2_ptr, q_absmax2_ptr, q_offset_ptr, NF4, NESTED, QBLOCK,
                       QBLOCK2, BLOCK_K, IEEE)
    if HAS_LORA:
        low = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        low = _acc_rows_wt(low, a2_ptr, rows, stride_a2m, ok, w2_ptr, e * stride_w2e, stride_w2n, stride_w2k, cols,
                           col_ok, rank, q_absmax_ptr, q_table_ptr, q_code2_ptr, q_absmax2_ptr, q_offset_ptr, False,
                           False, QBLOCK, QBLOCK2, BLOCK_R, IEEE)
        acc += lora_scale * low
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ROUTE_SCALE:
        acc = acc * tl.load(route_ptr + pair, mask=ok, other=0.0)[:, None]
    if SCATTER:
        out_rows = pair
    else:
        out_rows = rows
    tl.store(out_ptr + out_rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, stride_xm, xa_ptr, stride_xam,
    w_ptr, stride_we, stride_wn, stride_wk,
    q_absmax_ptr, q_table_ptr, q_code2_ptr, q_absmax2_ptr, q_offset_ptr,
    b_ptr, stride_be, stride_bn, stride_bk,
    bias_ptr, stride_biase, h_ptr, stride_hm, gu_ptr, stride_gum,
    perm_ptr, blk_expert_ptr, blk_start_ptr, blk_end_ptr,
    inter, hidden, rank, topk, gu_step, up_off, lora_scale, alpha, limit, e_lo, e_hi,
    ACT: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE_GU: tl.constexpr,
    NF4: tl.constexpr, NESTED: tl.constexpr, QBLOCK: tl.constexpr, QBLOCK2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
):
    """h[p, n] = act(gate, up) of ``gu_p = x_t Wgu_e^T + s xa_p B_e^T + bias_e`` at gate row ``n gu_step`` and up row
    ``n gu_step + up_off`` of ``Wgu_e`` (concatenated: ``(1, I)``; interleaved: ``(2, 1)``); SAVE_GU also stores gu.
    Only the blocks of experts ``[e_lo, e_hi)`` run; ``Wgu`` holds those experts from ``e_lo``."""
    e = tl.load(blk_expert_ptr + tl.program_id(0))
    if (e < e_lo) | (e >= e_hi):
        return
    e = e.to(tl.int64)
    rows, ok = _block_rows(blk_start_ptr, blk_end_ptr, BLOCK_M)
    pair = tl.load(perm_ptr + rows, mask=ok, other=0).to(tl.int64)
    tok = pair // topk
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    gcol = n * gu_step
    ucol = gcol + up_off
    w_base = (e - e_lo) * stride_we
    rk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < hidden
        xt = tl.load(x_ptr + tok[:, None] * stride_xm + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & n_ok[None, :]
        k_off = w_base + kk[:, None] * stride_wk
        wg = load_weight_tile(w_ptr, k_off + gcol[None, :] * stride_wn, wmask, q_absmax_ptr, q_table_ptr, q_code2_ptr,
                              q_absmax2_ptr, q_offset_ptr, NF4, NESTED, QBLOCK, QBLOCK2)
        wu = load_weight_tile(w_ptr, k_off + ucol[None, :] * stride_wn, wmask, q_absmax_ptr, q_table_ptr, q_code2_ptr,
                              q_absmax2_ptr, q_offset_ptr, NF4, NESTED, QBLOCK, QBLOCK2)
        acc_g = dot_acc(xt, wg.to(xt.dtype), acc_g, IEEE)
        acc_u = dot_acc(xt, wu.to(xt.dtype), acc_u, IEEE)
    if HAS_LORA:
        low_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        low_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        low_g = _acc_rows_wt(low_g, xa_ptr, rows, stride_xam, ok, b_ptr, e * stride_be, stride_bn, stride_bk, gcol,
                             n_ok, rank, q_absmax_ptr, q_table_ptr, q_code2_ptr, q_absmax2_ptr, q_offset_ptr, False,
                             False, QBLOCK, QBLOCK2, BLOCK_R, IEEE)
        low_u = _acc_rows_wt(low_u, xa_ptr, rows, stride_xam, ok, b_ptr, e * stride_be, stride_bn, stride_bk, ucol,
                             n_ok, rank, q_absmax_ptr, q_table_ptr, q_code2_ptr, q_absmax2_ptr, q_offset_ptr, False,
                             False, QBLOCK, QBLOCK2, BLOCK_R, IEEE)
        acc_g += lora_scale * low_g
        acc_u += lora_scale * low_u
    if HAS_BIAS:
        acc_g += tl.load(bias_ptr + e * stride_biase + gcol, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(bias_ptr + e * stride_biase + ucol, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    mask = ok[:, None] & n_ok[None, :]
    # gate and up rounded to the compute dtype before the activation: the values the backward reads back
    gate = acc_g.to(h_ptr.dtype.element_ty)
    up = acc_u.to(h_ptr.dtype.element_ty)
    if SAVE_GU:
        tl.store(gu_ptr + rows[:, None] * stride_gum + gcol[None, :], gate, mask=mask)
        tl.store(gu_ptr + rows[:, None] * stride_gum + ucol[None, :], up, mask=mask)
    h = act_fwd(gate.to(tl.float32), up.to(tl.float32), ACT, alpha, limit)
    tl.store(h_ptr + rows[:, None] * stride_hm + n[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _moe_down_grad_kernel(
    dy_ptr, stride_dym, dyb_ptr, stride_dybm,
    w_ptr, stride_we, stride_wn, stride_wk,
    q_absmax_ptr, q_table_ptr, q_code2_ptr, q_absmax2_ptr, q_offset_ptr,
    a_ptr, stride_ae, stride_an, stride_ak,
    gu_ptr, stride_gum, route_ptr, dgu_ptr, stride_dgum, h_ptr, stride_hm, part_ptr, stride_pm,
    perm_ptr, blk_expert_ptr, blk_start_ptr, blk_end_ptr,
    inter, hidden, rank, topk, gu_step, up_off, lora_scale, alpha, limit, e_lo, e_hi,
    ACT: tl.constexpr, HAS_LORA: tl.constexpr, STORE_H: tl.constexpr,
    NF4: tl.constexpr, NESTED: tl.constexpr, QBLOCK: tl.constexpr, QBLOCK2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
):
    """G = dy_t Wd_e + s dyb_p Ad_e on columns ``n`` of I, then the activation's backward at the saved gu with
    ``dh = w_p G``: stores dgu (gu's layout), ``h`` (STORE_H) and ``part[p, tile] = <G, h>`` over the tile. Only
    the blocks of experts ``[e_lo, e_hi)`` run; ``Wd`` holds those experts from ``e_lo``."""
    e = tl.load(blk_expert_ptr + tl.program_id(0))
    if (e < e_lo) | (e >= e_hi):
        return
    e = e.to(tl.int64)
    rows, ok = _block_rows(blk_start_ptr, blk_end_ptr, BLOCK_M)
    pair = tl.load(perm_ptr + rows, mask=ok, other=0).to(tl.int64)
    tok = pair // topk
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g = _acc_rows_wt(g, dy_ptr, tok, stride_dym, ok, w_ptr, (e - e_lo) * stride_we, stride_wn, stride_wk, n, n_ok, hidden,
                     q_absmax_ptr, q_table_ptr, q_code2_ptr, q_absmax2_ptr, q_offset_ptr, NF4, NESTED, QBLOCK, QBLOCK2,
                     BLOCK_K, IEEE)
    if HAS_LORA:
        low = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        low = _acc_rows_wt(low, dyb_ptr, rows, stride_dybm, ok, a_ptr, e * stride_ae, stride_an, stride_ak, n, n_ok,
                           rank, q_absmax_ptr, q_table_ptr, q_code2_ptr, q_absmax2_ptr, q_offset_ptr, False, False,
                           QBLOCK, QBLOCK2, BLOCK_R, IEEE)
        g += lora_scale * low
    mask = ok[:, None] & n_ok[None, :]
    gcol = n * gu_step
    ucol = gcol + up_off
    gate = tl.load(gu_ptr + rows[:, None] * stride_gum + gcol[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + rows[:, None] * stride_gum + ucol[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(route_ptr + pair, mask=ok, other=0.0)
    h, dg, du = act_bwd(gate, up, g * w[:, None], ACT, alpha, limit)
    tl.store(dgu_ptr + rows[:, None] * stride_dgum + gcol[None, :], dg.to(dgu_ptr.dtype.element_ty), mask=mask)
    tl.store(dgu_ptr + rows[:, None] * stride_dgum + ucol[None, :], du.to(dgu_ptr.dtype.element_ty), mask=mask)
    if STORE_H:
        tl.store(h_ptr + rows[:, None] * stride_hm + n[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
    tl.store(part_ptr + rows * stride_pm + tl.program_id(1), tl.sum(tl.where(mask, g * h, 0.0), axis=1), mask=ok)


@triton.jit
def _moe_wgrad_kernel(
    l_ptr, stride_lm, r_ptr, stride_rm, route_ptr, out_ptr, stride_oe, stride_om,
    perm_ptr, seg_start_ptr, seg_end_ptr,
    m_size, n_size, topk, scale,
    L_GATHER: tl.constexpr, R_GATHER: tl.constexpr, ROUTE_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    """out[e, m, n] = scale sum_{p in e} L[l(p), m] (w_p) R[r(p), n] over expert ``e``'s sorted rows, in order;
    ``l(p)``/``r(p)`` the pair's token (L_GATHER / R_GATHER) or ``p``. An expert without rows writes zeros."""
    e = tl.program_id(0).to(tl.int64)
    start = tl.load(seg_start_ptr + e).to(tl.int64)
    end = tl.load(seg_end_ptr + e).to(tl.int64)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < m_size
    n_ok = n < n_size
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rows = r0 + rk
        ok = rows < end
        pair = tl.load(perm_ptr + rows, mask=ok, other=0).to(tl.int64)
        if L_GATHER:
            l_rows = pair // topk
        else:
            l_rows = rows
        if R_GATHER:
            r_rows = pair // topk
        else:
            r_rows = rows
        lt = tl.load(l_ptr + l_rows[None, :] * stride_lm + m[:, None], mask=m_ok[:, None] & ok[None, :], other=0.0)
        if ROUTE_SCALE:
            w = tl.load(route_ptr + pair, mask=ok, other=0.0)
            lt = (lt.to(tl.float32) * w[None, :]).to(lt.dtype)
        rt = tl.load(r_ptr + r_rows[:, None] * stride_rm + n[None, :], mask=ok[:, None] & n_ok[None, :], other=0.0)
        acc = dot_acc(lt, rt.to(lt.dtype), acc, IEEE)
    acc = acc * scale
    tl.store(out_ptr + e * stride_oe + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


class _Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    chunked: bool = False  # NF4 experts decoded a chunk of experts at a time (notebookkit.expert_chunks)


#: the configuration that decodes NF4 in the weight loads, and every kernel's on GPUs before sm_90
_CUDA_CONFIG = _Config(64, 64, 32, 4, 3)
#: 16-bit weights on sm_90, and with 256 or more rows an expert on average
_SM90_CONFIG = _Config(64, 64, 64, 4, 4)
_SM90_LONG_CONFIG = _Config(128, 64, 64, 4, 3)


def _config(device: torch.device, pairs: int = 0, num_experts: int = 1, nf4: bool = False) -> _Config:
    """The launch configuration of one call with ``pairs`` routed rows. NF4 experts are decoded in chunks when
    :func:`~notebookkit.expert_chunks.decodes_in_chunks` says so, else in the weight loads.

    On CUDA, weights decoded in the loads keep 64 x 64 tiles with K steps of 32 (larger tiles need more shared
    memory than the H200 has with that decode). 16-bit weights, or NF4 decoded in chunks, on sm_90 take the H200
    sweep's pick (``benchmarks/moe_kernels.py``, 2026-12-04): K steps of 64, and 128 rows a block when an expert
    averages 256 rows or more (gpt-oss-20b's block at 2,048 tokens, forward + backward 14.8 ms against 19.1 with
    the first configuration), else 64 rows and 4 stages (Qwen3-30B-A3B's: 3.8 ms against 4.5). Other GPUs keep
    the first configuration (not measured). Under the interpreter small tiles: the tests' tiny shapes then still
    take several row blocks, column tiles and K steps."""
    chunked = nf4 and decodes_in_chunks(pairs, num_experts)
    if device.type != "cuda":
        return _Config(32, 32, 32, 1, 1, chunked)
    if (nf4 and not chunked) or torch.cuda.get_device_capability(device) < (9, 0):
        return _CUDA_CONFIG._replace(chunked=chunked)
    return (_SM90_LONG_CONFIG if pairs >= 256 * num_experts else _SM90_CONFIG)._replace(chunked=chunked)


def _expert_ranges(w: Any, cfg: _Config) -> list[tuple[int, int]]:
    """The expert ranges ``[lo, hi)`` one weight-reading kernel is launched for: all experts at once, or with
    ``cfg.chunked`` the chunks of :func:`~notebookkit.expert_chunks.experts_per_chunk`."""
    E, n, k = w.shape
    if not (cfg.chunked and isinstance(w, NF4Stacked)):
        return [(0, E)]
    return chunk_ranges(E, n * k * torch.empty((), dtype=w.dtype).element_size(), w.chunk_bytes)


def _expert_operand(w: Any, lo: int, hi: int, cfg: _Config, dtype: torch.dtype) -> Any:
    """The weight operand of experts ``[lo, hi)``: ``w`` itself, or with ``cfg.chunked`` those NF4 experts
    decoded to ``dtype`` (:meth:`NF4Stacked.decode_experts`)."""
    if cfg.chunked and isinstance(w, NF4Stacked):
        return w.decode_experts(lo, hi, dtype)
    return w


def _rank_block(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


class _Routing(NamedTuple):
    perm: torch.Tensor  # [N] int32: pair slot t k + j of each sorted row
    seg_start: torch.Tensor  # [E] int32: first sorted row of each expert
    seg_end: torch.Tensor  # [E] int32
    blk_expert: torch.Tensor  # [MB] int32: expert of each row block, -1 past the last
    blk_start: torch.Tensor  # [MB] int32
    blk_end: torch.Tensor  # [MB] int32
    topk: int


@triton.jit
def _block_schedule_kernel(starts_ptr, ends_ptr, blk_expert_ptr, blk_start_ptr, blk_end_ptr, num_experts, num_blocks,
                           block_m, E_POW2: tl.constexpr, BLOCK_B: tl.constexpr):
    """Row blocks ``[pid BLOCK_B, (pid + 1) BLOCK_B)`` of the schedule (:func:`_block_schedule_reference`'s
    arithmetic, in int32): with ``c_e = cdiv(ends_e - starts_e, block_m)`` and ``C_e = sum_{j <= e} c_j``, block
    ``b`` belongs to expert ``e = #{j : C_j <= b}``, covers rows ``[starts_e + (b - C_e + c_e) block_m, ends_e)``;
    past the last block (``e = E``): expert -1, rows 0, 0. Every program reads the ``E`` segment bounds (a few
    hundred bytes) and takes ``C``, the expert and its bounds by masked sums over ``[BLOCK_B, E]``."""
    es = tl.arange(0, E_POW2)
    e_ok = es < num_experts
    starts = tl.load(starts_ptr + es, mask=e_ok, other=0)
    ends = tl.load(ends_ptr + es, mask=e_ok, other=0)
    blocks = (ends - starts + block_m - 1) // block_m  # 0 past the last expert
    cum = tl.cumsum(blocks, axis=0)
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    e = tl.sum((cum[None, :] <= b[:, None]).to(tl.int32), axis=1)  # searchsorted(C, b, right=True)
    valid = e < num_experts
    owner = es[None, :] == tl.minimum(e, num_experts - 1)[:, None]  # [BLOCK_B, E_POW2]: one True a row
    first = tl.sum(tl.where(es[None, :] < e[:, None], blocks[None, :], 0), axis=1)  # C_e - c_e
    start = tl.sum(tl.where(owner, starts[None, :], 0), axis=1) + (b - first) * block_m
    end = tl.sum(tl.where(owner, ends[None, :], 0), axis=1)
    ok = b < num_blocks
    tl.store(blk_expert_ptr + b, tl.where(valid, e, -1), mask=ok)
    tl.store(blk_start_ptr + b, tl.where(valid, start, 0), mask=ok)
    tl.store(blk_end_ptr + b, tl.where(valid, end, 0), mask=ok)


_SCHEDULE_BLOCK_B = 16  # row blocks a program of the schedule kernel ([16, E] tiles: 16 values a thread at E = 128)


def _block_schedule_reference(starts: torch.Tensor, ends: torch.Tensor, num_blocks: int,
                              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(blk_expert, blk_start, blk_end)`` (int32, ``[num_blocks]``) of each expert's sorted rows ``[starts_e,
    ends_e)`` cut into blocks of ``block_m`` rows (plain PyTorch: the kernel's oracle)."""
    num_experts = starts.numel()
    n_blk = (ends - starts + block_m - 1) // block_m
    blk_cum = n_blk.cumsum(0)
    b = torch.arange(num_blocks, device=starts.device)
    be = torch.searchsorted(blk_cum, b, right=True)
    valid = be < num_experts
    bec = be.clamp(max=num_experts - 1)
    blk_start = starts[bec] + (b - (blk_cum[bec] - n_blk[bec])) * block_m
    i32 = torch.int32
    return (torch.where(valid, be, -1).to(i32), torch.where(valid, blk_start, 0).to(i32),
            torch.where(valid, ends[bec], 0).to(i32))


def _routing(topk_idx: torch.Tensor, num_experts: int, block_m: int) -> _Routing:
    """Sort the pairs by expert (stable: by token inside an expert) and cut each expert's rows into blocks of
    ``block_m``: at most ``cdiv(N, block_m) + E`` blocks, so the grid is known without reading the counts.

    Nothing here reads the device from the host (the decode step runs it inside a CUDA graph): each
    expert's segment of the sorted ids comes from ``searchsorted``, not ``bincount`` (whose CUDA version
    reads the largest id on the host to size its output). The block schedule is one launch
    (:func:`_block_schedule_kernel`), where its tensor arithmetic made about twenty."""
    perm, _, starts, ends = expert_segments(topk_idx, num_experts)
    num_blocks = triton.cdiv(topk_idx.numel(), block_m) + num_experts
    schedule = [torch.empty(num_blocks, dtype=torch.int32, device=topk_idx.device) for _ in range(3)]
    _block_schedule_kernel[(triton.cdiv(num_blocks, _SCHEDULE_BLOCK_B),)](
        starts, ends, *schedule, num_experts, num_blocks, block_m,
        E_POW2=triton.next_power_of_2(num_experts), BLOCK_B=_SCHEDULE_BLOCK_B)
    return _Routing(perm.to(torch.int32), starts, ends, *schedule, topk_idx.shape[1])


def _linear(rt: _Routing, cfg: _Config, a: torch.Tensor, w: torch.Tensor, n_out: int, out: torch.Tensor, *,
            a_gather: bool = False, scatter: bool = False, lora: Optional[tuple] = None,
            bias: Optional[torch.Tensor] = None, route: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``_moe_linear_kernel`` with ``w`` an ``[E, n_out, K]`` view (any strides, or an :class:`NF4Stacked`) and
    ``lora = (a2 [N, r], w2 [E, n_out, r] view, scale)``; once per expert range of :func:`_expert_ranges`."""
    k_in = w.shape[2]
    if lora is not None:
        a2, w2, scale = lora
        rank = w2.shape[2]
    else:
        a2, w2, scale, rank = a, a[None], 0.0, 1
    block_r = _rank_block(rank)
    block_n = block_r if n_out <= block_r else cfg.block_n
    dummy = route if route is not None else a
    grid = (rt.blk_expert.numel(), triton.cdiv(n_out, block_n))
    for lo, hi in _expert_ranges(w, cfg):
        operand = _expert_operand(w, lo, hi, cfg, a.dtype)
        w_args, q_consts = weight_operands(operand)
        _moe_linear_kernel[grid](
            a, a.stride(0), a2, a2.stride(0), *w_args, w2, w2.stride(0), w2.stride(1), w2.stride(2),
            bias if bias is not None else dummy, bias.stride(0) if bias is not None else 0, dummy, out,
            out.stride(0), rt.perm, rt.blk_expert, rt.blk_start, rt.blk_end, n_out, k_in, rank, rt.topk, float(scale),
            lo, hi, A_GATHER=a_gather, SCATTER=scatter, HAS_LORA=lora is not None, HAS_BIAS=bias is not None,
            ROUTE_SCALE=route is not None, **q_consts, BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k,
            BLOCK_R=block_r, IEEE=a.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=not q_consts["NESTED"])
        del operand, w_args  # a decoded chunk is freed before the next is decoded
    return out


def _wgrad(rt: _Routing, cfg: _Config, l: torch.Tensor, r: torch.Tensor, m_size: int, n_size: int, scale: float,
           out_dtype: torch.dtype, *, l_gather: bool = False, r_gather: bool = False,
           route: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[E, m_size, n_size]``: ``scale sum_{p in e} L[l(p)]^T (w_p) R[r(p)]`` (``_moe_wgrad_kernel``)."""
    E = rt.seg_start.numel()
    out = torch.empty((E, m_size, n_size), dtype=out_dtype, device=l.device)
    bm = _rank_block(m_size) if m_size < cfg.block_m else cfg.block_m  # a rank-sized side in one tile
    bn = _rank_block(n_size) if n_size < cfg.block_n else cfg.block_n
    grid = (E, triton.cdiv(m_size, bm), triton.cdiv(n_size, bn))
    _moe_wgrad_kernel[grid](
        l, l.stride(0), r, r.stride(0), route if route is not None else l, out, out.stride(0), out.stride(1),
        rt.perm, rt.seg_start, rt.seg_end, m_size, n_size, rt.topk, float(scale),
        L_GATHER=l_gather, R_GATHER=r_gather, ROUTE_SCALE=route is not None, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=max(cfg.block_k, 16), IEEE=l.dtype == torch.float32, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


class _MoEExpertMLPFunction(torch.autograd.Function):
    """Inputs: ``x, topk_idx, topk_w, gate_up [E, 2I, H], down [E, H, I], gate_up_bias, down_bias, gate_up A
    [E, r, H], B [E, 2I, r], down A [E, r, I], B [E, H, r]`` (factors in ``x``'s dtype, ``None`` without
    adapter) and ``meta = (gate_up scaling, down scaling, activation code, interleaved, alpha, limit)``."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_w, gate_up, down, gu_bias, d_bias, gu_A, gu_B, d_A, d_B, meta):
        gu_scale, d_scale, act, interleaved, alpha, limit = meta
        T, H = x.shape
        E, two_i, _ = gate_up.shape
        inter = two_i // 2
        k = topk_idx.shape[1]
        n = T * k
        cfg = _config(x.device, n, E, isinstance(gate_up, NF4Stacked) or isinstance(down, NF4Stacked))
        x = x if x.stride(1) == 1 else x.contiguous()
        rt = _routing(topk_idx, E, cfg.block_m)
        route = topk_w.reshape(-1).to(torch.float32).contiguous()
        gu_step, up_off = (2, 1) if interleaved else (1, inter)
        xa = ha = None
        if gu_A is not None:
            xa = _linear(rt, cfg, x, gu_A, gu_A.shape[1], x.new_empty((n, gu_A.shape[1])), a_gather=True)
        train = any(ctx.needs_input_grad)
        gu = x.new_empty((n, two_i)) if train else None
        h = x.new_empty((n, inter))
        rank_gu = gu_A.shape[1] if gu_A is not None else 1
        block_r = _rank_block(rank_gu)
        b_gu = gu_B if gu_B is not None else x[None]  # unused: any 3-D view
        bias = gu_bias if gu_bias is not None else route
        for lo, hi in _expert_ranges(gate_up, cfg):
            operand = _expert_operand(gate_up, lo, hi, cfg, x.dtype)
            w_args, q_consts = weight_operands(operand)
            _moe_gate_up_kernel[(rt.blk_expert.numel(), triton.cdiv(inter, cfg.block_n))](
                x, x.stride(0), xa if xa is not None else x, xa.stride(0) if xa is not None else 0, *w_args,
                b_gu, b_gu.stride(0), b_gu.stride(1), b_gu.stride(2),
                bias, bias.stride(0), h, h.stride(0), gu if gu is not None else h,
                gu.stride(0) if gu is not None else 0, rt.perm, rt.blk_expert, rt.blk_start, rt.blk_end,
                inter, H, rank_gu, k, gu_step, up_off, float(gu_scale), float(alpha), float(limit), lo, hi,
                ACT=act, HAS_LORA=gu_A is not None, HAS_BIAS=gu_bias is not None, SAVE_GU=gu is not None, **q_consts,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=block_r,
                IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                enable_fp_fusion=not q_consts["NESTED"])
            del operand, w_args  # a decoded chunk is freed before the next is decoded
        if d_A is not None:
            ha = _linear(rt, cfg, h, d_A, d_A.shape[1], x.new_empty((n, d_A.shape[1])))
        buf = x.new_empty((n, H))
        _linear(rt, cfg, h, down, H, buf, scatter=True, lora=(ha, d_B, d_scale) if d_A is not None else None,
                bias=d_bias, route=route)
        del h
        y = sum_slots(buf, T, k, x.dtype)
        if train:  # an NF4Stacked is no tensor: kept on ctx (its tensors are the frozen parameter's own)
            nf4 = tuple(w if isinstance(w, NF4Stacked) else None for w in (gate_up, down))
            ctx.save_for_backward(x, topk_idx, topk_w, *(None if q is not None else w for w, q in
                                                          zip((gate_up, down), nf4)),
                                  d_bias, gu_A, gu_B, d_A, d_B, gu, xa, ha, route, *rt[:6])
            ctx.meta = (meta, k, cfg, nf4)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x, topk_idx, topk_w, gate_up, down, d_bias, gu_A, gu_B, d_A, d_B, gu, xa, ha, route, *rtt) = ctx.saved_tensors
        (gu_scale, d_scale, act, interleaved, alpha, limit), k, cfg, (gate_up_nf4, down_nf4) = ctx.meta
        gate_up = gate_up_nf4 if gate_up_nf4 is not None else gate_up
        down = down_nf4 if down_nf4 is not None else down
        rt = _Routing(*rtt, k)
        need = ctx.needs_input_grad
        need_x, need_w = need[0], need[2]
        need_guA, need_guB = gu_A is not None and need[7], gu_B is not None and need[8]
        need_dA, need_dB = d_A is not None and need[9], d_B is not None and need[10]
        dy = dy if dy.stride(1) == 1 else dy.contiguous()
        dy = dy.to(x.dtype)
        T, H = x.shape
        E, two_i, _ = gate_up.shape
        inter = two_i // 2
        n = T * k
        gu_step, up_off = (2, 1) if interleaved else (1, inter)
        dyb = None
        if d_A is not None:  # dy B: the low-rank part of G, and dA's left operand
            dyb = _linear(rt, cfg, dy, d_B.transpose(1, 2), d_B.shape[2], x.new_empty((n, d_B.shape[2])),
                          a_gather=True)
        dgu = x.new_empty((n, two_i))
        h = x.new_empty((n, inter)) if need_dA else None
        n_tiles = triton.cdiv(inter, cfg.block_n)
        part = torch.empty((n, n_tiles), dtype=torch.float32, device=x.device)
        down_t = down.transpose(1, 2)  # [E, I, H]: G = dy Wd as A W^T
        a_t = d_A.transpose(1, 2) if d_A is not None else dy[None]  # [E, I, r]; unused without adapter
        rank_d = d_A.shape[1] if d_A is not None else 1
        for lo, hi in _expert_ranges(down_t, cfg):
            operand = _expert_operand(down_t, lo, hi, cfg, x.dtype)
            w_args, q_consts = weight_operands(operand)
            _moe_down_grad_kernel[(rt.blk_expert.numel(), n_tiles)](
                dy, dy.stride(0), dyb if dyb is not None else dy, dyb.stride(0) if dyb is not None else 0,
                *w_args, a_t, a_t.stride(0), a_t.stride(1), a_t.stride(2),
                gu, gu.stride(0), route, dgu, dgu.stride(0),
                h if h is not None else dgu, h.stride(0) if h is not None else 0,
                part, part.stride(0), rt.perm, rt.blk_expert, rt.blk_start, rt.blk_end,
                inter, H, rank_d, k, gu_step, up_off, float(d_scale), float(alpha), float(limit), lo, hi,
                ACT=act, HAS_LORA=d_A is not None, STORE_H=h is not None, **q_consts,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=_rank_block(rank_d),
                IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                enable_fp_fusion=not q_consts["NESTED"])
            del operand, w_args  # a decoded chunk is freed before the next is decoded

        d_topk_w = None
        if need_w:  # dw_p = <G_p, h_p> + <dy_t, bd_e>, back from sorted order to the pairs' slots
            dw = torch.empty(n, dtype=torch.float32, device=x.device)
            dw[rt.perm.long()] = part.sum(1)
            dw = dw.view(T, k)
            if d_bias is not None:
                dw = dw + (dy.float() @ d_bias.float().t()).gather(1, topk_idx.long())
            d_topk_w = dw.to(topk_w.dtype)

        dB_d = _wgrad(rt, cfg, dy, ha, H, d_B.shape[2], d_scale, d_B.dtype, l_gather=True, route=route) \
            if need_dB else None
        dA_d = _wgrad(rt, cfg, dyb, h, d_A.shape[1], inter, d_scale, d_A.dtype, route=route) if need_dA else None
        del h, dyb

        dgub = None
        if gu_A is not None and (need_x or need_guA):
            dgub = _linear(rt, cfg, dgu, gu_B.transpose(1, 2), gu_B.shape[2], x.new_empty((n, gu_B.shape[2])))
        dx = None
        if need_x:
            buf = x.new_empty((n, H))
            _linear(rt, cfg, dgu, gate_up.transpose(1, 2), H, buf, scatter=True,
                    lora=(dgub, gu_A.transpose(1, 2), gu_scale) if gu_A is not None else None)
            dx = sum_slots(buf, T, k, x.dtype)
            del buf
        dB_gu = _wgrad(rt, cfg, dgu, xa, two_i, gu_B.shape[2], gu_scale, gu_B.dtype) if need_guB else None
        dA_gu = _wgrad(rt, cfg, dgub, x, gu_A.shape[1], H, gu_scale, gu_A.dtype, r_gather=True) if need_guA else None
        return dx, None, d_topk_w, None, None, None, None, dA_gu, dB_gu, dA_d, dB_d, None


def moe_expert_mlp(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None,
    gate_up_lora: Optional[ExpertLoRA] = None, down_lora: Optional[ExpertLoRA] = None,
    activation: str = "swiglu", interleaved: Optional[bool] = None, alpha: float = 1.702, limit: float = 7.0,
) -> torch.Tensor:
    """The experts of one sparse MoE block: ``y[t] = sum_j topk_w[t, j] expert_{topk_idx[t, j]}(x[t])``.

    Args:
        x: ``[T, H]`` hidden states (fp16, bf16 or fp32).
        topk_idx: ``[T, k]`` the router's experts (int, in ``[0, E)``); not differentiable.
        topk_w: ``[T, k]`` their weights (any float dtype; used in fp32); gets the router's gradient.
        gate_up: ``[E, 2I, H]`` frozen stacked gate/up weight (Qwen3-MoE's ``gate_up_proj``; gpt-oss:
            ``gate_up_proj.transpose(1, 2)``).
        down: ``[E, H, I]`` frozen stacked down weight (gpt-oss: ``down_proj.transpose(1, 2)``).
        gate_up_bias, down_bias: ``[E, 2I]``, ``[E, H]`` frozen biases (gpt-oss), or ``None``.
        gate_up_lora, down_lora: :class:`ExpertLoRA` of the adapter on each weight (:func:`peft_expert_lora`
            of PEFT's ``ParamWrapper``), or ``None``. Factors in another dtype are cast to ``x``'s for the
            GEMMs; their gradients come back in their own dtype.
        activation: ``"swiglu"`` (``silu(gate) * up``) or ``"gpt_oss"`` (clamped, ``alpha``, ``limit``).
        interleaved: gate/up rows of ``gate_up`` interleaved (gpt-oss) instead of ``[gate; up]``; default:
            interleaved for ``"gpt_oss"``, concatenated for ``"swiglu"``.

    Returns:
        ``y [T, H]`` in ``x``'s dtype. CUDA tensors (or Triton forced under the interpreter) run the
        grouped Triton kernels with the hand-derived backward, or, for bf16 training-sized calls on sm_90 and
        newer, the same math on PyTorch's ``grouped_mm`` (:mod:`notebookkit.kernels.moe_experts_grouped`); CPU
        tensors the reference.
    """
    interleaved = _check(x, topk_idx, topk_w, gate_up, down, gate_up_bias, down_bias, gate_up_lora, down_lora,
                         activation, interleaved)
    if not should_use_triton(x):
        return moe_expert_mlp_reference(x, topk_idx, topk_w, gate_up, down, gate_up_bias, down_bias, gate_up_lora,
                                        down_lora, activation, interleaved, alpha, limit)
    if x.dtype not in _DTYPES:
        raise ValueError(f"moe_expert_mlp: the Triton path takes float16, bfloat16 or float32, got {x.dtype}.")
    loras = [lora for lora in (gate_up_lora, down_lora) if lora is not None]
    meta = (gate_up_lora.scaling if gate_up_lora is not None else 0.0,
            down_lora.scaling if down_lora is not None else 0.0,
            ACTIVATIONS[activation], interleaved, float(alpha), float(limit))
    ranks = tuple(lora.A.shape[1] for lora in loras)
    factors_of = [t for lora in loras for t in (lora.A, lora.B)]
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_w, *factors_of))
    grouped = training and grouped_mm_applies(x, topk_idx.numel(), gate_up.shape[0],
                                              (x.shape[1], down.shape[2], *ranks), (gate_up, down))
    factors = []
    for lora in (gate_up_lora, down_lora):
        if lora is None:
            factors += [None, None]
            continue
        # grouped_mm reads B [E, out, r] contiguous: a cast writes it so (PEFT's B is a permuted view), sparing
        # the grouped path a copy of it in the forward and another in the backward
        contiguous = grouped and lora.B.dtype != x.dtype
        factors += [lora.A.to(x.dtype),
                    lora.B.to(x.dtype, memory_format=torch.contiguous_format) if contiguous else lora.B.to(x.dtype)]
    if grouped:
        return moe_expert_mlp_grouped(x, topk_idx, topk_w, gate_up, down, gate_up_bias, down_bias, *factors, meta)
    return _MoEExpertMLPFunction.apply(x, topk_idx, topk_w, gate_up, down, gate_up_bias, down_bias, *factors, meta)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py): (kernel, signature, constexprs, options)
# --------------------------------------------------------------------------------------------------


def _aot_specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """The GPU configuration, rank 16: in fp16 (sm_75+) every kernel, both activations (Qwen3-MoE: SwiGLU,
    adapters; gpt-oss: clamped, interleaved, biases); in bf16 (sm_80+: sm_75 has no bf16 ``tl.dot``) the
    down projection and the SwiGLU gate/up and its backward; each of the three weight-reading kernels again
    with NF4 weights (nested absmax, fp fusion off) in those configurations; and the routing's block schedule
    (19 specs: the AOT test compiles each)."""
    cfg = _CUDA_CONFIG
    tiles = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "BLOCK_R": 16, "IEEE": False}
    idx = {"perm_ptr": "*i32", "blk_expert_ptr": "*i32", "blk_start_ptr": "*i32", "blk_end_ptr": "*i32"}

    def strides(*names):
        return {name: "i32" for name in names}

    def weight(p: str, nf4: bool) -> dict[str, str]:
        q = ("*u8", "*fp32", "*fp32", "*fp32", "*fp32") if nf4 else (p,) * 5
        names = ("q_absmax_ptr", "q_table_ptr", "q_code2_ptr", "q_absmax2_ptr", "q_offset_ptr")
        return {"w_ptr": "*u8" if nf4 else p, **strides("stride_we", "stride_wn", "stride_wk"), **dict(zip(names, q))}

    specs = []
    for ty in ("fp16", "bf16"):
        p = f"*{ty}"
        for nf4 in (False, True):
            options: dict[str, Any] = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
            if ty == "bf16":
                options["targets"] = [80, 86, 89, 90]
            if nf4:
                options["enable_fp_fusion"] = False
            quant = {"NF4": nf4, "NESTED": nf4, "QBLOCK": 64, "QBLOCK2": 256}
            linear = {"a_ptr": p, "stride_am": "i32", "a2_ptr": p, "stride_a2m": "i32", **weight(p, nf4), "w2_ptr": p,
                      **strides("stride_w2e", "stride_w2n", "stride_w2k"), "bias_ptr": p, "stride_be": "i32",
                      "route_ptr": "*fp32", "out_ptr": p, "stride_om": "i32", **idx,
                      **strides("n_out", "k_in", "rank", "topk"), "lora_scale": "fp32",
                      **strides("e_lo", "e_hi")}
            variants = ((False, True, True, True, True),)  # the down projection (dx: the same without bias, w_p)
            if ty == "fp16" and not nf4:
                variants += ((True, False, False, False, False),)  # x A^T, dy B
            for gather, scatter, lora, bias, route in variants:
                specs.append((_moe_linear_kernel, linear, {"A_GATHER": gather, "SCATTER": scatter, "HAS_LORA": lora,
                                                           "HAS_BIAS": bias, "ROUTE_SCALE": route, **quant, **tiles},
                              options))
            consts = ("inter", "hidden", "rank", "topk", "gu_step", "up_off")
            gate_up = {"x_ptr": p, "stride_xm": "i32", "xa_ptr": p, "stride_xam": "i32", **weight(p, nf4), "b_ptr": p,
                       **strides("stride_be", "stride_bn", "stride_bk"), "bias_ptr": p, "stride_biase": "i32",
                       "h_ptr": p, "stride_hm": "i32", "gu_ptr": p, "stride_gum": "i32", **idx, **strides(*consts),
                       "lora_scale": "fp32", "alpha": "fp32", "limit": "fp32", **strides("e_lo", "e_hi")}
            down_grad = {"dy_ptr": p, "stride_dym": "i32", "dyb_ptr": p, "stride_dybm": "i32", **weight(p, nf4),
                         "a_ptr": p, **strides("stride_ae", "stride_an", "stride_ak"), "gu_ptr": p,
                         "stride_gum": "i32", "route_ptr": "*fp32", "dgu_ptr": p, "stride_dgum": "i32", "h_ptr": p,
                         "stride_hm": "i32", "part_ptr": "*fp32", "stride_pm": "i32", **idx, **strides(*consts),
                         "lora_scale": "fp32", "alpha": "fp32", "limit": "fp32", **strides("e_lo", "e_hi")}
            for act, bias in ((0, False), (1, True)) if ty == "fp16" else ((0, False),):
                specs.append((_moe_gate_up_kernel, gate_up, {"ACT": act, "HAS_LORA": True, "HAS_BIAS": bias,
                                                             "SAVE_GU": True, **quant, **tiles}, options))
                specs.append((_moe_down_grad_kernel, down_grad, {"ACT": act, "HAS_LORA": True, "STORE_H": True,
                                                                 **quant, **tiles}, options))
        wgrad = {"l_ptr": p, "stride_lm": "i32", "r_ptr": p, "stride_rm": "i32", "route_ptr": "*fp32", "out_ptr": p,
                 **strides("stride_oe", "stride_om"), "perm_ptr": "*i32", "seg_start_ptr": "*i32",
                 "seg_end_ptr": "*i32", **strides("m_size", "n_size", "topk"), "scale": "fp32"}
        if ty == "fp16":
            specs.append((_moe_wgrad_kernel, wgrad, {"L_GATHER": True, "R_GATHER": False, "ROUTE_SCALE": True,
                                                     "BLOCK_M": cfg.block_m, "BLOCK_N": 16, "BLOCK_K": cfg.block_k,
                                                     "IEEE": False}, {"num_warps": cfg.num_warps,
                                                                      "num_stages": cfg.num_stages}))
    schedule = {"starts_ptr": "*i32", "ends_ptr": "*i32", "blk_expert_ptr": "*i32", "blk_start_ptr": "*i32",
                "blk_end_ptr": "*i32", "num_experts": "i32", "num_blocks": "i32", "block_m": "i32"}
    specs.append((_block_schedule_kernel, schedule, {"E_POW2": 128, "BLOCK_B": _SCHEDULE_BLOCK_B}))
    return specs


AOT_SPECS = _aot_specs()
