"""The memory model: peak VRAM of one LoRA / QLoRA training step, from the config alone.

This is the single memory model of notebookkit. The VRAM estimate in the model panel, the
activation planner (``use_gradient_checkpointing="auto"``) and the benchmark's predicted peak all
call :func:`estimate_training_memory`.

Notation (see :mod:`notebookkit.memory.shapes`): ``N = batch_size * seq_len`` tokens, ``H`` hidden,
``L`` layers, ``dq = heads*head_dim``, ``dk = kv_heads*head_dim``, ``I`` intermediate, ``V`` vocab,
``s`` bytes of the compute dtype (2 for fp16/bf16, 4 for fp32), ``r`` LoRA rank, ``P_lin`` the
linear parameters of all decoder layers, ``P_emb = V*H`` (and the same again for an untied LM head).

Base weights
    16-bit:  ``s * (P_lin + P_emb [+ P_head] + norms)``
    NF4:     ``P_lin * (1/2 + 1/64 + 4/(64*256))``: half a byte per weight, one uint8 absmax per
             block of 64 (double quantisation) and one fp32 second-level absmax per 256 blocks;
             without double quantisation the absmax is fp32: ``1/2 + 4/64``.
    2-bit:   ``sum_proj L * in * out * (1/4 + 4/64)``: four codes a byte, an fp16 scale and zero per 64.
    ternary: ``sum_proj L * in * out * (1/4 + 2/in)``: four codes a byte, one fp16 scale per row, so
             the bytes depend on each projection's ``in``.
             In every quantised format the embeddings, LM head and norms stay 16-bit:
             ``2 * (P_emb [+ P_head] + norms)``. The bytes per weight are the record's
             (:mod:`notebookkit.base_formats`, applied by :mod:`notebookkit.memory.base_weights`);
             ``load_in_4bit`` / ``load_in_2bit`` / ``load_in_ternary`` choose the row, as in ``from_pretrained``.

Adapters (params + grads + optimizer), over the targeted projections, ``P_lora = L * sum r*(in+out)``
    fp32 adapters: ``P_lora * (4 param + 4 grad + opt)``; 16-bit adapters add an fp32 master copy:
    ``P_lora * (2 + 2 + 4 + opt)``. ``opt`` = 8 for AdamW (two fp32 moments), ``2 + 8/256`` for the
    8-bit (blockwise, fp32 absmax per 256 values) AdamW variants, 4 for Lion, 0 for SGD,
    ``4*(rows+cols)/(rows*cols)`` per matrix for Adafactor. Adapters in another dtype than the
    compute dtype add their casts, kept through the step by the fused path: ``P_lora * s``.
    Adapters in the compute dtype are used as they are, except the ``A`` of projections that share
    an input (q, k, v; gate, up), which the fused path concatenates into one ``A_cat`` per group
    (one rank-space GEMM for the group), kept through the step: ``L * r * H * s`` per grouped
    projection, for a group whose projections are all targeted. (In another dtype, ``A_cat`` takes
    the place of those ``A`` casts: ``P_lora * s`` either way.)

Activations saved for backward, per decoder layer, by mode (checked tensor by tensor with
``torch.autograd.graph.saved_tensors_hooks`` on the fused path: ``tests/memory/test_saved_activations.py``)
    keep:      what the fused kernels save, in ``s``-byte elements per token:
               ``H`` (input of the attention norm) + ``H`` (normed input of q/k/v, saved once by
               ``lora_qkv``) + ``dq + 2*dk`` (Q, K after RoPE and V, saved by SDPA) + ``dq`` (the
               attention output, saved by SDPA and by ``lora_o`` as one storage) + ``H`` (residual =
               input of the MLP norm) + ``H`` (normed input of gate/up) + ``2*I`` (e, g of the gated
               MLP; the product is recomputed in backward) + ``r`` per targeted projection but down (the
               rank-space inputs ``s x A^T`` the LoRA kernels save, :func:`saved_low_rank_bytes`; down's is
               computed again) [+ ``dq + dk`` pre-norm q, k on Qwen3/Gemma 3] [+ ``2*H``
               inputs of the post-norms on Gemma 2/3] [+ ``2*(dq - dk)`` with ``kv_repeated``: K and V
               repeated to every query head before SDPA, :mod:`.grouped_kv`] [+ ``B * T^2`` per layer for a
               padded batch: SDPA's additive copy of the padding mask]; plus fp32 per token: the norms' ``1/rms``
               (2 or 4 values, and one per head for q/k norms) and the attention log-sum-exp (one
               per query head).
               Soft-capped attention (Gemma 2) runs an explicit softmax instead of SDPA: K and V
               are kept repeated to all ``heads`` (``2*dq`` instead of ``2*dk``), no log-sum-exp, and
               per layer ``B * heads * T^2 * (2*s + 4)`` bytes (the tanh output, the fp32 softmax and
               the 16-bit probabilities) plus the boolean mask ``B * T^2`` (``T^2`` when the forward is
               plainly causal and Hugging Face builds no mask; the estimate keeps the larger).
               LoRA dropout > 0 takes every group with a target (q/k/v, o, gate/up/down) off the fused
               kernels onto PEFT's code, where each adapter saves dropout's boolean mask (1 byte) and
               its input dropped in the adapters' dtype (``a`` bytes, 4 for PEFT's fp32) per input
               element, and ``x A^T`` (``r * a`` per token); what only the fused kernels kept is
               then not saved: the normed input of q/k/v and of the MLP (``H`` each) and, with the
               explicit softmax, the attention output (``dq``).
    recompute: the layer input only, ``N * H * s``.
    offload:   nothing on the GPU (the input lives in pinned host memory, ``N * H * s`` there),
               except the last decoder layer, whose input stays on the GPU when it is offloaded.
    Offloading adds layer inputs in flight in the backward of the layers on the host: each fetches its
    own and prefetches the previous such layer's (two inputs, one fewer net once the last layer's, kept
    on the GPU, is freed; one where no layer before it went to the host): :func:`in_flight_bytes`. They
    join that phase's peak (the first recompute, under Temporaries), not the end of the forward's.
    offload_mlp: as offload, and a layer whose MLP is deferred (below) parks its gate/up outputs in pinned
               host memory too (``2 * N * I * s`` there, the last layer excepted, which keeps its input on
               the GPU and recomputes). On the GPU the previous parked layer's first ``[t, 2 I]`` tile is
               prefetched while a layer's MLP backward runs, and a layer of several tiles prefetches its
               own next one: :func:`parked_mlp_bytes`, :func:`in_flight_bytes`.
    Masks the layers share (gpt-oss only, :func:`shared_mask_bytes`): the attention with sinks saves a
    boolean ``B * T^2`` mask made once per forward for each of Hugging Face's two masks (full layers,
    sliding-window layers), whatever the modes; where a layer is recomputed, its checkpoint also holds
    Hugging Face's own two masks (``B * T^2 * s`` each) until the backward.

Logits / loss
    fused linear cross-entropy (default): the final norm's input and output and the gradient of the
    hidden states computed during the forward (``3 * N * H * s``), fp32 per-row losses, the final
    norm's ``1/rms`` and the shifted labels (``16 * N``), plus one chunk of ``C`` rows of logits
    overwritten in place by their gradient: ``C * V * s``. ``C`` is the kernel's choice
    (``kernels.fused_linear_cross_entropy.choose_chunk_size``): ``max(512, N / ceil(V / H))`` rows
    at most 256 MiB, in equal chunks.
    materialised: ``N * V * (s + 3 * 4)``: 16-bit logits, their fp32 upcast, the fp32 log-softmax
    kept for backward, and the fp32 gradient. This is what plain transformers does and why long
    sequences with 128k-256k vocabularies run out of memory there.

Temporaries (the backward's working set, when it exceeds the loss buffers, which are freed by then)
    The backward of the last layer is the high-water mark: every saved activation is still there,
    the loss buffers are gone, and it adds
    - the gradient arriving from above (``N*H*s``), the MLP's ``dY W_down`` (``N*I*s``, into which
      the in-place activation backward writes) and the gradient of its input (``N*H*s``);
    - with NF4, the dequantised 16-bit copy of the projection being multiplied (one at a time:
      each is freed right after its GEMM), ``max(in*out) * s``; with 2-bit or ternary (dequantised
      inside the GEMM tile, no dense copy) the fresh ``[N, H]`` input gradient the kernel writes for
      the second projection of q/k/v or gate/up before it is added to the first: ``N*H*s``;
    - for recompute/offload layers, the recomputed layer's keep activations (less its input,
      which is the stored one); kept layers after the last recomputed one are gone by then (the
      backward runs from the last layer down and frees what each layer saved), so a plan that
      keeps the last layers peaks at the larger of "all saved + loss buffers" and "the rest
      saved + one recompute + the offloaded inputs and parked tiles in flight";
    - where the MLP output only enters the residual sum (no post-MLP norm) and the MLP runs the fused
      kernel (no LoRA dropout), the recompute defers the MLP (``kernels.lora_mlp``): the recomputed
      layer saves no e, g (``2*I`` per token less), and its MLP backward runs a tile of ``t`` tokens at
      a time (``notebookkit.sequence_tiles.mlp_tile_rows``: 9,216 for an 8B model in bf16): the gradient
      from above and of the input (``2*N*H*s``), the tile's e, g and ``dY W_down`` (``3*t*I*s``) and, when
      there is more than one tile, the tile's input gradient before it is copied (``t*H*s``);
    - the attention backward (after the MLP's e, g are freed) when it needs more: the output
      gradient, the fp32 ``dQ`` accumulator and, with GQA, K/V gradients expanded to all heads
      (FlashAttention 2), or the ``[B, heads, T, T]`` fp32 gradients of an explicit softmax;
    - with the FP8 forward (``fp8_forward=True``), the GEMM of a (re)computed forward when it needs
      more: the one-byte copies of the input and of the weights of one FP8 product,
      ``N*in + sum(in*out)``, alive only during that product, for the largest product. q/k/v and
      gate/up (which read one input) are one product each when ``in`` and every ``out`` are
      multiples of 16 (``kernels.lora_projection.fp8_group_applies``): their weights sit together in
      one FP8 buffer, ``in * (out_q + out_k + out_v)`` and ``2 * in * I``; otherwise, and for o and
      down, one projection at a time (an NF4 weight goes to FP8 in one kernel, with no 16-bit copy,
      when its rows are whole 64-element blocks of at most 16K elements; otherwise its dequantised
      16-bit weight is added). The fp32 scales (4 bytes per token and per output row) are left out.
    The LoRA gradients (in "adapters + optimizer") are counted as alive throughout.
    The CUDA context (``cuda_context_bytes``) is not part of ``torch.cuda.max_memory_allocated``,
    so :attr:`MemoryEstimate.peak_allocated` leaves it out. PyTorch's cuBLAS workspace for the training
    stream (``cublas_workspace_bytes``: 32 MiB on sm_90, 8.125 MiB on other cards,
    :func:`~notebookkit.memory.cards.cublas_workspace_bytes`) is allocated at the first matmul and kept, so
    it is counted in the temporaries and in the peak.

Preference and RL steps (``method=``, a row of :mod:`notebookkit.training_methods`: rows per example,
log-prob loss, reference pass, completion-only loss, generation alongside)
    ``"dpo"`` / ``"orpo"``: ``batch_size`` counts preference pairs; chosen and rejected go through the
    model as one batch of ``2 * batch_size`` rows of ``seq_len`` tokens, so activations, loss buffers
    and working sets are those of ``2 * batch_size`` rows. The loss is the chunked per-token log-prob
    op (``kernels.linear_logprobs``): the same buffers as the fused cross-entropy (it saves the final
    norm's input and output, makes the hidden-state gradient in backward, one ``[C, V]`` chunk at a
    time) plus an fp32 entropy per row (``4 * N``). DPO's reference pass (adapters off, no gradient)
    runs after the policy's forward, while the policy's activations are saved: it adds one decoder
    layer's no-grad working set for ``N`` tokens (:mod:`notebookkit.memory.generation`'s formula) to
    the end-of-forward peak (its hidden states and logits chunk take the place of the policy's
    forward chunk). ORPO has no reference.
    ``"grpo"``: ``batch_size`` counts completions per micro-batch, ``seq_len`` is prompt +
    completion; only the last ``completion_len`` positions of a row reach the LM head
    (``logits_to_keep``), so the loss buffers are for ``batch_size * completion_len`` rows (default:
    ``seq_len``, the most). Generation comes with it (below); without ``generation=`` it is
    ``batch_size`` rows of ``seq_len`` slots with a ``seq_len - completion_len`` prompt, its cache
    kept through training when the plan keeps every layer and freed otherwise (FastGRPOTrainer's
    default, :func:`~notebookkit.memory.generation.keeps_cache_between_steps`).

Generation alongside training (``generation=``, GRPO: a generation and a training step every step,
on one model): with ``keep_cache`` (the default) the KV cache, the captured decode step's buffers and
its graph pool stay allocated through the training step, and a prefill never overlaps the training
step's transients, so only what it needs beyond them is added; with ``keep_cache=False`` they are
freed after each generate call and only the generate call's peak beyond the training step's
transients counts (:mod:`notebookkit.memory.generation`).

Input embedding in host memory (``offload_embedding=True``, untied embeddings only): its ``V * H * s``
bytes leave the base weights; pinned host memory gains that size rounded up to a power of two (how
PyTorch's pinned allocator sizes its blocks; :mod:`notebookkit.models.loading.offload_embedding`).

Vision-language models (a Qwen2.5-VL / Gemma 3 config, model, folder or ``VLMShape``): the decoder's
parts above for ``seq_len`` tokens per row, image tokens included, plus the vision tower's weights,
adapters and saved activations (:mod:`notebookkit.memory.vision_estimate`).

Mixtures of experts (Qwen3-MoE, gpt-oss: :mod:`notebookkit.memory.moe` has the formulas)
    Under ``load_in_4bit`` the experts are NF4 (bitsandbytes quantises ``nn.Linear`` only; the loader
    quantises the stacked experts itself) and the routers stay in the compute dtype; the attention
    projections follow the base format. The experts' adapters are
    PEFT's ``ParamWrapper`` pairs ``lora_A [r E, in]``, ``lora_B [out, r E]`` (Qwen3-MoE's gate_up at
    ``2 r`` when PEFT maps ``gate_proj`` + ``up_proj`` onto it; at ``r`` when ``target_parameters`` names
    it). A kept layer saves its attention and norms (the fused ones, gpt-oss's attention with sinks among them)
    and the sparse block's routing tensors, ``gu [N k, 2 I]``, the
    rank-space products, the permutation and block schedule; the block's forward and backward working
    sets replace the dense MLP's. Offloading is not written for these models: ``"offload"`` layers
    recompute (as ``use_gradient_checkpointing`` does). DPO's reference pass is one layer's no-grad working
    set as for a dense model, the sparse block's being :func:`~notebookkit.memory.moe.sparse_block_generation_bytes`
    (the reference forward runs the same routing and grouped kernel as generation, adapters off, nothing
    saved); GRPO's generation alongside training is :mod:`notebookkit.memory.generation`'s, whose layer
    working set counts the sparse block the same way. Not covered: ``lora_dropout > 0`` (refused: PEFT
    refuses dropout on the experts), 2-bit / ternary bases (refused: the loader refuses them), the
    routers' load-balancing loss when it is on (``output_router_logits``: its ``L N E`` fp32 softmax; TRL
    1.16 turns it on for SFT, DPO and GRPO alike from the config's ``router_aux_loss_coef``, and
    notebookkit's trainers then hand the loss to TRL's own LM head instead of the fused one counted here:
    every MoE estimate's notes say so; the estimate is for ``router_aux_loss_coef=0.0``; SFT keeps the fused
    loss, its head adding the router loss, and counts :func:`~notebookkit.memory.moe.router_loss_bytes`). gpt-oss's reference forward runs the training
    path's attention with sinks (:mod:`notebookkit.kernels.attention_sinks`), not the decode path's.

Peak: ``total = base_weights + adapters + activations + logits_loss + temporaries [+ generation]``:
the larger of the end-of-forward peak (inside the loss) and the backward peak, plus the CUDA context. What
``torch.cuda.max_memory_reserved`` shows is higher by the caching allocator's fragmentation (a few
percent); the planner leaves a margin for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from notebookkit.base_formats import BASE_FORMATS, BaseFormat
from notebookkit.expert_chunks import DECODE_CHUNK_BYTES, chunk_budget
from notebookkit.families import for_model_type
from notebookkit.sequence_tiles import mlp_tile_rows
from notebookkit.training_methods import TRAINING_METHODS

from . import cards
from .cards import DEFAULT_CUBLAS_WORKSPACE_BYTES
from .base_weights import base_format_for, dense_copy_bytes, input_grad_buffer_bytes, projection_weight_bytes
from .generation import generation_term, keeps_cache_between_steps, layer_working_set
from .model_setup import (base_format_of, fp8_forward, fused_lm_head, held_decode_cache, host_embedding,
                          recorded_activation_plan, recorded_expert_chunk_budget)
from . import moe as moe_terms
from .shapes import PROJECTIONS, ModelShape, model_shape, resolve_attention

GiB = 1024**3

MODES = ("keep", "recompute", "offload", "offload_mlp")
#: the modes whose layer input goes to pinned host memory (offload_mlp: with its MLP's gate/up outputs)
OFFLOADING = ("offload", "offload_mlp")
#: layers (kept or recomputed) whose forwards outlast the copies to the host of the offloaded layer before them (its
#: input and parked gate/up outputs): with fewer after the last offloaded layer, those copies may still run at the
#: end of the forward (_temporaries); the planner's spread layout ends on this many kept layers
LAYERS_AFTER_COPIES = 2
# gpt-oss alternates sliding-window and full layers: Hugging Face builds one attention mask for each kind
SINKS_MASK_KINDS = 2
METHODS = tuple(TRAINING_METHODS)

_OPT_STATE_BYTES = {
    "adamw": 8.0, "adamw_torch": 8.0, "adamw_torch_fused": 8.0, "adamw_hf": 8.0, "adam": 8.0,
    "paged_adamw_32bit": 8.0, "adamw_apex_fused": 8.0, "adamw_torch_4bit": 1.0 + 8 / 128,
    "adamw_8bit": 2.0 + 8 / 256, "adamw_bnb_8bit": 2.0 + 8 / 256, "paged_adamw_8bit": 2.0 + 8 / 256,
    "adam8bit": 2.0 + 8 / 256, "adamw8bit": 2.0 + 8 / 256,
    "lion": 4.0, "lion_32bit": 4.0, "paged_lion_32bit": 4.0,
    "lion_8bit": 1.0 + 4 / 256, "paged_lion_8bit": 1.0 + 4 / 256,
    "sgd": 0.0,
}

_DTYPE_BYTES = {"float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2, "float32": 4, "fp32": 4, "float": 4}

ALL_TARGETS = list(PROJECTIONS)


def _grouped_mm_flag(dtype: Any) -> bool | None:
    """A bf16 step's experts may run on ``grouped_mm`` (None: count the larger path); other dtypes never do."""
    return None if str(dtype).replace("torch.", "") in ("bfloat16", "bf16") else False


