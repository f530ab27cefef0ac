"""Memory of generation: the static KV cache, the captured decode step's buffers, prefill.

Notation as in :mod:`notebookkit.memory.estimate`, with ``B`` rows generated at once, ``M`` cache
slots per row (``max_len``: prompt + new tokens), ``T`` the prompt length (padded), ``s`` bytes of
the compute dtype (the cache's dtype too), ``nk`` key/value heads of ``hd`` values, ``nh`` query heads.

KV cache (allocated once, reused by every call):
    ``L * 2 * B * nk * M * hd * s``. Every layer holds all ``M`` slots, sliding-window layers too
    (the fast path's cache is full length on every layer).

CUDA graph buffers (the captured step's static inputs and outputs, alive as long as the graph):
    fp32 logits ``[B, V]`` (4 bytes each), the seen-token mask ``[B, V]`` (1), the uniforms
    ``[B, V]`` (4), the hidden state ``[B, H]`` (``s``), the token ids by slot ``[B, M]`` (int64),
    and a few int64 numbers per row (next token, position, padding, finished flag:
    ``GRAPH_INTS_PER_ROW * 8`` bytes).

Decode step (the graph's private memory pool: what one step allocates is kept between replays):
    the larger of one decoder layer's working set for ``N = B`` tokens and the LM head's output
    ``[B, V]`` (``s``) with the sampling filters' temporaries, ``SAMPLING_BYTES_PER_LOGIT * B * V``
    (:mod:`notebookkit.models.generation.sampling` with every filter on: the sorted logits and
    their int64 order for top-p, probabilities, cumulative sums, masks, the Gumbel noise).

Prefill (eager, one forward over the prompt; freed when it ends):
    one decoder layer's working set for ``N = B * T`` tokens, plus the last position's logits
    ``[B, V]`` (``s``).

One decoder layer's working set for ``N`` tokens attending over ``M`` slots, without autograd
(each tensor is freed after its last reader):
    attention: ``N * s * (2H + 2(dq + 2dk) + dq)`` (residual, normed input, q/k/v, rotated q/k,
    attention output), the mask ``B * T' * M * s`` (``T'`` queries per row: ``T`` or 1), in
    prefill with grouped-query attention K and V repeated to every head for the attention kernel
    (``2 * B * nh * M * hd * s``; a decode step's single query is grouped onto the key/value heads
    instead, as Hugging Face does, with no copy), and for soft-capped attention (Gemma 2) the
    explicit scores ``B * nh * T' * M * (2s + 4)``;
    MLP: ``N * s * (2H + 3I)`` (residual, normed input, gate, up, their product); a mixture of experts'
    sparse block (Qwen3-MoE, gpt-oss) instead: the router, its fp32 routing and the grouped expert kernel's
    schedule and transients for ``N`` tokens and ``N k`` (token, expert) pairs, the selected experts' weights
    read in place (NF4 ones decoded in the kernel's tiles, no dense copy), as
    :func:`notebookkit.memory.moe.sparse_block_generation_bytes` counts them;
    attention with sinks (gpt-oss) forms its scores explicitly in fp32, with the query heads grouped onto their
    key/value head (no repeated K, V): ``B * nh * T' * M * (2s + 12)`` (scores, their exponentials and
    probabilities in fp32, the probabilities in ``s``) and the mask repeated to each group's rows
    (``B * (nh / nk) * T' * M`` bytes);
    with NF4 weights the dequantised 16-bit copy of the largest projection, ``max(in*out) * s``,
    in either (2-bit and ternary bases dequantise inside the GEMM and the decode matvec: nothing more). LoRA's ``x A^T`` (``N * r`` per projection) is left out.

``generation = kv_cache + graph_buffers + decode_step + prefill``: the cache, the buffers and the
graph's pool stay allocated between calls, so a later call's prefill comes on top of them.

While training (GRPO alternates generation and training steps) the cache, the buffers and the
graph's pool either stay allocated (``keep_cache``: the next step's generation reuses them) or are
freed when the generate call returns (the next one allocates and captures them again);
:func:`keeps_cache_between_steps` is the rule FastGRPOTrainer follows by default. Prefill and the
training step's activations never live at the same time. :func:`generation_term` is what the training
estimate adds, with ``held = kv_cache + graph_buffers + decode_step``:

* cache kept: ``held + max(0, prefill - training transients)``;
* cache freed: ``max(0, held + prefill - training transients)`` (the generate call's peak and the
  training step's are apart in time; only the larger counts);

plus, either way, the cuBLAS workspace of the stream the decode graphs are captured on
(:func:`notebookkit.models.generation.graph_runner.capture_stream`): PyTorch keeps one a (handle, stream)
pair for the life of the process, so the first capture's stays through every training step (32 MiB on
sm_90: session 46 planted a new stream a capture and saw the allocated memory grow by exactly 32 MiB a capture).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from notebookkit.base_formats import BaseFormat
from notebookkit.sequence_tiles import mlp_tile_rows

from . import moe as moe_terms
from .base_weights import base_format_for, dense_copy_bytes
from .shapes import ModelShape, resolve_attention

__all__ = [
    "GenerationMemory", "generation_memory", "generation_bytes", "kv_cache_bytes", "graph_buffer_bytes",
    "generation_term", "keeps_cache_between_steps", "layer_working_set", "SAMPLING_BYTES_PER_LOGIT",
    "GRAPH_INTS_PER_ROW",
]

# Peak temporaries of filter_logits + choose_next per logit, every filter on: top-p holds the
# filtered input (4), its sorted copy (4), int64 order (8), softmax and cumulative sums (4 + 4), two
# masks (2) and its output (4) = 26 bytes, plus the working space of CUDA's sort (a second buffer of
# keys and order, and radix-sort scratch). Measured on an H200 (torch 2.11, the GPU test in
# tests/memory/test_generation_memory.py): 48.9 bytes per logit at [8, 128256], 48.2 at [16, 151936].
SAMPLING_BYTES_PER_LOGIT = 50
GRAPH_INTS_PER_ROW = 8
# the part of generation_term that the capture stream's cuBLAS workspace is shown under (module docstring)
CAPTURE_WORKSPACE_KEY = "generation: cuBLAS workspace of the decode graphs' capture stream"


@dataclass(frozen=True)
class GenerationMemory:
    """Bytes generation needs on the device, by part (see the module docstring)."""

    kv_cache: int
    graph_buffers: int
    decode_step: int
    prefill: int
    inputs: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def held(self) -> int:
        """What stays allocated between calls (and through training steps): cache, buffers, graph pool."""
        return self.kv_cache + self.graph_buffers + self.decode_step

    @property
    def total(self) -> int:
        """The peak of a generate call: what is held plus a prefill."""
        return self.held + self.prefill

    def details(self) -> dict[str, int]:
        return {
            "generation: KV cache": self.kv_cache,
            "generation: CUDA graph buffers": self.graph_buffers,
            "generation: decode step (graph pool)": self.decode_step,
            "generation: prefill": self.prefill,
        }


def kv_cache_bytes(shape: ModelShape, batch_size: int, max_len: int, dtype_bytes: int = 2) -> int:
    """``L * 2 * B * kv_heads * max_len * head_dim * s``: keys and values of every layer, full length."""
    return shape.num_layers * 2 * batch_size * shape.num_kv_heads * max_len * shape.head_dim * dtype_bytes


def graph_buffer_bytes(shape: ModelShape, batch_size: int, max_len: int, dtype_bytes: int = 2) -> int:
    """The captured step's static tensors: fp32 logits, seen mask, fp32 uniforms ``[B, V]``, hidden
    ``[B, H]``, token ids ``[B, max_len]`` and a few int64 numbers per row."""
    V = shape.vocab_size
    per_row = V * (4 + 1 + 4) + shape.hidden_size * dtype_bytes + (max_len + GRAPH_INTS_PER_ROW) * 8
    return batch_size * per_row


def _as_format(base: BaseFormat | bool) -> BaseFormat:
    """A base format, or ``load_in_4bit`` given as a bool (NF4 or 16-bit)."""
    return base_format_for(load_in_4bit=base) if isinstance(base, bool) else base


def layer_working_set(
    shape: ModelShape, batch_size: int, queries: int, slots: int, s: int, base: BaseFormat | bool, attention: str,
    training_path: bool = False, expert_chunk_bytes: int | None = None,
) -> int:
    """One decoder layer's peak without autograd: ``queries`` tokens per row over ``slots`` cache slots
    (``base``: the format of the frozen projections, or ``load_in_4bit`` as a bool; NF4 adds its dense copy,
    2-bit and ternary a dense chunk from 256 tokens on, :mod:`.base_weights`). ``training_path``: the
    training model's forward without autograd (DPO's reference pass), not generation's: a dense MLP is the
    fused kernel, which runs a tile of ``t`` tokens at a time (:mod:`notebookkit.sequence_tiles`): ``3*t*I``
    intermediates and the tile's output (``t*H``, when there is more than one tile) instead of ``3*N*I``
    (generation's own MLP runs whole); gpt-oss's attention with sinks is the fused kernels'
    (:mod:`notebookkit.kernels.attention_sinks`), not the decode path's grouped fp32 scores.
    A mixture of experts' sparse block runs the same code on both paths (NF4 experts decoded in chunks of
    ``expert_chunk_bytes`` from prefill sizes on); on the training path the layer's input ``N*H*s`` and the mask
    are held through it (:mod:`notebookkit.memory.moe`, Reference forward)."""
    base = _as_format(base)
    H, I, dq, dk = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim
    N = batch_size * queries
    attn = N * s * (2 * H + 2 * (dq + 2 * dk) + dq) + batch_size * queries * slots * s
    sinks = shape.attention_sinks  # gpt-oss
    if sinks and training_path:  # kernels.attention_sinks (memory.moe, Reference forward)
        T2 = batch_size * queries * slots
        attn += T2 * (2 + s) + (2 * N * dq * s if dk != dq else 0) + N * dq * s + 8 * batch_size * shape.num_heads * queries
    elif sinks:  # the decode path's
        attn += batch_size * shape.num_heads * queries * slots * (2 * s + 12)
        attn += batch_size * (shape.num_heads // shape.num_kv_heads) * queries * slots
    else:
        if dk != dq and queries > 1:
            attn += 2 * batch_size * shape.num_heads * slots * shape.head_dim * s
        if resolve_attention(shape, attention) == "eager":
            attn += batch_size * shape.num_heads * queries * slots * (2 * s + 4)
    if shape.num_experts:
        mlp = moe_terms.sparse_block_generation_bytes(shape, tokens=N, s=s, nf4=base.load_flag == "load_in_4bit",
                                                      chunk_bytes=expert_chunk_bytes)
        if training_path:  # the layer's input and the mask stay held
            mlp += N * H * s + batch_size * queries * slots * s
    else:
        t = min(N, mlp_tile_rows(I, s)) if training_path and I else N
        mlp = N * s * 2 * H + t * s * (3 * I + (H if t < N else 0))
    return max(attn, mlp) + dense_copy_bytes(shape, base, s, N)


def generation_memory(
    shape: ModelShape,
    batch_size: int,
    max_len: int,
    dtype_bytes: int = 2,
    *,
    prompt_len: int | None = None,
    load_in_4bit: bool = False,
    attention: str = "auto",
    load_in_2bit: bool = False,
    load_in_ternary: bool = False,
    expert_chunk_bytes: int | None = None,
) -> GenerationMemory:
    """What generating ``batch_size`` rows of up to ``max_len`` tokens (prompt + new) needs on the device.

    Args:
        shape: the model's :class:`~notebookkit.memory.shapes.ModelShape` (``model_shape(...)``).
        batch_size: rows generated at once (GRPO: prompts x completions per prompt).
        max_len: cache slots per row, the longest prompt plus ``max_new_tokens``.
        dtype_bytes: bytes of the compute dtype (2 for fp16/bf16, 4 for fp32).
        prompt_len: the (padded) prompt length of the prefill; default ``max_len`` (the most it can be).
        load_in_4bit, load_in_2bit, load_in_ternary: the base format (``from_pretrained``'s flags): NF4
            adds one dequantised projection to the working sets; 2-bit and ternary dequantise inside the
            GEMM and the decode matvec, which write only their outputs (:mod:`.base_weights`).
        attention, expert_chunk_bytes: as for :func:`~notebookkit.memory.estimate.estimate_training_memory`.
    """
    if batch_size < 1 or max_len < 1:
        raise ValueError(
            f"notebookkit.memory: generation needs batch_size >= 1 and max_len >= 1 (got {batch_size}, {max_len})."
        )
    T = max_len if prompt_len is None else int(prompt_len)
    if not 1 <= T <= max_len:
        raise ValueError(
            f"notebookkit.memory: prompt_len must be between 1 and max_len={max_len} (got {prompt_len}); max_len "
            "counts the prompt and the new tokens."
        )
    base = base_format_for(load_in_4bit=load_in_4bit, load_in_2bit=load_in_2bit, load_in_ternary=load_in_ternary)
    s, V = dtype_bytes, shape.vocab_size
    sampling = batch_size * V * (s + SAMPLING_BYTES_PER_LOGIT)
    decode = max(layer_working_set(shape, batch_size, 1, max_len, s, base, attention,
                                   expert_chunk_bytes=expert_chunk_bytes), sampling)
    prefill = layer_working_set(shape, batch_size, T, max_len, s, base, attention,
                                expert_chunk_bytes=expert_chunk_bytes) + batch_size * V * s
    return GenerationMemory(
        kv_cache=kv_cache_bytes(shape, batch_size, max_len, s),
        graph_buffers=graph_buffer_bytes(shape, batch_size, max_len, s),
        decode_step=decode,
        prefill=prefill,
        inputs=dict(batch_size=batch_size, max_len=max_len, prompt_len=T, dtype_bytes=s,
                    load_in_4bit=bool(load_in_4bit), base_format=base.name, attention=attention),
    )


def generation_bytes(shape: ModelShape, batch_size: int, max_len: int, dtype_bytes: int = 2, **kwargs: Any) -> int:
    """Peak device bytes of a generate call beyond the model itself (:func:`generation_memory` ``.total``)."""
    return generation_memory(shape, batch_size, max_len, dtype_bytes, **kwargs).total


def keeps_cache_between_steps(activation_plan: Any) -> bool:
    """Whether GRPO keeps the generation cache through its training steps by default: only when the
    activation plan keeps every layer's activations (memory to spare, so the step saves re-allocating
    the cache and re-capturing its CUDA graph); under recompute or offload, memory is what the plan
    saves, so the cache is freed after each generate call."""
    modes = [activation_plan] if isinstance(activation_plan, str) else list(activation_plan)
    return bool(modes) and all(m == "keep" for m in modes)


def generation_term(
    generation: GenerationMemory | Mapping[str, Any], shape: ModelShape, dtype_bytes: int, base: BaseFormat | bool,
    attention: str, training_transients: int, expert_chunk_bytes: int | None = None,
    cublas_workspace_bytes: int = 0,
) -> tuple[int, dict[str, int]]:
    """Bytes a training step's estimate adds for generation alongside it, and their breakdown.

    ``generation``: a :class:`GenerationMemory` (its cache kept through training), or the keywords
    of :func:`generation_memory` (``batch_size``, ``max_len``, ``prompt_len``), which then takes the
    dtype, base format (``base``) and attention of the training estimate, plus ``keep_cache`` (default True: the
    cache, buffers and graph pool stay allocated through the training step; False: freed after each
    generate call). ``training_transients``: the step's activations, loss buffers and temporaries,
    which a generate call never overlaps; ``expert_chunk_bytes`` as for the training estimate;
    ``cublas_workspace_bytes``: the card's cuBLAS workspace, which the capture stream keeps (module docstring).
    """
    keep = True
    base = _as_format(base)
    if not isinstance(generation, GenerationMemory):
        kwargs = dict(generation)
        unknown = sorted(set(kwargs) - {"batch_size", "max_len", "prompt_len", "attention", "keep_cache"})
        if unknown or "max_len" not in kwargs:
            raise ValueError(
                f"notebookkit.memory: generation= takes batch_size, max_len (prompt + new tokens), prompt_len and "
                f"keep_cache (got {sorted(kwargs)}), e.g. generation=dict(batch_size=8, max_len=1024, prompt_len=512)."
            )
        keep = bool(kwargs.pop("keep_cache", True))
        kwargs.setdefault("attention", attention)
        flags = {base.load_flag: True} if base.load_flag else {}
        generation = generation_memory(shape, kwargs.pop("batch_size", 1), kwargs.pop("max_len"), dtype_bytes,
                                       **flags, expert_chunk_bytes=expert_chunk_bytes, **kwargs)
    workspace = {CAPTURE_WORKSPACE_KEY: cublas_workspace_bytes} if cublas_workspace_bytes else {}
    if not keep:
        beyond = max(0, generation.total - training_transients)
        key = "generation: generate call beyond the training step's transients (cache freed before training)"
        return beyond + cublas_workspace_bytes, ({key: beyond} if beyond else {}) | workspace
    extra_prefill = max(0, generation.prefill - training_transients)
    details = {k: v for k, v in generation.details().items() if k != "generation: prefill"}
    if extra_prefill:
        details["generation: prefill beyond the training step's transients"] = extra_prefill
    return generation.held + extra_prefill + cublas_workspace_bytes, details | workspace
