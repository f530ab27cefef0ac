"""Linear projections of the decode path, LoRA adapters unmerged: ``Y_i = X W_i^T + b_i + s_i (X A_i^T) B_i^T``.

Projections that read one input (q/k/v; gate/up; o or down alone) go through the training path's
helpers of :mod:`notebookkit.kernels.lora_projection` without autograd
(:func:`~notebookkit.kernels.lora_projection.shared_input_forward`: the adapters of one rank share
``X A_cat^T``), with one difference for 4-bit base weights: when the decode kernel
``notebookkit.kernels.nf4_matvec`` is available and takes the input (CUDA, few rows), each projection is
one launch of that kernel: it reads the NF4 bytes directly instead of dequantising each whole weight per
token, and adds the bias and the low-rank term ``s U B^T`` (``U = X A^T`` from one GEMM per group, over the
group's ``A_cat`` kept between steps: :meth:`AdapterCasts.concatenated`) into the same fp32 sum before its
one rounding. For one row (batch-1 decode) the projections of a group share that launch
(:func:`~notebookkit.kernels.nf4_matvec.nf4_matvec_group`: q/k/v one, gate/up one). Per decoder layer that is
4 matvec launches and 4 thin products (:mod:`~notebookkit.kernels.skinny_matmul`) at batch 1 (7 matvecs at
larger batches), where a matvec, an ``addmm`` per projection and a concatenation per group made 20. The decode
step makes three of the four products in the launch before them and hands them in (``project(..., u_cat=)``,
:func:`rank_factor`): one thin product a layer is left, o's.
16-bit bases at batch 1 go the same way through :func:`~notebookkit.kernels.dense_matvec.dense_matvec_group`
(a group's base products, biases and adapter terms in one launch): 8 launches a layer where the training path's
products made 18; more rows keep those products (cuBLAS at a batch's width).
2-bit and ternary bases (:mod:`notebookkit.models.low_bit`) never dequantise their whole weight: a decode
batch of at most ``low_bit_matvec.MAX_ROWS`` rows reads their codes in
:func:`notebookkit.kernels.low_bit_matvec.low_bit_matvec` (no ``tl.dot``), more rows go
through the training path's products (:data:`~notebookkit.kernels.lora_projection.LOW_BIT_PRODUCTS`:
in-tile kernels for few rows, dense chunks under cuBLAS for a prompt of ``DEQUANT_CHUNK_MIN_ROWS`` rows
or more).

Adapters in another dtype than the compute dtype (PEFT keeps them in fp32 next to 16-bit and 4-bit
bases) are read through :class:`AdapterCasts`: one cast per adapter kept between decode steps and
``generate`` calls, so a captured step reads the casts and casts nothing itself (two launches per
adapter per token saved: about a fifth of a decode step's kernels). An adapter changed in place
(an optimizer step: GRPO trains between generations) is re-cast into the same buffer by
:meth:`AdapterCasts.refresh` before the next forward, so the graphs read its new values. Version
counters do not see every update: bitsandbytes' 8-bit optimizers (the notebooks' ``adamw_8bit``) write
the parameters in their own kernels and leave the counter as it was, so each ``generate`` call
re-casts every kept adapter once (``refresh(every=True)``: one small copy per adapter per call).
A group's ``A_cat`` is kept the same way (:meth:`AdapterCasts.concatenated`), for 16-bit bases as well (the
training path's :func:`~notebookkit.kernels.lora_projection.adapter_group` finds it kept on the group's first
projection), so no step concatenates.

A projection that the fused path cannot take (DoRA, several adapters, 8-bit, ...) runs its own module.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from notebookkit.base_formats import DEQUANT_CHUNK_MIN_ROWS
from notebookkit.base_layers.kernel_ops import kernel
from notebookkit.kernels.lora_projection import (
    LoRAProjection,
    adapter_group,
    concat_adapters,
    grouped_projection_forward,
    low_rank_input,
    projection_forward,
    shared_input_forward,
)

from ..patching.lora_fast_path import views

__all__ = ["AdapterCasts", "project", "fused_views", "rank_factor"]


class AdapterCasts:
    """LoRA matrices in the compute dtype, kept (see the module docstring).

    ``casts(adapter, dtype)`` is ``adapter`` itself when it already has ``dtype``, else its kept cast
    (made on first use). :meth:`refresh` re-casts, in place, every adapter whose version counter moved.
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[int, torch.dtype], list] = {}  # (id, dtype) -> [adapter, its version, cast]
        # (ids, dtype) -> [adapters, their versions, cat(adapters) in dtype]: a group's A_cat
        self._joined: dict[tuple[tuple[int, ...], torch.dtype], list] = {}

    def __call__(self, adapter: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if adapter.dtype == dtype:
            return adapter
        entry = self._kept.get((id(adapter), dtype))
        if entry is None or entry[0] is not adapter:
            entry = [adapter, adapter._version, adapter.detach().to(dtype)]
            self._kept[(id(adapter), dtype)] = entry
        return entry[2]

    def concatenated(self, adapters: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """``cat(adapters)`` along the rank in ``dtype``, kept like the casts (a group's ``A_cat``: one
        concatenation per group per step saved)."""
        key = (tuple(id(a) for a in adapters), dtype)
        entry = self._joined.get(key)
        if entry is None or any(a is not b for a, b in zip(entry[0], adapters)):
            entry = [tuple(adapters), tuple(a._version for a in adapters), concat_adapters(tuple(adapters), dtype)]
            self._joined[key] = entry
        return entry[2]

    def refresh(self, every: bool = False) -> int:
        """Re-cast the adapters changed in place since they were cast, and re-join the concatenations
        holding one (``every``: all of them, for updates that did not move the version counter); returns
        how many casts and concatenations were renewed."""
        targets, sources = [], []
        stale = [entry for entry in self._kept.values() if every or entry[0]._version != entry[1]]
        for entry in stale:
            targets.append(entry[2])
            sources.append(entry[0].detach())
            entry[1] = entry[0]._version
        versions = [(entry, tuple(a._version for a in entry[0])) for entry in self._joined.values()]
        stale_joins = [(entry, now) for entry, now in versions if every or now != entry[1]]
        for entry, now in stale_joins:  # each adapter into its rows of the concatenation
            start = 0
            for adapter in entry[0]:
                targets.append(entry[2][start:start + adapter.shape[0]])
                sources.append(adapter.detach())
                start += adapter.shape[0]
            entry[1] = now
        if targets:  # one foreach copy for them all (an 8B model with LoRA everywhere: 448 casts, 64 joins)
            torch._foreach_copy_(targets, sources)
        return len(stale) + len(stale_joins)

    def clear(self) -> None:
        self._kept.clear()
        self._joined.clear()

    def __len__(self) -> int:
        return len(self._kept) + len(self._joined)


def _nf4_kernels():
    return kernel("nf4_matvec", "nf4_matvec"), kernel("nf4_matvec", "nf4_matvec_supported")


def _nf4_takes(x2d: torch.Tensor, projs: Sequence[LoRAProjection]) -> bool:
    matvec, supported = _nf4_kernels()
    if matvec is None or supported is None:
        return False
    quantized = [p for p in projs if p.quantized]
    if any(p.low_bit for p in quantized):
        return False
    return bool(quantized) and all(supported(x2d, (p.weight, p.quant_state)) for p in quantized)


def _low_bit_base(x2d: torch.Tensor, proj: LoRAProjection) -> Optional[torch.Tensor]:
    """``X W^T`` of a 2-bit or ternary base through the decode matvec (it hands more rows to the GEMM
    itself); ``None`` for other bases and for prompts of ``DEQUANT_CHUNK_MIN_ROWS`` rows or more
    (their products run in :func:`projection_forward`)."""
    matvec = kernel("low_bit_matvec", "low_bit_matvec")
    if matvec is None or not proj.low_bit:
        return None
    if x2d.shape[0] >= DEQUANT_CHUNK_MIN_ROWS:  # a long prompt: cuBLAS on dense chunks, as in training
        return None
    return matvec(x2d, proj.quant_state)


def fused_views(modules: Sequence[nn.Module]) -> bool:
    """Whether every one of ``modules`` runs on the fused projection path (else :func:`project` calls them)."""
    found, _ = views(*modules)
    return found is not None


def _nf4_bases(x2d: torch.Tensor, projs: Sequence[LoRAProjection]) -> Optional[list]:
    if any(p.low_bit for p in projs):
        bases = [_low_bit_base(x2d, p) for p in projs]
        return bases if any(b is not None for b in bases) else None
    if not _nf4_takes(x2d, projs):
        return None
    matvec, _ = _nf4_kernels()
    return [matvec(x2d, (p.weight, p.quant_state)) if p.quantized else None for p in projs]


def _with_casts(proj: LoRAProjection, dtype: torch.dtype, casts: Optional[AdapterCasts]) -> LoRAProjection:
    if casts is None or not proj.has_adapter:
        return proj
    return LoRAProjection(proj.weight, proj.quant_state, casts(proj.lora_A, dtype), casts(proj.lora_B, dtype),
                          proj.scaling)


def _kept_group(projs: Sequence[LoRAProjection], originals: Sequence[LoRAProjection], dtype: torch.dtype,
                casts: AdapterCasts) -> None:
    """Hand a group's ``A_cat`` kept by ``casts`` (:meth:`AdapterCasts.concatenated`) to the first of ``projs``
    (the projections of this step, adapters read through ``casts``), where :func:`adapter_group` looks for it:
    otherwise every step concatenates the group's ``A`` again (a launch a group, inside a captured step too)."""
    if len(projs) < 2 or not all(p.has_adapter for p in projs) or len({p.rank for p in projs}) != 1 \
            or len({o.lora_A.dtype for o in originals}) != 1:
        return  # not a group (adapter_group runs the projections one at a time)
    factors = tuple(p.lora_A for p in projs)
    a_cat = casts.concatenated(tuple(o.lora_A for o in originals), dtype)
    projs[0]._group_cast = (dtype, factors, tuple(f._version for f in factors), a_cat)


def _shares_a_cat(adapted: Sequence[LoRAProjection]) -> bool:
    """Whether the adapters of a group's projections are one product ``X A_cat^T``: two or more of one rank and
    one dtype."""
    return len(adapted) >= 2 and len({p.rank for p in adapted}) == 1 and len({p.lora_A.dtype for p in adapted}) == 1


def rank_factor(modules: Sequence[nn.Module], dtype: torch.dtype, casts: AdapterCasts) -> Optional[torch.Tensor]:
    """The matrix a batch-1 step of ``modules`` multiplies its row by for the adapters' rank-space inputs
    (:func:`_adapter_inputs`): a lone adapter's ``A`` or a group's ``A_cat`` (``[sum r_i, in]``), in ``dtype``, kept
    by ``casts``; ``None`` where there is no one product (a projection off the fused path, no adapter, ranks or
    dtypes that differ). The decode step computes ``U = x A^T`` with the op before the projections
    (:mod:`notebookkit.kernels.add_rms_norm_low_rank`, :mod:`notebookkit.kernels.gated_low_rank`) and hands it to
    :func:`project`."""
    found, _ = views(*modules)
    if found is None:
        return None
    adapted = [v.projection for v in found if v.projection.has_adapter]
    if len(adapted) == 1:
        return casts(adapted[0].lora_A, dtype)
    if not _shares_a_cat(adapted):
        return None
    return casts.concatenated(tuple(p.lora_A for p in adapted), dtype)


def _adapter_inputs(x2d: torch.Tensor, projs: Sequence[LoRAProjection], casts: Optional[AdapterCasts],
                    u_cat: Optional[torch.Tensor] = None) -> list[Optional[torch.Tensor]]:
    """``U_i = X A_i^T`` of each projection's adapter (``None`` without one), from one product
    ``X A_cat^T`` when two or more adapters share a rank (``A_cat`` kept by ``casts``); for one row the products run
    in :mod:`notebookkit.kernels.skinny_matmul` (one launch sized to these thin shapes, not cuBLAS's GEMV).
    ``u_cat``: the product with :func:`rank_factor`'s matrix, already computed."""
    dtype = x2d.dtype
    # one row (batch-1 decode): the thin kernel (session 24's 8B step: 0.57 ms of GEMM where cuBLAS took 1.00);
    # at batch 8 it walked K in dependent steps and cuBLAS was faster (1.01 against 1.19 ms)
    skinny = kernel("skinny_matmul", "skinny_matmul") if x2d.shape[0] == 1 else None
    product = skinny or (lambda x, a: x @ a.t())
    adapted = [p for p in projs if p.has_adapter]
    if u_cat is not None and len(adapted) == 1:
        return [u_cat if p.has_adapter else None for p in projs]
    if _shares_a_cat(adapted):
        if u_cat is None:
            As = tuple(p.lora_A for p in adapted)
            a_cat = casts.concatenated(As, dtype) if casts is not None else concat_adapters(As, dtype)
            u_cat = product(x2d, a_cat)
        r = adapted[0].rank
        joined = iter(u_cat[:, i * r:(i + 1) * r] for i in range(len(adapted)))
        return [next(joined) if p.has_adapter else None for p in projs]
    return [product(x2d, casts(p.lora_A, dtype) if casts is not None else p.adapters(dtype)[0]) if p.has_adapter
            else None for p in projs]


def _lora_terms(x2d: torch.Tensor, projs: Sequence[LoRAProjection], casts: Optional[AdapterCasts],
                u_cat: Optional[torch.Tensor] = None) -> list[Optional[tuple[torch.Tensor, torch.Tensor, float]]]:
    """Each projection's adapter term for a decode kernel, ``(U_i, B_i, s_i)`` in ``x2d``'s dtype (``U_i`` from
    :func:`_adapter_inputs`, ``B_i`` kept by ``casts``), or ``None`` without an adapter."""
    dtype = x2d.dtype
    return [None if u is None else
            (u, casts(p.lora_B, dtype) if casts is not None else p.lora_B_in(dtype), p.scaling)
            for p, u in zip(projs, _adapter_inputs(x2d, projs, casts, u_cat))]


def _nf4_with_adapters(x2d: torch.Tensor, projs: Sequence[LoRAProjection], biases: Sequence[Optional[torch.Tensor]],
                       casts: Optional[AdapterCasts], u_cat: Optional[torch.Tensor] = None) -> Optional[list[torch.Tensor]]:
    """``X W_i^T + b_i + s_i U_i B_i^T`` of NF4 projections, each in one launch of the decode matvec with its
    bias and its adapter's term inside (``U_i`` from :func:`_adapter_inputs`); ``None`` where the kernel does
    not take every projection (then the caller adds the low-rank parts itself)."""
    if not all(p.quantized for p in projs) or not _nf4_takes(x2d, projs):
        return None
    loras = _lora_terms(x2d, projs, casts, u_cat)
    group = kernel("nf4_matvec", "nf4_matvec_group")
    if group is not None and len(projs) > 1:  # one launch for q/k/v, one for gate/up, where the kernel takes them
        return group(x2d, [(p.weight, p.quant_state) for p in projs], list(biases), loras=loras)
    matvec, _ = _nf4_kernels()
    return [matvec(x2d, (p.weight, p.quant_state), bias, lora=lora) for p, bias, lora in zip(projs, biases, loras)]


def _dense_with_adapters(x2d: torch.Tensor, projs: Sequence[LoRAProjection],
                         biases: Sequence[Optional[torch.Tensor]], casts: Optional[AdapterCasts],
                         u_cat: Optional[torch.Tensor] = None) -> Optional[list[torch.Tensor]]:
    """``X W_i^T + b_i + s_i U_i B_i^T`` of 16-bit projections read by one row (batch-1 decode), a group in one
    launch of :func:`~notebookkit.kernels.dense_matvec.dense_matvec_group` with the biases and the adapters'
    terms inside (``U_i`` from :func:`_adapter_inputs`); ``None`` where the kernel does not take them (then the
    caller runs the training path's products)."""
    group = kernel("dense_matvec", "dense_matvec_group")
    supported = kernel("dense_matvec", "dense_matvec_supported")
    if group is None or supported is None or any(p.quantized for p in projs):
        return None
    if len({b is None for b in biases}) > 1 or not supported(x2d, [p.weight for p in projs]):
        return None
    loras = _lora_terms(x2d, projs, casts, u_cat)
    return group(x2d, [p.weight for p in projs], list(biases), loras)


def project(x2d: torch.Tensor, modules: Sequence[nn.Module], casts: Optional[AdapterCasts] = None,
            u_cat: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """Outputs ``[N, out_i]`` of the linear ``modules`` (plain, 4-bit or PEFT LoRA) that all read ``x2d [N, in]``.

    ``casts``: where adapters in another dtype are read from (:class:`AdapterCasts`); ``None`` casts
    them on each call, as the training path does. ``u_cat``: ``x2d A^T`` for :func:`rank_factor`'s ``A``,
    already computed (the decode kernels read it instead of computing it again).
    """
    found, _ = views(*modules)
    if found is None:
        return [module(x2d) for module in modules]
    originals = [v.projection for v in found]
    biases = [v.bias for v in found]  # added by the base GEMMs (or into a matvec's output), not after
    fused = _nf4_with_adapters(x2d, originals, biases, casts, u_cat)
    if fused is None:
        fused = _dense_with_adapters(x2d, originals, biases, casts, u_cat)
    if fused is not None:
        return fused
    projs = tuple(_with_casts(p, x2d.dtype, casts) for p in originals)
    if casts is not None:
        _kept_group(projs, originals, x2d.dtype, casts)
    bases = _nf4_bases(x2d, projs)
    if bases is None:
        return shared_input_forward(x2d, projs, biases)[0]
    group = adapter_group(projs, x2d.dtype)
    if group is not None:
        return grouped_projection_forward(x2d, group, None, bases, biases=biases)
    return [projection_forward(x2d, p, low_rank_input(x2d, p, A), B, None, base, bias)
            for p, base, bias in zip(projs, bases, biases) for A, B in [p.adapters(x2d.dtype)]]