def bytes_of_dtype(dtype: Any) -> int:
    if dtype is None:
        return 2
    name = str(dtype).replace("torch.", "").lower()
    if name not in _DTYPE_BYTES:
        raise ValueError(f"notebookkit.memory: unknown dtype {dtype!r}; use 'float16', 'bfloat16' or 'float32'.")
    return _DTYPE_BYTES[name]


def default_loss_chunk(tokens: int, hidden: int, vocab: int, dtype_bytes: int = 2) -> int:
    """Rows of logits the fused linear cross-entropy holds at once on a GPU.

    Mirrors ``kernels.fused_linear_cross_entropy.choose_chunk_size`` (LM head frozen, plenty of free
    memory): ``N / ceil(V / H)`` rows, at least 512, at most 256 MiB of chunk, in equal chunks
    rounded up to a multiple of 8 rows.
    """
    if tokens <= 0:
        return 1
    row_bytes = vocab * dtype_bytes + 2 * hidden * dtype_bytes + 16
    budget_rows = max(1, (256 * 2**20) // row_bytes)
    vh_rows = math.ceil(tokens / max(1, math.ceil(vocab / max(hidden, 1))))
    rows = max(1, min(tokens, max(vh_rows, 512), budget_rows))
    n_chunks = math.ceil(tokens / rows)
    rows = math.ceil(tokens / n_chunks)
    if rows > 8:
        rows = min(tokens, math.ceil(rows / 8) * 8)
    return rows


def normalize_plan(plan: Any, num_layers: int) -> tuple[str, ...]:
    """Per-layer modes from a plan given as a mode name, a bool, a list, or an ``ActivationPlan``.

    ``False``/``"keep"`` keep everything; ``True``/``"recompute"`` recompute every layer;
    ``"offload"`` (alias ``"unsloth"``) recomputes every layer from an input kept in host memory;
    ``"offload_mlp"`` also keeps each layer's MLP gate/up outputs there (their GEMMs are not recomputed).
    """
    modes = getattr(plan, "modes", None)
    if modes is not None:
        plan = list(modes)
    if plan is None or plan is False:
        return ("keep",) * num_layers
    if plan is True:
        return ("recompute",) * num_layers
    if isinstance(plan, str):
        key = plan.lower()
        alias = {"keep": "keep", "none": "keep", "no": "keep", "off": "keep",
                 "recompute": "recompute", "checkpoint": "recompute", "true": "recompute", "full": "recompute",
                 "offload": "offload", "unsloth": "offload", "cpu": "offload", "offload_mlp": "offload_mlp"}
        if key == "auto":
            raise ValueError(
                "notebookkit.memory: activation_plan='auto' is decided by the planner: call "
                "notebookkit.memory.plan_activations(...) and pass its plan here."
            )
        if key not in alias:
            raise ValueError(f"notebookkit.memory: unknown activation mode {plan!r}; use one of {MODES}.")
        return (alias[key],) * num_layers
    modes = [str(m).lower() for m in plan]
    if len(modes) != num_layers:
        raise ValueError(
            f"notebookkit.memory: the activation plan has {len(modes)} entries but the model has {num_layers} layers."
        )
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"notebookkit.memory: unknown activation modes {sorted(set(bad))}; use {MODES}.")
    return tuple(modes)


