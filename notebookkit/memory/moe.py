"""The memory model's mixture-of-experts terms (Qwen3-MoE, gpt-oss): what a sparse block and its family's
stock parts cost in a training step. :mod:`notebookkit.memory.estimate` adds them; the formulas are
read off what runs (:mod:`notebookkit.kernels.moe_experts`, :mod:`notebookkit.models.patching.patch_moe`,
:mod:`~notebookkit.models.patching.moe_routing`, PEFT's ``ParamWrapper``, Hugging Face's gpt-oss code).

Notation: ``N = B T`` tokens, ``n = N k`` token-expert pairs, ``E`` experts of width ``I`` (``I_e``), hidden
``H``, ``s`` bytes of the compute dtype, ``a`` bytes of the adapters' dtype (4: PEFT's fp32), ``r`` the LoRA
rank, ``M = ceil(n / 64) + E`` row blocks of the kernel's schedule (64: its ``BLOCK_M`` on CUDA).

Weights (per layer; bitsandbytes quantises ``nn.Linear`` only, the stacked experts are put in NF4 by the
loader's own step, :mod:`notebookkit.models.loading.nf4_experts`, and the routers stay in the compute dtype)
    experts, in the compute dtype ``E * 3 * H * I * s``; under ``load_in_4bit`` in NF4, each stacked weight of
    ``n`` elements (``n = 2 E H I`` and ``E H I``) as the loader stores it (:func:`nf4_stacked_bytes`):
    ``ceil(n / 2)`` code bytes, ``ceil(n / 64)`` absmax codes, ``4 ceil(n / 16384)`` second-level scales,
    the offset and the two fp32 tables (16 and 256 values);
    router ``E * H * s`` (+ ``E`` bias, gpt-oss), expert biases ``E * (2 I + H) * s`` (gpt-oss).

Adapters on the stacked experts (PEFT ``target_parameters`` -> ``ParamWrapper``: ``lora_A [r E, in]``,
``lora_B [out, r E]`` a stacked weight): ``L * E * sum r_w (in_w + out_w)`` over ``gate_up_proj``
(``H -> 2I``) and ``down_proj`` (``I -> H``). Qwen3-MoE: PEFT maps ``gate_proj`` + ``up_proj`` onto
``gate_up_proj`` at rank ``2 r`` (the two fused adapters; one without the other is refused) and
``down_proj`` at ``r``; gpt-oss: notebookkit adds both at rank ``r`` when any MLP name is targeted. Named by
``target_parameters`` (``get_peft_model(target_parameters=[...])``), each named weight is adapted at ``r``, and
only those (a PEFT model's own ranks are read off it by :func:`~.estimate.estimate_kwargs_from_model`).

Saved for backward by a kept sparse block (the router in fp32, the grouped kernel's ``ctx``)
    router ``softmax_topk`` without ``norm_topk_prob``: the fp32 softmax ``4 N E``, top-k indices ``8 n``,
        weights ``4 n``;
    router ``topk_softmax`` (gpt-oss; and Qwen3-MoE, whose ``norm_topk_prob`` makes its rule this one,
        :mod:`notebookkit.models.patching.moe_routing`): top-k indices ``8 n``, the fp32 softmax over them ``4 n``;
    experts: ``gu [n, 2I]`` (``2 n I s``), ``x Agu^T`` and ``h Ad^T`` (``n r_w s`` an adapted weight), the
    permutation ``4 n``, expert offsets ``8 E``, the block schedule ``12 M``, and, when the adapters' dtype
    is not the compute dtype, their casts ``E s sum r_w (in_w + out_w)`` (made by every forward, so saved
    per kept layer); the block's input ``x`` is the MLP norm's output, counted with the layer.
    The attention and norms are the dense layers' (:func:`~.estimate.layer_activation_bytes` without the MLP):
    the fused ones for both families; gpt-oss's attention with sinks (:mod:`notebookkit.kernels.attention_sinks`:
    q, k, v, its output and log-sum-exp as SDPA's, and the layer's boolean mask ``B T^2``).

Working sets of a sparse block (beyond what it saved)
    forward: ``h [n, I]`` and the pairs' output rows ``[n, H]``, or (``h`` freed) those rows and their sum ``y``
    (``N H s``: accumulated in fp32 inside the one reduction, no fp32 buffer);
    backward, the largest of three moments: ``dgu [n, 2I]``, ``dy Bd [n, r]``, ``h`` again (with a down
    adapter), the fp32 ``<G, h>`` partials ``4 n ceil(I / 64)``, ``dw`` and its source (``8 n``), the down adapter's
    gradients; then ``dgu``, ``dgu Bgu [n, r]``, the partials, the scattered input gradient ``[n, H]`` and
    its sum ``dx``; at the end ``dx`` and every factor gradient ``E s sum r_w (in_w + out_w)``.

Reference forward of a layer (DPO: adapters off, no autograd, on the training path;
:func:`~notebookkit.memory.generation.layer_working_set` with ``training_path``): through the sparse block the layer's
input ``N H s`` and its mask stay held. gpt-oss's attention with sinks on that path adds to the dense terms the
boolean mask and its opened copy ``2 B T^2``, the additive bias ``B T^2 s``, K and V repeated to every head
(``2 N dq s``), the kernel's output beside ``O^s`` (``N dq s``) and ``lse``, ``g`` (``8 B nh T``).

Generation (:mod:`notebookkit.memory.generation`: a decode step or a prefill of ``N`` tokens, no autograd;
:func:`sparse_block_generation_bytes`): the decode path's sparse block runs the same router and grouped kernel
(:mod:`notebookkit.models.generation.cached_forward`), so its working set is the block's input and residual
``2 N H s``, then the larger of the routing moment and the experts' forward moment:
    routing: the router logits ``N E s``, their fp32 copy ``4 N E`` (16-bit compute) and fp32 softmax
    ``4 N E`` (``softmax_topk`` without ``norm_topk_prob``), the top-k values and indices ``12 n``, and the
    softmax over the k ``4 n`` (``topk_softmax``, which ``norm_topk_prob`` makes Qwen3-MoE's rule);
    experts: the router logits ``N E s`` (held by the block until it returns), the routing's weights and
    indices ``12 n``, the kernel's int32 permutation ``4 n``, expert offsets ``8 E`` and block schedule
    ``12 M`` (the sort's keys and order are freed by then; the schedule is one kernel's, without temporaries), plus
    the forward transients above (``h`` and the pairs' rows, or the rows and their sum ``y``).
    The same peak is DPO's reference forward of a sparse block (adapters off, no gradient, so no ``gu``):
    measured on the CPU under the Triton interpreter, ``tests/memory/test_moe_memory.py``.
    NF4 experts are decoded in the kernel's tile loads (no dense copy) when an expert has few rows; from
    :data:`~notebookkit.expert_chunks.MIN_ROWS_PER_EXPERT` rows an expert on average, a chunk of them at a time
    (:func:`expert_decode_chunk_bytes`, held through each GEMM, in training too). The expert adapters' ``x A^T`` /
    ``h A^T`` products (``n r s``) are left out, as LoRA's products are in the dense layers' working set,
    and so are the kept compute-dtype casts of fp32 expert adapters (``E s sum r_w (in_w + out_w)`` a
    layer, held between steps: the memory model's generation terms do not take the LoRA rank).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Iterable, Mapping

from notebookkit.expert_chunks import chunk_ranges, decodes_in_chunks, device_bounds, grouped_mm_sizes, largest_decode
from notebookkit.families import Family, for_model_type

from .shapes import ModelShape

__all__ = ["BLOCK_M", "moe_family", "expert_lora_ranks", "explicit_expert_ranks", "expert_lora_param_count",
           "expert_weight_bytes",
           "nf4_stacked_bytes", "expert_decode_chunk_bytes", "router_loss_bytes",
           "sparse_block_saved_bytes", "sparse_block_working_sets", "grouped_mm_possible",
           "sparse_block_generation_bytes", "dense_part"]

#: the grouped kernel's row block on CUDA (``kernels.moe_experts._config``; a test checks they agree)
BLOCK_M = 64
#: the column tile of its down-projection gradient kernel on CUDA (the ``<G, h>`` partials per pair)
BLOCK_N = 64


def moe_family(shape: ModelShape) -> Family | None:
    """The family record of a mixture-of-experts shape (``None`` for a dense one)."""
    if not shape.num_experts:
        return None
    family = for_model_type(shape.model_type)
    if family is None or family.moe is None:
        raise ValueError(f"notebookkit.memory: {shape.name} has {shape.num_experts} experts but its model_type "
                         f"{shape.model_type!r} is not a mixture-of-experts family notebookkit knows (Qwen3-MoE, gpt-oss).")
    return family


STACKED = ("gate_up_proj", "down_proj")


def explicit_expert_ranks(shape: ModelShape, r: int, target_parameters: Any) -> dict[str, int]:
    """``{stacked weight: rank}`` of PEFT's ``target_parameters`` adapters named by the caller: names ending in
    ``gate_up_proj`` / ``down_proj`` (``"mlp.experts.gate_up_proj"``), each at ``r`` (PEFT's rank for a named
    parameter), or a ``{name: rank}`` mapping (what a PEFT model holds, read off it)."""
    items = target_parameters.items() if isinstance(target_parameters, Mapping) else \
        ((name, r) for name in ([target_parameters] if isinstance(target_parameters, str) else target_parameters))
    ranks: dict[str, int] = {}
    for name, rank in items:
        leaf = str(name).split(".")[-1]
        if leaf not in STACKED:
            raise ValueError(f"notebookkit.memory: target_parameters names {name!r}; {shape.name}'s experts hold "
                             f"{' and '.join(STACKED)} (e.g. 'mlp.experts.gate_up_proj').")
        ranks[leaf] = int(rank)
    return ranks


def expert_lora_ranks(shape: ModelShape, r: int, targets: Iterable[str],
                      target_parameters: Any = None) -> dict[str, int]:
    """``{stacked weight: rank}`` of the adapters ``get_peft_model`` puts on the experts for these
    ``target_modules`` names (module docstring), or, when ``target_parameters`` names the stacked weights
    itself, those at ``r`` (:func:`explicit_expert_ranks`: PEFT's own ``2 r`` for Qwen3-MoE's gate_up comes only
    from its mapping of ``gate_proj`` + ``up_proj``); empty for a dense model or no MLP target."""
    family = moe_family(shape)
    if family is None:
        return {}
    if target_parameters:
        return explicit_expert_ranks(shape, r, target_parameters)
    targets = set(targets)
    if family.moe.peft_maps_mlp_targets:  # PEFT's own mapping: gate + up fused at 2 r
        gate_up = {"gate_proj", "up_proj"} & targets
        if len(gate_up) == 1:
            raise ValueError(
                f"notebookkit.memory: {shape.name}'s experts hold gate and up in one stacked gate_up_proj, so PEFT "
                f"adapts both or neither; target_modules names only {gate_up.pop()}: add "
                f"{'up_proj' if 'gate_proj' in targets else 'gate_proj'}, or drop it.")
        ranks = {"gate_up_proj": 2 * r} if gate_up else {}
        if "down_proj" in targets:
            ranks["down_proj"] = r
        return ranks
    if {"gate_proj", "up_proj", "down_proj"} & targets:  # notebookkit's target_parameters: both, at r
        return {"gate_up_proj": r, "down_proj": r}
    return {}


def expert_lora_param_count(shape: ModelShape, ranks: dict[str, int]) -> int:
    """``L * E * sum r_w (in_w + out_w)``: PEFT's ``lora_A [r E, in]`` and ``lora_B [out, r E]``."""
    dims = shape.expert_shapes()
    return shape.num_layers * shape.num_experts * sum(rank * sum(dims[w]) for w, rank in ranks.items())