#: the projections whose fused autograd function saves its rank-space input ``s X A^T`` ``[N, r]`` for the backward
#: (``lora_qkv``, ``lora_o``, ``lora_mlp``'s gate and up); the down projection computes its own again from the
#: ``h`` its backward rebuilds
SAVED_LOW_RANK = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")


def saved_low_rank_bytes(tokens: int, lora_r: int, dtype_bytes: int, targets: Iterable[str],
                         names: Iterable[str] = SAVED_LOW_RANK) -> int:
    """Bytes of the rank-space inputs ``s X A^T`` the fused LoRA functions save: ``tokens * r * s`` for each
    targeted projection among ``names``."""
    targets = set(targets)
    return tokens * lora_r * dtype_bytes * sum(name in targets for name in names)


def lora_targets(target_modules: Any) -> list[str]:
    if target_modules is None or target_modules == "all-linear" or target_modules == "all":
        return list(ALL_TARGETS)
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    out = []
    for t in target_modules:
        name = str(t).split(".")[-1]
        if name not in PROJECTIONS:
            raise ValueError(f"notebookkit.memory: unknown LoRA target {t!r}; choose from {list(PROJECTIONS)}.")
        if name not in out:
            out.append(name)
    return out


def readable_bytes(nbytes: float) -> str:
    if abs(nbytes) >= GiB / 10:
        return f"{nbytes / GiB:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def _weights_label(inputs: dict[str, Any]) -> str:
    fmt = BASE_FORMATS.get(inputs.get("base_format", "nf4" if inputs.get("load_in_4bit") else "16bit"))
    return fmt.label if fmt is not None and fmt.quantised else str(inputs.get("dtype"))


@dataclass
class MemoryEstimate:
    """Predicted peak memory of a training step, in bytes, by part.

    ``total`` is what must fit on the card (CUDA context included);
    ``peak_allocated`` is the same without the context, comparable to
    ``torch.cuda.max_memory_allocated()``; ``cublas_workspace`` is the training stream's cuBLAS workspace, inside
    ``temporaries`` and the peak. ``details`` breaks each part down further;
    ``host_offload`` is pinned host memory used by offloaded layers (and by the input embedding
    under ``offload_embedding``).
    """

    base_weights: int
    adapters: int
    activations: int
    logits_loss: int
    temporaries: int
    total: int
    cuda_context: int = 0
    cublas_workspace: int = 0
    host_offload: int = 0
    generation: int = 0
    per_layer_activations: tuple[int, ...] = ()
    plan: tuple[str, ...] = ()
    details: dict[str, int] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    shape: ModelShape | None = None

    @property
    def peak_allocated(self) -> int:
        """Predicted ``torch.cuda.max_memory_allocated()`` (the total without the CUDA context)."""
        return self.total - self.cuda_context

    @property
    def total_gib(self) -> float:
        return self.total / GiB

    def fits(self, budget_bytes: int) -> bool:
        return self.total <= budget_bytes

    def parts(self) -> dict[str, int]:
        """The parts that add up to ``total``, with readable names (generation only when estimated)."""
        parts = {
            "base weights": self.base_weights,
            "adapters + optimizer": self.adapters,
            "activations": self.activations,
            "logits / loss": self.logits_loss,
            "temporaries": self.temporaries,
        }
        if self.generation:
            parts["generation"] = self.generation
        return parts

    def plan_counts(self) -> dict[str, int]:
        return {m: sum(1 for p in self.plan if p == m) for m in MODES}

    def as_dict(self) -> dict[str, Any]:
        return {
            "base_weights": self.base_weights, "adapters": self.adapters, "activations": self.activations,
            "logits_loss": self.logits_loss, "temporaries": self.temporaries, "total": self.total,
            "peak_allocated": self.peak_allocated, "cuda_context": self.cuda_context,
            "cublas_workspace": self.cublas_workspace,
            "host_offload": self.host_offload, "generation": self.generation, "plan": list(self.plan), "details": dict(self.details),
            "inputs": dict(self.inputs),
        }

    def table(self) -> str:
        """A readable breakdown (what ``print(estimate)`` shows)."""
        name = self.shape.name if self.shape is not None else "model"
        i = self.inputs
        head = (
            f"Memory estimate for {name}: {_weights_label(i)} weights, "
            f"LoRA r={i.get('lora_r')} on {len(i.get('target_modules', []))} projections, "
            f"batch {i.get('batch_size')} x seq {i.get('seq_len')}, optimizer {i.get('optimizer')}"
        )
        counts = self.plan_counts()
        plan = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
        lines = [head, f"activation plan: {plan}", ""]
        width = max(len(k) for k in list(self.parts()) + list(self.details)) + 4
        for part, value in self.parts().items():
            lines.append(f"{part:<{width}}{readable_bytes(value):>12}")
            for key, sub in self.details.items():
                if key.startswith(part + ":") and sub:
                    lines.append(f"  {key.split(':', 1)[1].strip():<{width - 2}}{readable_bytes(sub):>12}")
        lines.append("-" * (width + 12))
        lines.append(f"{'total (peak)':<{width}}{readable_bytes(self.total):>12}")
        lines.append(f"{'  of which CUDA context':<{width}}{readable_bytes(self.cuda_context):>12}")
        if self.host_offload:
            lines.append(f"{'pinned host memory':<{width}}{readable_bytes(self.host_offload):>12}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, p, cycle) -> None:  # IPython
        p.text(self.table())


def estimate_kwargs_from_model(model: Any) -> dict[str, Any]:
    """What a loaded (PEFT) model tells about itself: the base format (``load_in_4bit`` /
    ``load_in_2bit`` / ``load_in_ternary``: the loader's record, :func:`.model_setup.base_format_of`, else
    the quantization config), ``dtype``, ``lora_r``,
    ``target_modules``, ``lora_dropout`` from its configs, a mixture of experts' ``target_parameters`` ranks from
    its adapters (:func:`stacked_expert_ranks`), ``fused_loss``, ``fp8_forward`` and
    ``offload_embedding`` from what notebookkit set up on it, and ``generation`` when ``generate`` holds a
    KV cache on it (:mod:`.model_setup`). Missing facts are left out (the defaults apply)."""
    out: dict[str, Any] = {}
    cfg = getattr(model, "config", None)
    q = getattr(cfg, "quantization_config", None)
    if q is not None:
        get = q.get if isinstance(q, dict) else lambda k, d=None: getattr(q, k, d)
        out["load_in_4bit"] = bool(get("load_in_4bit", False))
        if out["load_in_4bit"]:
            out["double_quant"] = bool(get("bnb_4bit_use_double_quant", False))
    dtype = None
    embeddings = getattr(model, "get_input_embeddings", None)
    try:  # the dtype the model really computes in: its (16-bit, never quantised) embedding table
        table = embeddings() if embeddings is not None else None
        dtype = table.weight.dtype if table is not None else None
        if table is not None and host_embedding(table):
            out["offload_embedding"] = True  # from_pretrained(offload_embedding=True) moved its table to the host
    except Exception:  # noqa: BLE001 - a model without embeddings: fall back to the config
        dtype = None
    dtype = dtype or getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if dtype is not None and str(dtype).replace("torch.", "") in _DTYPE_BYTES:
        out["dtype"] = str(dtype).replace("torch.", "")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    recorded = base_format_of(base) or base_format_of(model)
    if recorded is not None:  # the loader's note wins over a quantization config (2-bit and ternary have none)
        fmt = BASE_FORMATS.get(recorded)
        if fmt is None:
            raise ValueError(f"notebookkit.memory: the model is marked with base format {recorded!r}, which the "
                             f"memory model does not know ({sorted(BASE_FORMATS)}); update notebookkit.")
        for flag in (f.load_flag for f in BASE_FORMATS.values() if f.load_flag):
            out.pop(flag, None)
        if fmt.load_flag:
            out[fmt.load_flag] = True
        if fmt.nested_group_bytes is None:
            out.pop("double_quant", None)
    if hasattr(base, "__dict__") and not fused_lm_head(base) and hasattr(base, "lm_head"):
        out["fused_loss"] = False  # the causal-LM head is not patched: stock code materialises the logits
    peft = getattr(model, "peft_config", None)
    if isinstance(peft, dict) and peft:
        pc = next(iter(peft.values()))
        out["lora_r"] = int(getattr(pc, "r", 16))
        tm = getattr(pc, "target_modules", None)
        if tm:
            names = [t for t in (list(tm) if not isinstance(tm, str) else [tm]) if str(t).split(".")[-1] in PROJECTIONS]
            # PEFT's adapters on stacked experts (target_parameters) count as the MLP names that ask for them
            stacked = {str(p).split(".")[-1] for p in (getattr(pc, "target_parameters", None) or ())}
            names += [n for p, ns in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))
                      if p in stacked for n in ns]
            if names:
                out["target_modules"] = sorted({str(t).split(".")[-1] for t in names}, key=PROJECTIONS.index)
        ranks = stacked_expert_ranks(model, next(iter(peft)))
        if ranks:  # the experts' adapters as PEFT made them (a rank_pattern's 2 r, or r for explicit names)
            out["target_parameters"] = ranks
        out["lora_dropout"] = float(getattr(pc, "lora_dropout", 0.0) or 0.0)
    if any(fp8_forward(m) for m in getattr(model, "modules", lambda: [])()):
        out["fp8_forward"] = True  # set by get_peft_model(fp8_base_matmul=True) on the base linears
    device = _cuda_device_of(model)
    if device is not None:  # the training stream's cuBLAS workspace on the card the model is on
        import torch

        out["cublas_workspace_bytes"] = cards.cublas_workspace_bytes(torch.cuda.get_device_capability(device))
    elif hasattr(model, "parameters"):  # a model on a CPU: no cuBLAS
        out["cublas_workspace_bytes"] = 0
    chunk = expert_chunk_budget(base)
    if chunk is not None:  # a mixture of experts on a GPU: its NF4 experts' chunks (its plan's, else this card's)
        out["expert_chunk_bytes"] = chunk
    held = held_decode_cache(base)
    if held is not None:  # generate's cache stays allocated through training: its share joins the estimate
        rows, slots = held
        out["generation"] = dict(batch_size=rows, max_len=slots, prompt_len=slots, keep_cache=True)
    from .vision_shapes import is_vlm, vision_kwargs_from_model

    if is_vlm(model):
        out.update(vision_kwargs_from_model(model))
    return out