def expert_adafactor_bytes(shape: ModelShape, ranks: dict[str, int]) -> int:
    """Adafactor's factored second moment of the expert adapters: ``4 (rows + cols)`` a matrix."""
    dims, E = shape.expert_shapes(), shape.num_experts
    return shape.num_layers * sum(4 * ((rank * E + dims[w][0]) + (dims[w][1] + rank * E)) for w, rank in ranks.items())


def nf4_stacked_bytes(numel: int) -> int:
    """Bytes of one stacked expert weight of ``numel`` elements in NF4 (module docstring)."""
    blocks = -(-numel // 64)
    return (numel + 1) // 2 + blocks + 4 * -(-blocks // 256) + 4 + 4 * (16 + 256)


def expert_weight_bytes(shape: ModelShape, s: int, nf4: bool = False) -> dict[str, int]:
    """The experts', routers' and expert biases' bytes over all layers: experts in the compute dtype, or in
    NF4 (``nf4``: ``load_in_4bit``); routers and biases in the compute dtype."""
    family = moe_family(shape)
    L, E, H, I = shape.num_layers, shape.num_experts, shape.hidden_size, shape.expert_intermediate_size
    if nf4:
        out = {"base weights: experts (NF4)": L * (nf4_stacked_bytes(2 * E * H * I) + nf4_stacked_bytes(E * H * I))}
    else:
        out = {"base weights: experts (compute dtype)": L * E * 3 * H * I * s}
    router = L * E * H * s + (L * E * s if family.moe.router_bias else 0)
    if family.moe.expert_bias:
        router += L * E * (2 * I + H) * s
    out["base weights: routers" + (" and expert biases" if family.moe.expert_bias else "")] = router
    return out


def dense_part(shape: ModelShape) -> ModelShape:
    """The shape without its MLP (``I = 0``, no experts): the dense formulas then give the attention and norms."""
    return replace(shape, intermediate_size=0, num_experts=0, experts_per_token=0, expert_intermediate_size=0)


def _factor_elems(shape: ModelShape, ranks: dict[str, int]) -> int:
    dims = shape.expert_shapes()
    return shape.num_experts * sum(rank * sum(dims[w]) for w, rank in ranks.items())


def grouped_mm_possible(shape: ModelShape, *, tokens: int, s: int, ranks: dict[str, int]) -> bool:
    """Whether a training call of ``tokens`` tokens may run on ``grouped_mm``
    (:func:`notebookkit.kernels.moe_experts_grouped.grouped_mm_applies` on a bf16 sm_90 card): 16-bit, 16 rows an
    expert on average, hidden, intermediate and ranks multiples of 8. The card and the 16-bit kind (bf16 or fp16)
    are not known here, so an estimate takes the larger of the two paths' terms where this holds."""
    dims = (shape.hidden_size, shape.expert_intermediate_size, *ranks.values())
    return s == 2 and grouped_mm_sizes(tokens * shape.experts_per_token, shape.num_experts, dims)


def _paths(grouped: bool | None, shape: ModelShape, tokens: int, s: int, ranks: dict[str, int]) -> list[bool]:
    if grouped is None:
        return [False, True] if grouped_mm_possible(shape, tokens=tokens, s=s, ranks=ranks) else [False]
    return [grouped]


def _full_softmax(family, shape: ModelShape) -> bool:
    """Whether the router takes the softmax over every expert (``softmax_topk`` without ``norm_topk_prob``; with
    it, the rule is ``topk_softmax``'s, :mod:`notebookkit.models.patching.moe_routing`)."""
    return family.moe.routing == "softmax_topk" and not shape.router_norm_topk


def sparse_block_saved_bytes(shape: ModelShape, *, tokens: int, s: int, ranks: dict[str, int],
                             adapter_bytes: int = 4, grouped: bool | None = False) -> dict[str, int]:
    """What one kept sparse block saves for backward (module docstring), ``{"router": ..., "experts": ...}``;
    ``grouped``: on ``grouped_mm`` (True), the Triton kernels (False) or the larger of the two where a card may
    run either (None, :func:`grouped_mm_possible`)."""
    if len(paths := _paths(grouped, shape, tokens, s, ranks)) > 1:
        both = [sparse_block_saved_bytes(shape, tokens=tokens, s=s, ranks=ranks, adapter_bytes=adapter_bytes,
                                         grouped=g) for g in paths]
        return {key: max(b[key] for b in both) for key in both[0]}
    grouped = paths[0]
    family = moe_family(shape)
    N, k, E, I = tokens, shape.experts_per_token, shape.num_experts, shape.expert_intermediate_size
    n = N * k
    if _full_softmax(family, shape):
        router = N * E * 4 + n * (8 + 4)
    else:
        router = n * (8 + 4)
    if grouped:  # route, perm and expert ids per sorted row, grouped_mm's int32 offsets
        experts = n * 2 * I * s + n * s * sum(ranks.values()) + 12 * n + 4 * E
    else:
        experts = n * 2 * I * s + n * s * sum(ranks.values()) + 4 * n + 8 * E + 12 * (math.ceil(n / BLOCK_M) + E)
    if ranks and adapter_bytes != s:
        experts += _factor_elems(shape, ranks) * s
    return {"router": router, "experts": experts}


def expert_decode_chunk_bytes(shape: ModelShape, *, tokens: int, s: int, nf4: bool,
                              chunk_bytes: int | None = None) -> int:
    """The dense copy of one chunk of NF4 experts that a call of ``tokens`` tokens decodes before its GEMMs
    (:mod:`notebookkit.expert_chunks`: whole experts widened to whole groups of nested scales, a chunk
    budget of ``chunk_bytes``, ``None`` the least): the largest over the chunks of both stacked weights; 0 for
    16-bit experts or a call that decodes in the kernel's weight loads."""
    return max(_decoded_chunks(shape, tokens=tokens, s=s, nf4=nf4, chunk_bytes=chunk_bytes).values())


def _decoded_chunks(shape: ModelShape, *, tokens: int, s: int, nf4: bool, chunk_bytes: int | None) -> dict[str, int]:
    """:func:`expert_decode_chunk_bytes` of each stacked weight: ``{name: bytes}``."""
    E = shape.num_experts
    chunked = nf4 and decodes_in_chunks(tokens * shape.experts_per_token, E)
    return {name: largest_decode(fan_in * fan_out, E, fan_in * fan_out * s, chunk_bytes=chunk_bytes) * s
            if chunked else 0 for name, (fan_in, fan_out) in shape.expert_shapes().items()}


def _chunk_count(shape: ModelShape, weight: str, s: int, chunk_bytes: int | None) -> int:
    """How many decoded chunks stacked ``weight`` takes (one: the grouped path's product is the output, no second
    output to copy chunks into)."""
    fan_in, fan_out = shape.expert_shapes()[weight]
    return len(chunk_ranges(shape.num_experts, fan_in * fan_out * s, chunk_bytes))


def sparse_block_working_sets(shape: ModelShape, *, tokens: int, s: int, ranks: dict[str, int],
                              nf4: bool = False, grouped: bool | None = False, adapter_bytes: int = 4,
                              chunk_bytes: int | None = None) -> dict[str, int]:
    """Transient bytes of a sparse block beyond what it saved: ``{"forward": ..., "backward": ...}`` (the
    incoming gradient ``dy`` not included); ``nf4``: the experts are NF4, so each GEMM may hold a decoded
    chunk of them (:func:`expert_decode_chunk_bytes`, ``chunk_bytes`` its budget); ``grouped`` and
    ``adapter_bytes`` (the LoRA factors' element size) as :func:`sparse_block_saved_bytes`."""
    if len(paths := _paths(grouped, shape, tokens, s, ranks)) > 1:
        both = [sparse_block_working_sets(shape, tokens=tokens, s=s, ranks=ranks, nf4=nf4, grouped=g,
                                          adapter_bytes=adapter_bytes, chunk_bytes=chunk_bytes) for g in paths]
        return {key: max(b[key] for b in both) for key in both[0]}
    grouped = paths[0]
    N, k, E, H, I = tokens, shape.experts_per_token, shape.num_experts, shape.hidden_size, shape.expert_intermediate_size
    n = N * k
    r_gu, r_d = ranks.get("gate_up_proj", 0), ranks.get("down_proj", 0)
    # held through each weight-reading kernel: the largest decoded chunk of the weight it reads
    chunks = _decoded_chunks(shape, tokens=N, s=s, nf4=nf4, chunk_bytes=chunk_bytes)
    chunk_gu, chunk_d = chunks["gate_up_proj"], chunks["down_proj"]
    if grouped:
        counts = {w: _chunk_count(shape, w, s, chunk_bytes) for w in chunks}
        return _grouped_working_sets(shape, n=n, N=N, s=s, r_gu=r_gu, r_d=r_d, chunks=chunks,
                                     factor_bytes=_factor_elems(shape, ranks) * s, b_cast=adapter_bytes != s,
                                     counts=counts)
    forward = max(chunk_gu, n * (I + H) * s + chunk_d, n * H * s + N * H * s)  # h is freed before the sum
    partials = 4 * n * math.ceil(I / BLOCK_N) + 4 * n  # <G, h> per column tile, dw
    down_grads = E * r_d * sum(shape.expert_shapes()["down_proj"]) * s
    in_kernel = n * (2 * I + r_d) * s + (n * I * s if r_d else 0) + 4 * n * math.ceil(I / BLOCK_N) + chunk_d
    phase_h = n * (2 * I + r_d) * s + (n * I * s if r_d else 0) + partials + 4 * n + down_grads
    common = n * (2 * I + r_gu) * s + partials
    at_dx = common + n * H * s + down_grads + chunk_gu  # the scattered dx rows, written a chunk of experts at a time
    at_sum = common + n * H * s + N * H * s + down_grads  # the scattered dx rows and their sum
    at_end = common + N * H * s + _factor_elems(shape, ranks) * s  # dx and every factor gradient
    return {"forward": forward, "backward": max(in_kernel, phase_h, at_dx, at_sum, at_end)}


def _grouped_working_sets(shape: ModelShape, *, n: int, N: int, s: int, r_gu: int, r_d: int, chunks: dict[str, int],
                          factor_bytes: int, b_cast: bool, counts: dict[str, int]) -> dict[str, int]:
    """:func:`sparse_block_working_sets` of :mod:`notebookkit.kernels.moe_experts_grouped` (module docstring of
    that file: its order of allocations). A GEMM reading NF4 experts holds a decoded chunk of its weight
    (``chunks``). With the weight in more than one chunk (``counts[weight]`` of them) each chunk's GEMM also holds
    its rows' output before they are copied into place: at most every row (``n out s``), the bound counted
    here; a weight in one chunk has its product as the output. With the segment bounds on the device
    (:func:`~notebookkit.expert_chunks.device_bounds`) each chunk's GEMM reads a gathered copy of every row
    (``n in s``), and the call holds the rows' int64 sources and targets and which are past the chunk's own, for
    every chunk (``17 n`` bytes a chunk), and each expert's int32 offset (``4 E``). ``b_cast``: the LoRA factors
    are cast to the compute dtype, ``B`` written contiguous by its cast; else (factors already in it) the block
    makes contiguous copies of PEFT's strided ``B`` views, in the forward and again in the backward."""
    E, H, I = shape.num_experts, shape.hidden_size, shape.expert_intermediate_size
    rows = n * H * s  # xs, o, the pairs' slots, dys, dxs: one row of H per pair
    b_gu, b_d = (0, 0) if b_cast else (E * 2 * I * r_gu * s, E * H * r_d * s)  # the B factors' contiguous copies
    b_copies = b_gu + b_d
    pending = n * (r_gu + r_d) * s  # saved products not yet made when the gate/up GEMM runs
    gu_chunk, d_chunk = chunks["gate_up_proj"], chunks["down_proj"]
    on_device = device_bounds()

    def res(out: int, weight: str, fan_in: int) -> int:
        """What a GEMM holds beside its weight's decoded chunk: its rows before the copy (and their gathered input
        and indices with the bounds on the device)."""
        if not chunks[weight] or counts[weight] == 1:
            return 0
        return n * out * s + (n * fan_in * s + 17 * n * counts[weight] + 4 * E if on_device else 0)

    # (the chunks' grouped_mm offsets live in a buffer kept for the process, moe_experts_grouped._OFFSETS)
    forward = max(b_copies + rows + gu_chunk + res(2 * I, "gate_up_proj", H) - pending,
                  b_copies + rows + n * 2 * I * s - n * r_d * s if r_gu else 0,  # the gate/up adapter's product
                  b_copies + n * I * s + rows + d_chunk + res(H, "down_proj", I),  # h, the down GEMM's output
                  b_copies + 2 * rows if r_d else 0,  # o and the down adapter's product
                  2 * rows, rows + N * H * s)  # o, the slots; the slots and y, their sum
    part = 4 * n * math.ceil(I / min(1024, 2 ** math.ceil(math.log2(max(I, 16)))))
    dyb, h = n * r_d * s, (n * I * s if r_d else 0)
    d_grads = E * r_d * (H + I) * s
    token = 4 * n  # each sorted row's token (int32), held from the first gather to the last
    backward = token + max(
        rows,
        rows + n * I * s + d_chunk + res(I, "down_proj", H),  # dys, G
        rows + n * I * s + dyb + max(b_d, n * I * s) if r_d else 0,  # dy B, the adapter's product
        rows + n * I * s + dyb + n * 2 * I * s + h + part,  # dgu, h, the <G, h> partials
        rows + dyb + n * 2 * I * s + h + part + 8 * n,  # dw and its source
        rows + dyb + n * 2 * I * s + h + 4 * n + d_grads + n * r_d * s,  # the down adapter's gradients, w dyb
        n * 2 * I * s + 4 * n + d_grads + b_gu + n * r_gu * s,  # dgu B
        # dxs, its adapter's product
        n * 2 * I * s + 4 * n + d_grads + n * r_gu * s + rows + max(gu_chunk + res(H, "gate_up_proj", 2 * I), rows),
        n * 2 * I * s + 4 * n + d_grads + n * r_gu * s + rows + N * H * s,  # the slots and dx, their sum
        n * 2 * I * s + 4 * n + n * r_gu * s + N * H * s + factor_bytes + rows + E)  # every factor gradient, xs again
    return {"forward": forward, "backward": backward}


def router_loss_bytes(shape: ModelShape, *, tokens: int, s: int) -> int:
    """The routers' load-balancing loss (``output_router_logits``): every layer's router logits ``N E s``,
    returned by the model and held until the loss, and the fp32 softmax of each that autograd saves for the
    loss's backward, ``N E 4`` (:mod:`notebookkit.models.patching.router_aux_loss`): ``L N E (s + 4)``."""
    return shape.num_layers * tokens * shape.num_experts * (s + 4)


def sparse_block_generation_bytes(shape: ModelShape, *, tokens: int, s: int, nf4: bool = False,
                                  chunk_bytes: int | None = None) -> int:
    """A sparse block's peak in a decode step or a prefill of ``tokens`` tokens (no autograd; module docstring,
    Generation; ``nf4``: NF4 experts, decoded a chunk at a time from :mod:`notebookkit.expert_chunks`' rows,
    ``chunk_bytes`` a chunk's budget)."""
    family = moe_family(shape)
    N, k, E, H = tokens, shape.experts_per_token, shape.num_experts, shape.hidden_size
    n = N * k
    blocks = math.ceil(n / BLOCK_M) + E
    logits = N * E * s + (N * E * 4 if s != 4 else 0)
    if _full_softmax(family, shape):
        routing = logits + N * E * 4 + n * 12
    else:
        routing = logits + n * 12 + n * 4
    # the router logits (N E s), weights and indices (12 n), the kernel's int32 permutation, offsets and schedule
    experts = N * E * s + n * 12 + n * 4 + 8 * E + 12 * blocks
    experts += sparse_block_working_sets(shape, tokens=N, s=s, ranks={}, nf4=nf4, chunk_bytes=chunk_bytes)["forward"]
    return 2 * N * H * s + max(routing, experts)


def describe(shape: ModelShape, ranks: dict[str, Any], nf4: bool = False) -> str:
    """One line for the estimate's notes."""
    adapted = ", ".join(f"{w} r={rank}" for w, rank in ranks.items()) or "none"
    held = "experts in NF4 (load_in_4bit), routers 16-bit" if nf4 else "experts and routers 16-bit"
    return (f"mixture of experts: {shape.num_experts} experts of I={shape.expert_intermediate_size}, "
            f"{shape.experts_per_token} a token; expert adapters: {adapted}; {held}")