def _cuda_device_of(model: Any) -> Any:
    """The CUDA device of ``model``'s first parameter there, or None (on a CPU, or no parameters)."""
    parameters = getattr(model, "parameters", None)
    return next((p.device for p in parameters() if p.device.type == "cuda"), None) if parameters else None


def expert_chunk_budget(model: Any) -> int | None:
    """The budget of one chunk of NF4 experts decoded at a time on the GPU holding ``model`` (a mixture of
    experts): the kernels' own rule, :func:`~notebookkit.expert_chunks.chunk_budget` (the one its activation
    plan recorded, else this process's share of the card), or ``None``: a dense model, or no parameter on a GPU."""
    spec = for_model_type(getattr(getattr(model, "config", None), "model_type", None))
    if spec is None or spec.moe is None:
        return None
    device = _cuda_device_of(model)
    if device is None:
        return None
    planned = next((b for m in model.modules() if (b := recorded_expert_chunk_budget(m)) is not None), None)
    return chunk_budget(device, planned)


def stacked_expert_ranks(model: Any, adapter: str) -> dict[str, int]:
    """``{stacked weight: rank}`` of PEFT's ``ParamWrapper`` adapters on a mixture of experts' ``gate_up_proj`` /
    ``down_proj`` in ``model`` (each wrapper names its ``parameter_name`` and keeps ``r`` by adapter); the largest
    rank where layers differ (the memory model takes one rank a weight). Empty without such adapters."""
    ranks: dict[str, int] = {}
    for module in getattr(model, "modules", lambda: [])():
        name, r = getattr(module, "parameter_name", None), getattr(module, "r", None)
        if name in moe_terms.STACKED and isinstance(r, dict) and adapter in r and hasattr(module, "lora_A"):
            ranks[name] = max(ranks.get(name, 0), int(r[adapter]))
    return ranks


def activation_plan_of(model: Any) -> Any:
    """The activation plan a loaded model runs: the per-layer modes notebookkit applied
    (``use_gradient_checkpointing``), else ``"recompute"`` / ``"keep"`` from Hugging Face's flag."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modes = recorded_activation_plan(base)
    if modes is None:
        from notebookkit.compat import is_checkpointing

        return "recompute" if is_checkpointing(base) else "keep"
    return "keep" if modes == "none" else modes


def estimate_for_model(
    model: Any, batch_size: int = 1, seq_len: int | None = None, **overrides: Any
) -> MemoryEstimate:
    """:func:`estimate_training_memory` for a model loaded by ``FastLanguageModel`` (after
    ``get_peft_model``), as it is set up now.

    Reads the shape, 4-bit loading, compute dtype, LoRA rank/targets/dropout and the activation
    plan (per-layer keep / recompute / offload that ``use_gradient_checkpointing`` applied) off the
    model. ``seq_len`` defaults to the model's ``max_seq_length``. Any keyword of
    :func:`estimate_training_memory` (``optimizer="adamw_8bit"``, ``activation_plan=...``) overrides
    what was read.
    """
    kwargs = estimate_kwargs_from_model(model)
    kwargs["activation_plan"] = activation_plan_of(model)
    if seq_len is None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        seq_len = getattr(model, "max_seq_length", None) or getattr(base, "max_seq_length", None) or 2048
    kwargs.update(overrides)
    return estimate_training_memory(model, batch_size=batch_size, seq_len=int(seq_len), **kwargs)


GROUPED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def grouped_lora_A_params(shape: ModelShape, r: int, target_modules: Iterable[str] | None = None) -> int:
    """Elements of the ``A_cat`` the fused path builds: ``L * sum r * in`` over the projections of every
    group sharing an input (q/k/v; gate/up) whose members are all targeted (same rank)."""
    targets = lora_targets(target_modules)
    dims = shape.projection_shapes()
    grouped = [t for group in GROUPED_PROJECTIONS if all(t in targets and t in dims for t in group) for t in group]
    return shape.num_layers * sum(r * dims[t][0] for t in grouped)


def fp8_products(shape: ModelShape) -> list[tuple[str, ...]]:
    """The projections of one layer whose FP8 base products are one product with the FP8 forward:
    q/k/v and gate/up each as one (their weights in one FP8 buffer) when the input size and each
    output size are multiples of 16 (``torch._scaled_mm``'s rule, as
    ``kernels.lora_projection.fp8_group_applies``), otherwise and for o and down one per projection."""
    dims = shape.projection_shapes()
    products: list[tuple[str, ...]] = []
    for group in GROUPED_PROJECTIONS:
        if not all(n in dims for n in group):  # a mixture of experts: no dense MLP projections
            continue
        if all(dims[n][0] % 16 == 0 and dims[n][1] % 16 == 0 for n in group):
            products.append(group)
        else:
            products.extend((n,) for n in group)
    grouped = {n for g in GROUPED_PROJECTIONS for n in g}
    products.extend((n,) for n in dims if n not in grouped)
    return products


def lora_param_count(shape: ModelShape, r: int, target_modules: Iterable[str] | None = None,
                     target_parameters: Any = None) -> int:
    """Trainable LoRA parameters: ``L * sum over targets of r * (in + out)``; on a mixture of experts the
    MLP names (or ``target_parameters``) adapt the stacked experts instead (``L * E * sum r_w (in_w + out_w)``,
    :mod:`.moe`)."""
    dims = shape.projection_shapes()
    targets = lora_targets(target_modules)
    dense = shape.num_layers * sum(r * (dims[t][0] + dims[t][1]) for t in targets if t in dims)
    ranks = moe_terms.expert_lora_ranks(shape, r, targets, target_parameters)
    return dense + moe_terms.expert_lora_param_count(shape, ranks)


def layer_activation_bytes(
    shape: ModelShape,
    mode: str,
    *,
    batch_size: int,
    seq_len: int,
    dtype_bytes: int = 2,
    lora_r: int = 16,
    target_modules: Iterable[str] | None = None,
    lora_dropout: float = 0.0,
    attention: str = "auto",
    adapter_dtype_bytes: int = 4,
    kv_repeated: bool = False,
    padded: bool = False,
    target_parameters: Any = None,
    grouped_mm: bool | None = None,
) -> int:
    """Bytes one decoder layer keeps on the GPU for backward in ``mode`` (see module docstring).

    ``lora_r`` sizes the rank-space inputs ``s x A^T`` the fused kernels save (:func:`saved_low_rank_bytes`);
    with ``lora_dropout > 0`` PEFT's adapters save ``x A^T`` instead, and their inputs in the adapters' dtype
    (``adapter_dtype_bytes``: 4 for PEFT's fp32 adapters). ``kv_repeated``: SDPA is handed K/V repeated
    to every query head and saves them (:mod:`notebookkit.memory.grouped_kv`: a padded batch on CUDA, a T4).
    ``padded``: the batch has a padding mask, which SDPA keeps as an additive ``[B, 1, T, T]`` mask.
    ``target_parameters``: a mixture of experts' stacked weights adapted by name (:func:`.moe.expert_lora_ranks`).
    ``grouped_mm``: a mixture of experts' experts run on ``grouped_mm`` (True), on the Triton kernels (False), or
    either, the larger of the two paths' terms counted (None: a bf16 step, :func:`.moe.grouped_mm_possible`; an
    fp16 step, a T4's, never runs on ``grouped_mm``).
    """
    N = batch_size * seq_len
    s = dtype_bytes
    H, I, dq, dk = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim
    if mode in OFFLOADING:
        return 0
    if mode == "recompute":
        return N * H * s
    if mode != "keep":
        raise ValueError(f"unknown mode {mode!r}")
    targets = lora_targets(target_modules)
    if shape.num_experts:  # the attention and norms, then the sparse block (notebookkit.memory.moe)
        ranks = moe_terms.expert_lora_ranks(shape, lora_r, targets, target_parameters)
        block = moe_terms.sparse_block_saved_bytes(shape, tokens=N, s=s, ranks=ranks, adapter_bytes=adapter_dtype_bytes,
                                                   grouped=grouped_mm)
        body = layer_activation_bytes(
            moe_terms.dense_part(shape), "keep", batch_size=batch_size, seq_len=seq_len, dtype_bytes=s,
            lora_r=lora_r, target_modules=[t for t in targets if t in shape.projection_shapes()],
            lora_dropout=lora_dropout, attention=attention, adapter_dtype_bytes=adapter_dtype_bytes,
            kv_repeated=kv_repeated, padded=padded)
        return body + sum(block.values())
    sinks = shape.attention_sinks
    eager = not sinks and resolve_attention(shape, attention) == "eager"
    elems = 4 * H + 2 * dq + 2 * dk + 2 * I
    fp32 = 2  # 1/rms of the two pre-norms
    if shape.qk_norm:
        elems += dq + dk
        fp32 += shape.num_heads + shape.num_kv_heads
    if shape.sandwich_norms:
        elems += 2 * H
        fp32 += 2
    total = 0
    if eager or (kv_repeated and not sinks):
        elems += 2 * (dq - dk)  # K, V repeated to every query head
    if eager:
        total += batch_size * shape.num_heads * seq_len * seq_len * (2 * s + 4) + batch_size * seq_len * seq_len
    else:
        fp32 += shape.num_heads  # log-sum-exp per query head
        # SDPA turns the boolean padding mask into an additive one in the compute dtype, and keeps it; the
        # attention with sinks saves boolean masks the layers share (shared_mask_bytes)
        if padded and not sinks:
            total += batch_size * seq_len * seq_len * s
    total += N * (elems * s + fp32 * 4)
    if not (lora_dropout and lora_dropout > 0):  # the fused kernels, with the rank-space inputs they save
        return total + saved_low_rank_bytes(N, lora_r, s, targets)
    # LoRA dropout: the targeted groups run PEFT's code (module docstring)
    dims = shape.projection_shapes()
    a = adapter_dtype_bytes
    total += N * sum(dims[t][0] * (a + 1) + lora_r * a for t in targets)
    normed_inputs = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj"))
    total -= N * H * s * sum(any(t in targets for t in group) for group in normed_inputs)
    if eager and "o_proj" in targets:  # an explicit softmax saves no output: only lora_o kept it
        total -= N * dq * s
    return total


def backward_working_set(
    shape: ModelShape,
    *,
    batch_size: int,
    seq_len: int,
    dtype_bytes: int = 2,
    load_in_4bit: bool = False,
    attention: str = "auto",
    fp8_forward: bool = False,
    load_in_2bit: bool = False,
    load_in_ternary: bool = False,
    lora_r: int = 16,
    target_modules: Iterable[str] | None = None,
    target_parameters: Any = None,
    grouped_mm: bool | None = None,
    expert_chunk_bytes: int | None = None,
) -> dict[str, int]:
    """Transient bytes of one decoder layer's backward on top of the saved activations (``grouped_mm`` as
    :func:`layer_activation_bytes`; ``expert_chunk_bytes`` as :func:`estimate_training_memory`).

    ``{"mlp": ..., "attention": ..., "fp8_forward": ...}``: the high-water marks inside a layer's
    backward (see the module docstring, "Temporaries"). ``attention`` is relative to the MLP
    moment's baseline, with the layer's e and g already freed (it can be negative).
    ``mlp_deferred`` and ``attention_after_deferred``: the same for a recomputed layer whose MLP is
    deferred and runs its backward in tiles of tokens (no e, g saved).
    ``fp8_forward`` is the FP8 copies of the input and weights of one FP8 product during a
    (recomputed) forward: the largest of :func:`fp8_products` (0 without the FP8 forward).
    The base format (``load_in_*``) adds what its GEMMs need beyond their outputs (:mod:`.base_weights`):
    NF4's dense copy of one projection, or 2-bit / ternary's dense chunk (from 256 tokens on) and fresh input
    gradient of a shared-input projection. A mixture of experts (``lora_r`` and ``target_modules`` or
    ``target_parameters`` size its expert adapters): ``"mlp"`` is the sparse block's larger working set
    (forward or backward) with the incoming gradient, ``"attention"`` the attention's less what the block and
    the MLP norm free (:mod:`.moe`).
    """
    fmt = base_format_for(load_in_4bit=load_in_4bit, load_in_2bit=load_in_2bit, load_in_ternary=load_in_ternary)
    N = batch_size * seq_len
    s = dtype_bytes
    if shape.num_experts:
        flags = {fmt.load_flag: True} if fmt.load_flag else {}
        dense = backward_working_set(moe_terms.dense_part(shape), batch_size=batch_size, seq_len=seq_len,
                                     dtype_bytes=s, attention=attention, fp8_forward=fp8_forward, **flags)
        ranks = moe_terms.expert_lora_ranks(shape, lora_r, lora_targets(target_modules), target_parameters)
        block_ws = moe_terms.sparse_block_working_sets(shape, tokens=N, s=s, ranks=ranks,
                                                       nf4=fmt.load_flag == "load_in_4bit", grouped=grouped_mm,
                                                       chunk_bytes=expert_chunk_bytes)
        block_saved = sum(moe_terms.sparse_block_saved_bytes(shape, tokens=N, s=s, ranks=ranks,
                                                             grouped=grouped_mm).values())
        mlp = N * shape.hidden_size * s + max(block_ws.values())
        return {"mlp": mlp, "attention": dense["attention"] - block_saved, "fp8_forward": dense["fp8_forward"]}
    H, I, dq, dk = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim
    dims = shape.projection_shapes()
    dequant = dense_copy_bytes(shape, fmt, s, N) + input_grad_buffer_bytes(shape, fmt, N, s)
    mlp = N * H * s + N * I * s + N * H * s + dequant
    t = min(N, mlp_tile_rows(I, s)) if I else N  # I = 0: the dense part of a mixture of experts
    tiled_input_grad = t * H * s if t < N else 0
    mlp_deferred = 2 * N * H * s + 3 * t * I * s + tiled_input_grad + dense_copy_bytes(shape, fmt, s, t) \
        + input_grad_buffer_bytes(shape, fmt, t, s)
    freed = N * (2 * I + 2 * H) * s + N * 8  # e, g, the MLP norm's input and output, 1/rms
    attn = N * H * s + N * dq * s  # gradient from above, gradient of the attention output
    gqa = 2 * N * dq * s if dk != dq else 0  # K, V (or their gradients) over every query head
    if shape.attention_sinks:  # kernels.attention_sinks: g dO, K/V repeated, the bias and g made again
        attn += N * dq * s + gqa + batch_size * seq_len * seq_len * (s + 1) + N * shape.num_heads * 4
        attn += N * dq * 4 + 3 * N * dq * s + N * shape.num_heads * 4  # the kernel: fp32 dQ, dQ/dK/dV, delta
    elif resolve_attention(shape, attention) == "eager":
        attn += N * (dq + 2 * dq) * s + batch_size * shape.num_heads * seq_len * seq_len * (8 + 2 * s)
    else:
        attn += N * dq * 4 + gqa + N * (dq + 2 * dk) * s + N * shape.num_heads * 4
    attn += dequant
    fp8 = 0
    if fp8_forward:
        # NF4 goes to FP8 in one kernel for whole 64-blocks of <= 16K; any other quantised base through a dense copy
        one_pass = fmt.product == "dequantise" and all(i % 64 == 0 and i <= 16384 for i, _ in dims.values())
        fp8 = max(N * dims[names[0]][0] + sum(dims[n][0] * dims[n][1] for n in names) for names in fp8_products(shape))
        fp8 += 0 if one_pass or not fmt.quantised else max(i * o for i, o in dims.values()) * s
    return {"mlp": mlp, "attention": attn - freed, "fp8_forward": fp8,
            "mlp_deferred": mlp_deferred, "attention_after_deferred": attn - (freed - 2 * N * I * s)}


def estimate_training_memory(
    model_config: Any,
    *,
    load_in_4bit: bool = False,
    dtype: Any = "bfloat16",
    lora_r: int = 16,
    target_modules: Sequence[str] | str | None = None,
    optimizer: str = "adamw",
    batch_size: int = 1,
    seq_len: int = 2048,
    activation_plan: Any = "recompute",
    fused_loss: bool = True,
    loss_chunk_size: int | None = None,
    double_quant: bool = True,
    adapter_dtype: str = "float32",
    lora_dropout: float = 0.0,
    attention: str = "auto",
    fp8_forward: bool = False,
    generation: Any = None,
    method: str = "sft",
    completion_len: int | None = None,
    cuda_context_bytes: int = 400 * 2**20,
    cublas_workspace_bytes: int = DEFAULT_CUBLAS_WORKSPACE_BYTES,
    images_per_row: int = 1,
    image_size: Any = None,
    finetune_vision_layers: bool = True,
    vision_lora_params: int | None = None,
    offload_embedding: bool = False,
    kv_repeated: bool = False,
    padded: bool = False,
    load_in_2bit: bool = False,
    load_in_ternary: bool = False,
    target_parameters: Any = None,
    expert_chunk_bytes: int | None = None,
) -> MemoryEstimate:
    """Estimate peak GPU memory of one LoRA/QLoRA training step, broken down by part.

    Args:
        model_config: a Hugging Face config or model, a config dict, a curated hub name
            (``"meta-llama/Llama-3.1-8B-Instruct"``), a local model folder, or a ``ModelShape``.
        load_in_4bit: NF4 base weights (QLoRA); otherwise the base weights are in ``dtype``.
        load_in_2bit, load_in_ternary: 2-bit groups or ternary (BitNet b1.58) base weights, as
            ``from_pretrained`` takes them; at most one of the three flags (the bytes: module docstring).
        dtype: compute dtype: ``"float16"`` (T4), ``"bfloat16"``, ``"float32"`` (CPU) or a torch dtype.
        lora_r: LoRA rank. ``target_modules``: projections with adapters (default: all seven).
        target_parameters: a mixture of experts' stacked weights adapted by name, as ``get_peft_model`` /
            PEFT's ``LoraConfig`` take them (``["mlp.experts.gate_up_proj", ...]``: each at ``lora_r``), or
            ``{name: rank}`` (``estimate_for_model`` reads PEFT's ranks off the model); given, they replace the
            expert adapters the MLP names of ``target_modules`` would make (:mod:`notebookkit.memory.moe`).
        expert_chunk_bytes: a mixture of experts' budget for one chunk of NF4 experts decoded at a time, which
            grows with the card (:func:`notebookkit.expert_chunks.decode_chunk_bytes` of the card's memory;
            ``estimate_for_model`` takes the model's, the planner that of the budget it plans for); default the
            least, a T4's 128 MiB. The estimate's ``inputs`` name the one it counted.
        optimizer: ``"adamw"`` (any fp32 AdamW), ``"adamw_8bit"`` / ``"paged_adamw_8bit"``, ``"lion"``,
            ``"lion_8bit"``, ``"adafactor"``, ``"sgd"`` (Trainer ``optim`` names work).
        batch_size, seq_len: tokens per micro-batch are ``batch_size * seq_len`` (use the padded
            length, or the packed length with packing).
        activation_plan: ``"keep"`` / ``"recompute"`` / ``"offload"`` for every layer, a per-layer
            list of those, ``True``/``False`` (as ``use_gradient_checkpointing``), or an ``ActivationPlan``.
        fused_loss: chunked fused linear cross-entropy (True) or materialised ``[N, V]`` fp32 logits.
        loss_chunk_size: rows per logits chunk of the fused loss (default: see module docstring).
        double_quant: NF4 with quantised absmax (bitsandbytes ``bnb_4bit_use_double_quant``).
        adapter_dtype: dtype of the LoRA weights (PEFT keeps them in float32 by default).
        lora_dropout: > 0 runs the adapters on PEFT's code, which saves their dropped inputs (module docstring).
        attention: ``"auto"`` (what the fused model runs: an explicit softmax for soft-capped
            attention, Gemma 2, else SDPA), ``"sdpa"``/``"flash"`` (no T^2 storage) or ``"eager"``.
        fp8_forward: the base GEMMs of the forward run in FP8 (``get_peft_model(fp8_base_matmul=True)``):
            their one-byte copies of input and weight join the temporaries.
        generation: generation alongside training (GRPO): ``dict(batch_size=..., max_len=...,
            prompt_len=..., keep_cache=True)`` (rows generated at once, prompt + new tokens, prompt
            length, whether the cache stays allocated through training) or a
            :class:`~notebookkit.memory.generation.GenerationMemory` (kept); adds its KV cache, CUDA
            graph buffers and decode step, and what its prefill needs beyond the training step's
            transients (freed cache: only the generate call's peak beyond those transients), and the cuBLAS
            workspace its capture stream keeps (``cublas_workspace_bytes`` again).
        method: ``"sft"``, ``"dpo"`` / ``"orpo"`` (``batch_size`` counts pairs: ``2 * batch_size``
            rows; DPO adds its reference pass) or ``"grpo"`` (``batch_size`` counts completions; the
            loss over ``completion_len`` positions per row; generation held alongside). Module notes.
        completion_len: GRPO's completion tokens per row (``max_completion_length``); default ``seq_len``.
        cuda_context_bytes: memory the CUDA context and libraries take outside PyTorch's allocator.
        cublas_workspace_bytes: PyTorch's cuBLAS workspace of the training stream, inside its allocator: the
            card's (:attr:`GPUCard.cublas_workspace_bytes`; the planner and ``estimate_for_model`` pass it),
            default that of every card but sm_90 (8.125 MiB).
        images_per_row, image_size, finetune_vision_layers: for a vision-language model (a Qwen2.5-VL /
            Gemma 3 config, model, folder, ``VLMShape`` or curated VLM name): images per row, their
            side in pixels (or ``(h, w)``; default: the processor's, 448 for Qwen2.5-VL) and whether
            the tower has adapters. ``seq_len`` counts the image tokens. The tower's weights, adapters
            and saved activations join the parts (:mod:`notebookkit.memory.vision_estimate`).
        vision_lora_params: the tower's LoRA parameters when only some of its linears are adapted
            (read off a loaded model); default: every attention and MLP linear of the tower and projector.
        offload_embedding: the input embedding table in pinned host memory
            (``from_pretrained(offload_embedding=True)``); nothing moves when it is tied to the LM head.
        kv_repeated: the attention hands SDPA K/V repeated to every query head, which SDPA saves
            (``2*dq`` instead of ``2*dk`` per token in a kept layer): on CUDA when the batch is padded, and
            on a GPU without SDPA's flash kernel for grouped K/V (a T4) or in fp32. The rule, shared with
            the attention: :func:`notebookkit.memory.grouped_kv.sdpa_repeats_kv`.
        padded: the rows are padded to the longest one (a collator's batch; not packed): the attention gets
            a padding mask, and SDPA keeps an additive copy of it per kept layer (``B * T^2`` elements).

    Returns:
        :class:`MemoryEstimate` with ``base_weights``, ``adapters``, ``activations``, ``logits_loss``,
        ``temporaries`` and ``total`` in bytes; ``print()`` it for a table. The formulas are in the
        docstring of :mod:`notebookkit.memory.estimate`.
    """
    from .vision_shapes import is_vlm, vlm_shape

    vlm = vlm_shape(model_config) if is_vlm(model_config) else None
    shape = vlm.text if vlm is not None else model_shape(model_config)
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"notebookkit.memory: batch_size and seq_len must be >= 1 (got {batch_size}, {seq_len}).")
    if method not in METHODS:
        raise ValueError(f"notebookkit.memory: method={method!r}; use one of {list(METHODS)} (the trainer's kind).")
    fmt = base_format_for(load_in_4bit=load_in_4bit, load_in_2bit=load_in_2bit, load_in_ternary=load_in_ternary)
    s = bytes_of_dtype(dtype)
    targets = lora_targets(target_modules)
    plan = normalize_plan(activation_plan, shape.num_layers)
    moe_notes: list[str] = []
    if shape.num_experts:
        plan = _moe_checks(shape, plan, fmt, method, generation, lora_dropout, lora_r, targets, moe_notes,
                           target_parameters)
    opt = _optimizer_name(optimizer)
    attention = resolve_attention(shape, attention)
    record = TRAINING_METHODS[method]
    rows = record.rows_per_example * batch_size
    scored = _scored_len(record.completion_loss, seq_len, completion_len)
    if record.generates and generation is None:
        generation = dict(batch_size=batch_size, max_len=seq_len, prompt_len=max(1, seq_len - scored),
                          keep_cache=keeps_cache_between_steps(plan))

    base = _base_weights(shape, s, fmt, double_quant)
    host_embedding_bytes = _move_embedding_to_host(base, shape, s) if offload_embedding else 0
    adapters, p_lora = _adapters_and_optimizer(shape, s, lora_r, targets, opt, adapter_dtype, target_parameters)
    acts = _activations(shape, plan, batch_size=rows, seq_len=seq_len, dtype_bytes=s, lora_r=lora_r,
                        target_modules=targets, lora_dropout=lora_dropout, attention=attention,
                        adapter_dtype_bytes=bytes_of_dtype(adapter_dtype), kv_repeated=kv_repeated, padded=padded,
                        target_parameters=target_parameters, grouped_mm=_grouped_mm_flag(dtype))
    vision_inputs: dict[str, Any] = {}
    if vlm is not None:
        vision_inputs = _add_vision(vlm, base, adapters, acts, plan, rows=rows, seq_len=seq_len, s=s,
                                    fmt=fmt, double_quant=double_quant, lora_r=lora_r, opt=opt,
                                    adapter_dtype=adapter_dtype, images_per_row=images_per_row,
                                    image_size=image_size, vision_lora=finetune_vision_layers,
                                    vision_lora_params=vision_lora_params)
    loss = _logits_and_loss(shape, rows * scored, s, fused_loss, loss_chunk_size, logprobs=record.logprob_loss)
    if shape.num_experts and method == "sft":  # TRL's default router loss, on the fused path (notes)
        router = moe_terms.router_loss_bytes(shape, tokens=rows * seq_len, s=s)
        loss = _Part(loss.bytes + router, {**loss.details, "logits / loss: router logits and their fp32 "
                                                           "softmax (load-balancing loss)": router}, loss.notes)
    working_set = backward_working_set(shape, batch_size=rows, seq_len=seq_len, dtype_bytes=s,
                                       lora_r=lora_r, target_modules=targets, target_parameters=target_parameters,
                                       attention=attention, fp8_forward=fp8_forward, grouped_mm=_grouped_mm_flag(dtype),
                                       expert_chunk_bytes=expert_chunk_bytes,
                                       **({fmt.load_flag: True} if fmt.load_flag else {}))
    reference = (_reference_pass(shape, rows, seq_len, s, fmt, attention, expert_chunk_bytes)
                 if record.reference_pass else _Part(0))
    temporaries = _temporaries(plan, acts, loss.bytes, working_set, cuda_context_bytes, cublas_workspace_bytes,
                               reference.bytes)
    gen_bytes, gen_details = 0, {}
    if generation is not None:
        transients = acts.bytes + loss.bytes + temporaries.bytes - cuda_context_bytes - cublas_workspace_bytes
        gen_bytes, gen_details = generation_term(generation, shape, s, fmt, attention, transients,
                                                 expert_chunk_bytes, cublas_workspace_bytes)

    notes = list(loss.notes) + moe_notes
    if lora_dropout and lora_dropout > 0:
        notes.append("lora_dropout > 0 stores a dropped copy of every adapter input and leaves the fused path")
    if opt.startswith("paged"):
        notes.append("paged optimizer states can move to host memory under pressure; counted on the GPU here")
    details = {**base.details, **adapters.details, **acts.details, **loss.details, **temporaries.details,
               **gen_details}
    total = base.bytes + adapters.bytes + acts.bytes + loss.bytes + temporaries.bytes + gen_bytes
    inputs = dict(
        load_in_4bit=bool(load_in_4bit), load_in_2bit=bool(load_in_2bit), load_in_ternary=bool(load_in_ternary),
        base_format=fmt.name, dtype=str(dtype).replace("torch.", ""), lora_r=lora_r,
        target_modules=targets, target_parameters=target_parameters, optimizer=opt, batch_size=batch_size,
        seq_len=seq_len,
        fused_loss=fused_loss, double_quant=double_quant, adapter_dtype=adapter_dtype,
        cublas_workspace_bytes=int(cublas_workspace_bytes),
        lora_dropout=lora_dropout, attention=attention, lora_params=p_lora, fp8_forward=bool(fp8_forward),
        offload_embedding=bool(host_embedding_bytes), kv_repeated=bool(kv_repeated), padded=bool(padded),
        generation=getattr(generation, "inputs", generation), method=method, rows=rows, scored_len=scored,
        **vision_inputs,
    )
    if shape.num_experts:
        inputs["expert_chunk_bytes"] = expert_chunk_bytes or DECODE_CHUNK_BYTES
    return MemoryEstimate(
        base_weights=int(base.bytes), adapters=int(adapters.bytes), activations=int(acts.bytes),
        logits_loss=int(loss.bytes), temporaries=int(temporaries.bytes), total=int(total),
        cuda_context=int(cuda_context_bytes), cublas_workspace=int(cublas_workspace_bytes),
        host_offload=int(acts.host_offload + host_embedding_bytes),
        generation=int(gen_bytes),
        per_layer_activations=acts.per_layer, plan=plan, details={k: int(v) for k, v in details.items()},
        inputs=inputs, notes=notes, shape=shape,
    )


# The steps of estimate_training_memory, one part of the total each (formulas: module docstring).


@dataclass
class _Part:
    """One part of the estimate: its bytes and their breakdown (``details`` keys start with the part's name)."""

    bytes: float
    details: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class _Activations(_Part):
    """The activations part, with what the later steps need: per-layer bytes, one kept layer, host bytes."""

    per_layer: tuple[int, ...] = ()
    keep_layer: int = 0
    layer_input: int = 0
    host_offload: int = 0
    in_flight: int = 0  # offloaded inputs and a parked gate/up tile, in the backward of the offloaded layers
    recomputed_layer: int = 0  # what a recomputed layer saves again in the backward (keep_layer less a deferred MLP's e, g)
    mlp_deferred: bool = False


def _optimizer_name(optimizer: str) -> str:
    opt = str(optimizer).lower()
    if opt not in _OPT_STATE_BYTES and opt != "adafactor":
        raise ValueError(
            f"notebookkit.memory: unknown optimizer {optimizer!r}; use one of "
            f"{sorted(_OPT_STATE_BYTES) + ['adafactor']}."
        )
    return opt


def _base_weights(shape: ModelShape, s: int, fmt: BaseFormat, double_quant: bool) -> _Part:
    """Decoder projections in the base format (the record's bytes per weight), embeddings, LM head and norms."""
    L, H = shape.num_layers, shape.hidden_size
    p_small = shape.embedding_params + shape.lm_head_params + L * shape.norm_params_per_layer + H
    small_bytes = p_small * s
    lin_bytes = projection_weight_bytes(shape, fmt, s, double_quant)
    lin_key = "base weights: decoder projections" + (f" ({fmt.label.split()[0]})" if fmt.quantised else "")
    if shape.num_experts:
        lin_key = lin_key.replace("decoder projections", "attention projections")
    details = {lin_key: lin_bytes, "base weights: embeddings, LM head, norms": small_bytes}
    details.update(moe_terms.expert_weight_bytes(shape, s, nf4=fmt.name == "nf4") if shape.num_experts else {})
    return _Part(sum(details.values()), details)


def _moe_checks(shape: ModelShape, plan: tuple[str, ...], fmt: BaseFormat, method: str, generation: Any,
                lora_dropout: float, lora_r: int, targets: list[str], notes: list[str],
                target_parameters: Any = None) -> tuple[str, ...]:
    """Refuse what the memory model (or notebookkit) does not cover for a mixture of experts, with what to
    do instead; the plan as it runs (offloaded layers recompute); a note on the experts."""
    what = f"notebookkit.memory: {shape.name} is a mixture of experts"
    if fmt.quantised and fmt.load_flag != "load_in_4bit":
        raise ValueError(f"{what}: {fmt.label} bases do not hold its stacked experts (from_pretrained refuses "
                         "them too); estimate it with load_in_4bit=True or in 16-bit.")
    record = TRAINING_METHODS[method]
    if method == "sft":
        notes.append("SFT on a mixture of experts: TRL turns the router load-balancing loss on by default (the "
                     "config's router_aux_loss_coef); notebookkit's fused loss adds it in the model's head, and the "
                     "routers' logits and fp32 softmax it holds are counted")
    else:
        notes.append(f"{record.label} on a mixture of experts: the estimate is notebookkit's fused loss path, which "
                     "its trainers leave for TRL's own LM head when TRL's router load-balancing loss is on (TRL's "
                     "default for this family: the config's router_aux_loss_coef); set "
                     f"{record.label}Config(router_aux_loss_coef=0.0) to train as estimated")
    if lora_dropout and lora_dropout > 0:
        raise ValueError(f"{what}: with lora_dropout={lora_dropout} PEFT refuses the experts' adapters (no dropout on "
                         "target_parameters) and the memory model has no formula for it; use lora_dropout=0.")
    if any(m in OFFLOADING for m in plan):
        plan = tuple("recompute" if m in OFFLOADING else m for m in plan)
        notes.append("a mixture of experts recomputes its offloaded layers (offloading them is not written yet): "
                     "counted as recompute")
    ranks = moe_terms.expert_lora_ranks(shape, lora_r, targets, target_parameters)
    notes.append(moe_terms.describe(shape, ranks, nf4=fmt.name == "nf4"))
    return plan


def _move_embedding_to_host(base: _Part, shape: ModelShape, s: int) -> int:
    """Take an untied input embedding's ``V * H * s`` bytes out of ``base`` (in place); the pinned host
    bytes it then takes (0 when it is tied to the LM head, which needs it on the GPU)."""
    if shape.tie_word_embeddings:
        return 0
    moved = shape.embedding_params * s
    key = "base weights: embeddings, LM head, norms"
    base.details[key] -= moved
    base.bytes -= moved
    return 1 << (moved - 1).bit_length()  # pinned blocks are rounded up to a power of two


def _add_vision(vlm: Any, base: _Part, adapters: _Part, acts: _Activations, plan: tuple[str, ...], *, rows: int,
                seq_len: int, s: int, fmt: BaseFormat, double_quant: bool, lora_r: int, opt: str,
                adapter_dtype: str, images_per_row: int, image_size: Any, vision_lora: bool,
                vision_lora_params: int | None = None) -> dict[str, Any]:
    """Add the vision tower's weights, adapters and saved activations to the parts (in place);
    the inputs to record (:mod:`.vision_estimate`)."""
    from . import vision_estimate as ve

    size = ve.default_image_size(vlm, image_size)
    images = ve.vision_images(rows, images_per_row)
    tokens = ve.check_image_tokens(vlm, seq_len, images_per_row, size) if images_per_row else 0
    for key, value in ve.vision_weight_bytes(vlm, s, fmt, double_quant).items():
        base.details[key] = value
        base.bytes += value
    every_linear = ve.vision_lora_param_count(vlm, lora_r)
    p_vision = (every_linear if vision_lora_params is None else int(vision_lora_params)) if vision_lora else 0
    if p_vision:
        a_bytes = bytes_of_dtype(adapter_dtype)
        if opt == "adafactor":  # factored second moment: rows + columns per matrix, ~ (r + in + out + r) each
            v = vlm.vision
            mats = [*[(i, o) for i, o in v.block_linear_shapes().values()] * v.num_layers,
                    *v.projector_linear_shapes().values()]
            opt_b = sum(4 * ((lora_r + i) + (o + lora_r)) for i, o in mats) * p_vision / every_linear
        else:
            opt_b = p_vision * _OPT_STATE_BYTES[opt]
        per = 2 * a_bytes + (4 if a_bytes < 4 else 0) + (s if a_bytes != s else 0)
        value = int(p_vision * per + opt_b)
        adapters.details["adapters + optimizer: vision tower LoRA (weights, grads, optimizer)"] = value
        adapters.bytes += value
    checkpointed = any(m != "keep" for m in plan)
    saved = ve.vision_activation_bytes(vlm, images=images, image_size=size, s=s,
                                       vision_lora=vision_lora, checkpointed=checkpointed, lora_r=lora_r)
    if images:
        saved.update(ve.decoder_mask_bytes(vlm, rows=rows, seq_len=seq_len, s=s, any_kept="keep" in plan))
    for key, value in saved.items():
        acts.details[key] = value
        acts.bytes += value
    return dict(vision=True, model_params=vlm.num_params, images_per_row=images_per_row, image_size=size, image_tokens_per_row=tokens,
                finetune_vision_layers=bool(vision_lora), vision_lora_params=p_vision)


def _adapters_and_optimizer(
    shape: ModelShape, s: int, lora_r: int, targets: list[str], opt: str, adapter_dtype: str,
    target_parameters: Any = None,
) -> tuple[_Part, int]:
    """LoRA weights, gradients, fp32 master copy, optimizer states and compute-dtype copies; and the
    number of LoRA parameters."""
    p_lora = lora_param_count(shape, lora_r, targets, target_parameters)
    a_bytes = bytes_of_dtype(adapter_dtype)
    params_b = p_lora * a_bytes
    grads_b = p_lora * a_bytes
    master_b = p_lora * 4 if a_bytes < 4 else 0
    dims = shape.projection_shapes()
    ranks = moe_terms.expert_lora_ranks(shape, lora_r, targets, target_parameters)
    if opt == "adafactor":
        opt_b = shape.num_layers * sum(4 * ((lora_r + dims[t][0]) + (dims[t][1] + lora_r)) for t in targets if t in dims)
        opt_b += moe_terms.expert_adafactor_bytes(shape, ranks)
    else:
        opt_b = int(p_lora * _OPT_STATE_BYTES[opt])
    details = {"adapters + optimizer: LoRA weights": params_b, "adapters + optimizer: gradients": grads_b}
    if master_b:
        details["adapters + optimizer: fp32 master copy"] = master_b
    details["adapters + optimizer: optimizer states"] = opt_b
    # The fused kernels cast adapters kept in another dtype (PEFT's fp32 under 16-bit compute) once per
    # forward pass and keep the casts for the recompute and the backward (lora_fast_path.views); the
    # A of grouped projections (q/k/v, gate/up) go into one A_cat per group instead, of the same size.
    # Adapters already in the compute dtype are not copied, except into those A_cat.
    # A mixture of experts: the expert adapters' casts are made by each layer's forward and saved with its
    # activations (notebookkit.memory.moe).
    p_copied = p_lora - moe_terms.expert_lora_param_count(shape, ranks)
    if a_bytes != s:
        casts_b = p_copied * s
    elif p_copied:
        casts_b = grouped_lora_A_params(shape, lora_r, targets) * s
    else:
        casts_b = 0
    if casts_b:
        details["adapters + optimizer: compute-dtype copies"] = casts_b
    return _Part(params_b + grads_b + master_b + opt_b + casts_b, details), p_lora


def _activations(shape: ModelShape, plan: tuple[str, ...], **layer_kw: Any) -> _Activations:
    """What the layers keep for backward by mode, the last offloaded layer's input on the GPU, and the
    offloaded inputs in flight."""
    X = layer_kw["batch_size"] * layer_kw["seq_len"] * shape.hidden_size * layer_kw["dtype_bytes"]
    by_mode = {m: layer_activation_bytes(shape, m, **layer_kw) for m in {"keep", *plan}}  # same for every layer
    keep_layer = by_mode["keep"]
    per_layer = [by_mode[m] for m in plan]
    last_offloaded = bool(plan) and plan[-1] in OFFLOADING
    if last_offloaded:
        per_layer[-1] = X  # the last layer's input is needed first in backward: it stays on the GPU
    counts = {m: plan.count(m) for m in MODES}
    details = {"activations: saved by kept layers": counts["keep"] * keep_layer}
    shared = shared_mask_bytes(shape, plan, layer_kw["batch_size"], layer_kw["seq_len"], layer_kw["dtype_bytes"])
    details.update(shared)
    if counts["recompute"]:
        details["activations: inputs of recomputed layers"] = counts["recompute"] * X
    if last_offloaded:
        details["activations: input of the last (offloaded) layer"] = X
    offloaded = counts["offload"] + counts["offload_mlp"]
    deferred = mlp_deferred(shape, layer_kw.get("lora_dropout", 0.0))
    N = layer_kw["batch_size"] * layer_kw["seq_len"]
    # a deferred MLP saves neither e, g nor gate/up's rank-space inputs: its backward makes them a tile at a time
    gate_up_low_rank = saved_low_rank_bytes(N, layer_kw.get("lora_r", 16), layer_kw["dtype_bytes"],
                                            lora_targets(layer_kw.get("target_modules")), ("gate_proj", "up_proj"))
    recomputed = keep_layer - (2 * N * shape.intermediate_size * layer_kw["dtype_bytes"] + gate_up_low_rank
                               if deferred else 0)
    parked_layers = counts["offload_mlp"] - (plan[-1] == "offload_mlp") if deferred else 0
    parked_host, tile, tiles = parked_mlp_bytes(shape, N, layer_kw["dtype_bytes"]) if parked_layers > 0 else (0, 0, 1)
    # Not saved activations: they join the peak of the backward's phase only (_temporaries), and the end of the
    # forward's while its copies to the host may still run.
    in_flight = in_flight_bytes(plan, X, tile, tiles)
    total = sum(per_layer) + sum(shared.values())
    return _Activations(total, details, per_layer=tuple(per_layer), keep_layer=keep_layer, layer_input=X,
                        host_offload=offloaded * X + max(parked_layers, 0) * parked_host,
                        recomputed_layer=recomputed, mlp_deferred=deferred, in_flight=in_flight)


def shared_mask_bytes(shape: ModelShape, plan: tuple[str, ...], batch_size: int, seq_len: int,
                      dtype_bytes: int) -> dict[str, int]:
    """The attention masks a training step holds for all its layers at once (gpt-oss; none for the other
    families): the attention with sinks saves a boolean ``[B, 1, T, T]`` mask, made once per forward for each
    mask Hugging Face hands its layers (``forward_state.ForwardPass.boolean_mask``: one for the full layers, one
    for the sliding-window ones); and where a layer is recomputed, its checkpoint holds Hugging Face's own
    masks (eager attention's, in the compute dtype) until the backward."""
    if not shape.attention_sinks:
        return {}
    masks = SINKS_MASK_KINDS * batch_size * seq_len * seq_len
    out = {"activations: boolean attention masks, one of each kind for every layer": masks}
    if any(m != "keep" for m in plan):
        out["activations: Hugging Face's attention masks, held by the checkpoints"] = masks * dtype_bytes
    return out


def parked_mlp_bytes(shape: ModelShape, tokens: int, dtype_bytes: int) -> tuple[int, int, int]:
    """``(host bytes of one layer, device bytes of one tile, tiles a layer)`` of an ``"offload_mlp"`` layer's
    parked gate/up outputs (``models.patching.checkpointing``): ``e, g`` of every token, ``2 N I s``, in pinned
    host memory, brought back a ``[rows, 2 I]`` tile at a time (``rows = min(N, mlp_tile_rows)``)."""
    I, s = shape.intermediate_size, dtype_bytes
    rows = min(tokens, mlp_tile_rows(I, s))
    return 2 * tokens * I * s, 2 * rows * I * s, -(-tokens // rows)


def in_flight_bytes(plan: Sequence[str], layer_input: int, tile: int, tiles: int) -> int:
    """Device bytes the offloaded layers' copies add in the backward, beyond what is saved, at their largest.

    A layer whose input went to the host (every offloaded layer but the last one, whose input stays on the
    GPU: ``models.patching.checkpointing``) fetches it back in its backward and prefetches the previous such
    layer's input, with that layer's first parked ``[rows, 2 I]`` tile (``tile`` bytes; 0 where the MLPs are
    not deferred, so nothing is parked); a parked layer of several ``tiles`` also prefetches its own next tile.
    By then the last layer's input, when it stayed on the GPU, is freed: one input less. The last layer's own
    backward prefetches nothing. So a plan with one layer on the host has no previous layer to prefetch (session
    47: the 8B shape with 2 layers at 16,384 tokens was predicted 0.70 GiB over the measured peak, one input and
    one tile too many)."""
    last = len(plan) - 1
    on_host = [i for i, mode in enumerate(plan) if mode in OFFLOADING and i != last]
    most = 0
    for before, layer in zip([None] + on_host, on_host):
        inputs = 1 + (before is not None)
        parked_tiles = (before is not None and plan[before] == "offload_mlp") + (
            plan[layer] == "offload_mlp" and tiles > 1)
        most = max(most, inputs * layer_input + parked_tiles * tile)
    freed = layer_input if plan and plan[last] in OFFLOADING else 0
    return max(0, most - freed)


def mlp_deferred(shape: ModelShape, lora_dropout: float = 0.0) -> bool:
    """Whether a recomputed layer defers its MLP to the backward (module docstring, "Temporaries"): its
    output only enters the residual sum (no post-MLP norm) and it runs the fused dense kernel (no LoRA
    dropout; a mixture of experts' sparse block recomputes whole, :mod:`.moe`)."""
    return not shape.sandwich_norms and not shape.num_experts and not (lora_dropout and lora_dropout > 0)


def _logits_and_loss(shape: ModelShape, tokens: int, s: int, fused_loss: bool, loss_chunk_size: int | None,
                     logprobs: bool = False) -> _Part:
    """The fused linear cross-entropy's buffers and one logits chunk (or, ``logprobs``, the chunked per-token
    log-prob op's, with an fp32 entropy per row), or the materialised ``[N, V]`` logits."""
    N, H, V = tokens, shape.hidden_size, shape.vocab_size
    X = N * H * s
    if fused_loss:
        chunk = loss_chunk_size or default_loss_chunk(N, H, V, s)
        chunk = min(chunk, N)
        hidden_b = 3 * X + (20 if logprobs else 16) * N
        chunk_b = chunk * V * s
        what = "per-token log-probs" if logprobs else "logits chunk"
        return _Part(hidden_b + chunk_b, {"logits / loss: final norm, hidden grad": hidden_b,
                                          f"logits / loss: {what} ({chunk} rows)": chunk_b})
    logits_loss = 2 * X + N * V * (s + 3 * 4)
    notes = ["the materialised logits are large; fused_loss=True computes the loss in chunks"] if N * V * 4 > 2 * GiB else []
    return _Part(logits_loss, {"logits / loss: materialised [N, V] logits (16-bit + fp32)": logits_loss}, notes)


def _scored_len(completion_loss: bool, seq_len: int, completion_len: int | None) -> int:
    """Positions per row that reach the LM head: all but the prompt of a completion-only loss (GRPO's
    ``logits_to_keep``)."""
    if completion_len is None or not completion_loss:
        return seq_len
    if not 1 <= completion_len <= seq_len:
        raise ValueError(f"notebookkit.memory: completion_len must be between 1 and seq_len={seq_len} (prompt + "
                         f"completion), got {completion_len}.")
    return int(completion_len)


def _reference_pass(shape: ModelShape, rows: int, seq_len: int, s: int, fmt: BaseFormat, attention: str,
                    expert_chunk_bytes: int | None = None) -> _Part:
    """DPO's reference forward (no gradient) on top of the saved policy activations: one decoder layer's
    no-grad working set for ``rows * seq_len`` tokens (a mixture of experts' sparse block as generation runs
    it: :func:`~notebookkit.memory.moe.sparse_block_generation_bytes`)."""
    return _Part(layer_working_set(shape, rows, seq_len, seq_len, s, fmt, attention, training_path=True,
                                   expert_chunk_bytes=expert_chunk_bytes))


def _temporaries(
    plan: tuple[str, ...], acts: _Activations, logits_loss: float, working_set: dict[str, int], cuda_context_bytes: int,
    cublas_workspace_bytes: int, forward_extra: float = 0,
) -> _Part:
    """The backward's working set beyond the (by then freed) loss buffers, the cuBLAS workspace and the CUDA
    context.

    Two candidate high-water marks (beyond weights and adapters). The backward runs from the last
    layer down, so kept layers *after* the last recomputed/offloaded one have freed their
    activations before the first recompute starts.

    * end of forward / kept layers' backward: everything saved + the loss buffers, or the last
      layer's backward working set once the loss buffers are freed (when that layer is kept);
    * first recompute: what is still saved + the recomputed layer's activations + working set + the
      offloaded inputs and parked gate/up tiles in flight (``acts.in_flight``).

    The buffers in flight join the first mark only while the forward's copies to the host may still
    run: when fewer than two layers follow the last offloaded one (two layers' forwards, kept or
    recomputed, outlast the copy of one layer's input and parked outputs). Until session 32 they always
    did, and the T4 plan that keeps its last 16 layers was predicted 0.28 GiB higher for them (0.37 GiB
    above the measured peak; 0.08 GiB now); until session 48 only kept layers counted, and the 8B plan
    at 65,536 tokens that recomputes 10 layers after its 21 offloaded ones was predicted 1.07 GiB over
    its measured peak (+5.2%; now +0.3%).
    """
    ws_max = max(working_set["mlp"], working_set["attention"], working_set["fp8_forward"])
    ws_recompute = max(working_set["mlp_deferred"], working_set["attention_after_deferred"],
                       working_set["fp8_forward"]) if acts.mlp_deferred else ws_max
    activations, keep_layer = acts.bytes, acts.keep_layer
    policy_end = activations + max(logits_loss, ws_max if plan and plan[-1] == "keep" else 0)
    reference_end = activations + logits_loss + forward_extra
    end_of_forward = max(policy_end, reference_end)
    non_kept = [i for i, m in enumerate(plan) if m != "keep"]
    to_host = [i for i, m in enumerate(plan) if m in OFFLOADING]
    in_flight = acts.in_flight
    if non_kept:
        kept_after = len(plan) - 1 - non_kept[-1]
        first_recompute = (activations - kept_after * keep_layer + (acts.recomputed_layer - acts.layer_input)
                           + ws_recompute + in_flight)
        if to_host and len(plan) - 1 - to_host[-1] < LAYERS_AFTER_COPIES:  # the last copies may still run
            end_of_forward += in_flight
    else:
        first_recompute = 0
    over = max(end_of_forward, first_recompute) - activations - logits_loss
    details = {}
    if over:
        peak_in_reference = forward_extra and reference_end > policy_end and reference_end >= first_recompute
        details["temporaries: " + ("DPO reference pass (no grad) beyond the loss buffers" if peak_in_reference
                                   else "backward working set beyond the loss buffers")] = over
    details["temporaries: cuBLAS workspace (the training stream's)"] = cublas_workspace_bytes
    details["temporaries: CUDA context"] = cuda_context_bytes
    return _Part(over + cublas_workspace_bytes + cuda_context_bytes, details)
