"""Generation's memory: the KV cache against real static caches, the graph buffers against the sampling
tensors, hand-computed sizes, and the training estimate and planner holding training + generation."""

from __future__ import annotations

import inspect

import pytest
import torch

from notebookkit.memory import (
    DoesNotFitError,
    GenerationMemory,
    estimate_training_memory,
    generation_bytes,
    generation_memory,
    kv_cache_bytes,
    model_shape,
    plan_activations,
)
from notebookkit.memory.generation import GRAPH_INTS_PER_ROW, SAMPLING_BYTES_PER_LOGIT, graph_buffer_bytes
from notebookkit.memory.planner import DEFAULT_SAFETY_MARGIN

from ..models.helpers import FAMILIES, random_model

GiB = 2**30
USABLE = 1.0 - DEFAULT_SAFETY_MARGIN
# H=64, L=2, 4 query heads / 2 kv heads of 16, I=128, V=256 (as tests/memory/test_estimate.py).
TINY = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=256,
            tie_word_embeddings=True)
KW = dict(dtype="bfloat16", lora_r=4, optimizer="adamw", batch_size=2, seq_len=32, cuda_context_bytes=0,
          cublas_workspace_bytes=0)
LLAMA8B = "meta-llama/Llama-3.1-8B-Instruct"
QLORA = dict(load_in_4bit=True, dtype="float16", batch_size=2, seq_len=4096, host_memory_bytes=64 * GiB)


def test_tiny_config_matches_hand_computed_sizes():
    g = generation_memory(model_shape(TINY), 3, 40, 2, prompt_len=24)
    # KV cache: 2 layers * (K, V) * 3 rows * 2 kv heads * 40 slots * 16 * 2 bytes.
    assert g.kv_cache == kv_cache_bytes(model_shape(TINY), 3, 40, 2) == 2 * 2 * 3 * 2 * 40 * 16 * 2 == 30720
    # Buffers per row: V * (4 fp32 logits + 1 seen + 4 fp32 uniforms) + H * 2 hidden + (40 slot ids + 8) * 8.
    assert g.graph_buffers == 3 * (256 * 9 + 64 * 2 + (40 + GRAPH_INTS_PER_ROW) * 8) == 8448
    # Decode (3 tokens over 40 slots): attention 3 * 2 * (2H + 2(dq + 2dk) + dq) = 2688 + mask 3*40*2 = 2928,
    # MLP 3 * 2 * (2H + 3I) = 3072; the LM head's bf16 logits and the sampling temporaries are more.
    assert g.decode_step == 3 * 256 * (2 + SAMPLING_BYTES_PER_LOGIT)
    # Prefill (72 tokens over 40 slots): attention 72 * 2 * 448 = 64512 + mask 3*24*40*2 = 5760 + K, V
    # repeated to 4 heads 2*3*4*40*16*2 = 30720 -> 100992 > MLP 72 * 2 * 512 = 73728; + logits 3*256*2.
    assert g.prefill == 100992 + 1536
    assert g.held == 30720 + 8448 + g.decode_step and g.total == g.held + g.prefill
    assert generation_bytes(model_shape(TINY), 3, 40, 2, prompt_len=24) == g.total


def test_nf4_and_soft_capped_attention_add_their_working_sets():
    shape = model_shape(TINY)
    plain = generation_memory(shape, 3, 40, 2, prompt_len=24)
    nf4 = generation_memory(shape, 3, 40, 2, prompt_len=24, load_in_4bit=True)
    assert nf4.prefill - plain.prefill == 64 * 128 * 2  # the largest projection, dequantised
    eager = generation_memory(shape, 3, 40, 2, prompt_len=24, attention="eager")
    assert eager.prefill - plain.prefill == 3 * 4 * 24 * 40 * (2 * 2 + 4)  # explicit scores of 4 heads
    gemma2 = model_shape("google/gemma-2-2b-it")
    assert generation_memory(gemma2, 1, 4096).prefill > generation_memory(gemma2, 1, 4096, attention="sdpa").prefill
    assert plain.kv_cache == nf4.kv_cache == eager.kv_cache


def test_default_prompt_is_the_whole_cache_and_bad_lengths_are_explained():
    shape = model_shape(TINY)
    assert generation_memory(shape, 2, 40).prefill == generation_memory(shape, 2, 40, prompt_len=40).prefill
    assert generation_memory(shape, 2, 40, prompt_len=8).prefill < generation_memory(shape, 2, 40).prefill
    with pytest.raises(ValueError, match="prompt_len must be between 1 and max_len=40"):
        generation_memory(shape, 2, 40, prompt_len=41)
    with pytest.raises(ValueError, match="batch_size >= 1 and max_len >= 1"):
        generation_memory(shape, 0, 40)


def _hf_static_cache_bytes(model, batch: int, max_len: int, prompt: int) -> tuple[int, list[tuple[int, ...]]]:
    """Bytes of the keys and values of Hugging Face's StaticCache after a prefill on the CPU."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_len)
    ids = torch.randint(3, 250, (batch, prompt), generator=torch.Generator().manual_seed(0))
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{name: cache})
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return sum(t.numel() * t.element_size() for t in tensors), [tuple(layer.keys.shape) for layer in cache.layers]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_formula_equals_hugging_faces_static_cache(family, dtype):
    """Windows longer than the cache: every layer of HF's StaticCache is full length, as ours."""
    batch, max_len = 3, 37
    model = random_model(family, sliding_window=4096).to(dtype)
    got, shapes = _hf_static_cache_bytes(model, batch, max_len, prompt=11)
    shape = model_shape(model.config)
    assert all(s[0] == batch and s[2] == max_len for s in shapes)
    assert kv_cache_bytes(shape, batch, max_len, dtype.itemsize) == got
    assert generation_memory(shape, batch, max_len, dtype.itemsize).kv_cache == got


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_kv_cache_formula_is_an_upper_bound_where_hf_caps_sliding_layers(family):
    """HF's StaticCache keeps only the window (8 slots here) on sliding layers; the fast path's cache is
    full length on every layer, so the formula counts more than HF here, by exactly the capped slots."""
    batch, max_len = 3, 37
    model = random_model(family)
    got, shapes = _hf_static_cache_bytes(model, batch, max_len, prompt=11)
    shape = model_shape(model.config)
    capped = sum(max_len - s[2] for s in shapes)
    assert capped > 0
    per_slot = 2 * batch * shape.num_kv_heads * shape.head_dim * 4
    assert kv_cache_bytes(shape, batch, max_len, 4) == got + capped * per_slot


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_kv_cache_formula_equals_notebookkits_static_cache(family):
    """Against the fast path's own cache (notebookkit.models.generation.static_cache)."""
    from notebookkit.models.generation.static_cache import StaticKVCache

    shape = model_shape(random_model(family).config)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cache = StaticKVCache(n_layers=shape.num_layers, batch=3, kv_heads=shape.num_kv_heads,
                              head_dim=shape.head_dim, capacity=37, dtype=dtype, device="cpu")
        tensors = [*cache.keys, *cache.values]
        assert sum(t.numel() * t.element_size() for t in tensors) == kv_cache_bytes(shape, 3, 37, dtype.itemsize)


def test_graph_buffers_are_the_sizes_of_the_sampling_tensors():
    """The static buffers as the decode step allocates them (seen mask from sampling.new_seen_mask)."""
    from notebookkit.models.generation.sampling import new_seen_mask

    shape = model_shape(TINY)
    batch, max_len, dtype = 3, 40, torch.bfloat16
    ids = torch.randint(0, 256, (batch, 9))
    tensors = [
        torch.zeros(batch, shape.vocab_size, dtype=torch.float32),  # logits
        new_seen_mask(ids, shape.vocab_size),  # seen tokens
        torch.rand(batch, shape.vocab_size),  # uniforms
        torch.zeros(batch, shape.hidden_size, dtype=dtype),  # hidden state
        torch.zeros(batch, max_len, dtype=torch.long),  # token ids by slot
        torch.zeros(batch, GRAPH_INTS_PER_ROW, dtype=torch.long),  # next token, position, padding, ...
    ]
    assert graph_buffer_bytes(shape, batch, max_len, dtype.itemsize) == sum(t.numel() * t.element_size() for t in tensors)


# ---- the training estimate and the planner with generation held alongside ----


def test_estimate_adds_what_generation_holds_and_the_prefill_beyond_the_step():
    shape = model_shape(TINY)
    base = estimate_training_memory(TINY, activation_plan="keep", **KW)
    transients = base.activations + base.logits_loss + base.temporaries - base.cuda_context
    # A short prompt: the prefill fits in the training step's transients, only what is held is added.
    small = generation_memory(shape, 3, 40, 2, prompt_len=8)
    assert small.prefill < transients
    est = estimate_training_memory(TINY, activation_plan="keep", generation=dict(batch_size=3, max_len=40, prompt_len=8), **KW)
    assert est.generation == small.held and est.total == base.total + small.held
    assert est.parts()["generation"] == small.held and sum(est.parts().values()) == est.total
    assert est.details["generation: KV cache"] == small.kv_cache
    assert "generation: prefill beyond the training step's transients" not in est.details
    # A long prompt for many rows: its prefill exceeds the step's transients by the difference.
    big = generation_memory(shape, 16, 400, 2, prompt_len=300)
    assert big.prefill > transients
    est = estimate_training_memory(TINY, activation_plan="keep", generation=big, **KW)
    assert est.total == base.total + big.held + (big.prefill - transients)
    assert est.details["generation: prefill beyond the training step's transients"] == big.prefill - transients
    assert "generation" in est.table() and "KV cache" in est.table()
    assert est.as_dict()["generation"] == est.generation and est.inputs["generation"]["max_len"] == 400
    # Without generation=, the estimate is as before: five parts.
    assert base.generation == 0 and list(base.parts()) == [
        "base weights", "adapters + optimizer", "activations", "logits / loss", "temporaries"]


def test_generation_takes_the_estimates_dtype_and_4bit_setting():
    est = estimate_training_memory(LLAMA8B, load_in_4bit=True, dtype="float16", activation_plan="recompute",
                                   generation=dict(batch_size=8, max_len=2048, prompt_len=1024))
    g = generation_memory(model_shape(LLAMA8B), 8, 2048, 2, prompt_len=1024, load_in_4bit=True)
    assert est.details["generation: KV cache"] == g.kv_cache == 32 * 2 * 8 * 8 * 2048 * 128 * 2  # 2 GiB
    assert est.details["generation: decode step (graph pool)"] == g.decode_step
    est32 = estimate_training_memory(LLAMA8B, dtype="float32", generation=dict(batch_size=8, max_len=2048))
    assert est32.details["generation: KV cache"] == 2 * g.kv_cache


def test_bad_generation_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match=r"generation= takes batch_size, max_len"):
        estimate_training_memory(TINY, generation=dict(batch=8, max_len=64), **KW)
    with pytest.raises(ValueError, match=r"generation= takes batch_size, max_len"):
        estimate_training_memory(TINY, generation=dict(batch_size=8), **KW)


def test_planner_budget_shrinks_by_the_generation_term():
    generation = dict(batch_size=8, max_len=2048, prompt_len=1024)
    kw = {k: v for k, v in QLORA.items() if k != "host_memory_bytes"}
    full = estimate_training_memory(LLAMA8B, activation_plan="keep", **kw)
    budget = int(full.total / USABLE) + 2**20  # everything kept fits, without generation
    alone = plan_activations(LLAMA8B, budget_bytes=budget, card="t4", **QLORA)
    assert alone.counts()["keep"] == 32
    both = plan_activations(LLAMA8B, budget_bytes=budget, card="t4", generation=generation, **QLORA)
    assert both.estimate.generation > 2 * GiB  # the 2 GiB cache and the graph's share
    assert both.estimate.total <= budget * USABLE
    assert both.counts()["keep"] < 32 and both.step_overhead > alone.step_overhead
    for gib in (16, 20, 24, 28):
        a = plan_activations(LLAMA8B, budget_bytes=gib * GiB, card="t4", **QLORA)
        b = plan_activations(LLAMA8B, budget_bytes=gib * GiB, card="t4", generation=generation, **QLORA)
        assert b.estimate.total <= gib * GiB * USABLE
        assert b.counts()["keep"] <= a.counts()["keep"] and b.step_overhead >= a.step_overhead


def test_planner_says_when_generation_itself_does_not_fit():
    with pytest.raises(DoesNotFitError) as info:
        plan_activations(LLAMA8B, "t4", generation=dict(batch_size=64, max_len=8192, prompt_len=512), **QLORA)
    assert "generation" in str(info.value)
    assert info.value.estimate.details["generation: KV cache"] == 32 * 2 * 64 * 8 * 8192 * 128 * 2


def test_generation_memory_object_is_accepted_as_is():
    g = GenerationMemory(kv_cache=1000, graph_buffers=100, decode_step=10, prefill=1)
    est = estimate_training_memory(TINY, activation_plan="keep", generation=g, **KW)
    assert est.generation == 1110


# ---- GPU: the sampling temporaries as measured ----


@pytest.mark.gpu
@pytest.mark.parametrize("batch,vocab", [(1, 128_256), (8, 128_256), (16, 151_936)])
def test_sampling_temporaries_within_the_model(batch, vocab):
    """The peak of filter_logits + choose_next (every filter on) above their inputs, eager and while a
    CUDA graph captures them, is at most SAMPLING_BYTES_PER_LOGIT per logit and not far below."""
    from notebookkit.models.generation.sampling import SamplingSettings, choose_next, filter_logits, new_seen_mask

    device = torch.device("cuda")
    s = SamplingSettings(do_sample=True, temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.2)
    logits = torch.randn(batch, vocab, device=device) * 3
    seen = new_seen_mask(torch.randint(0, vocab, (batch, 100), device=device), vocab)
    uniform = torch.rand(batch, vocab, device=device)
    predicted = batch * vocab * SAMPLING_BYTES_PER_LOGIT

    def step():
        return choose_next(filter_logits(logits, seen, s), s, uniform)

    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    eager = torch.cuda.max_memory_allocated() - before
    assert predicted / 2 <= eager <= predicted, (eager, predicted)

    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.cuda.graph(graph):
        out = step()
    torch.cuda.synchronize()
    captured = torch.cuda.max_memory_allocated() - before
    assert captured <= predicted + 2 * 2**20, (captured, predicted)  # 2 MiB: one allocator block
    del out, graph


def test_a_decode_cache_kept_on_the_model_joins_its_training_estimate():
    """An evaluation's ``generate`` before training leaves its static KV cache on the model (``for_training``
    keeps it, for GRPO): the estimate of the loaded model, and so the plan, counts it until it is released."""
    from notebookkit.memory import estimate_for_model, estimate_kwargs_from_model
    from notebookkit.models.generation.state import generation_state, release
    from notebookkit.models.generation.static_cache import StaticKVCache

    model = random_model("llama")
    shape = model_shape(model.config)
    assert "generation" not in estimate_kwargs_from_model(model)
    before = estimate_for_model(model, batch_size=2, seq_len=32)
    generation_state(model).cache = StaticKVCache(n_layers=shape.num_layers, batch=3, kv_heads=shape.num_kv_heads,
                                                  head_dim=shape.head_dim, capacity=256, dtype=torch.float32,
                                                  device="cpu")
    assert estimate_kwargs_from_model(model)["generation"] == dict(batch_size=3, max_len=256, prompt_len=256,
                                                                   keep_cache=True)
    held = estimate_for_model(model, batch_size=2, seq_len=32)
    assert held.generation >= kv_cache_bytes(shape, 3, 256, 4) > 0
    assert held.total - before.total == held.generation
    release(model)
    assert "generation" not in estimate_kwargs_from_model(model)


def test_moe_decode_step_counts_the_sparse_block_not_a_dense_mlp():
    """Qwen3-30B-A3B, 8 rows, bf16: N = 8 tokens, n = N k = 64 pairs, E = 128, H = 2048, I_e = 768,
    M = ceil(64 / 64) + 128 = 129 row blocks (notebookkit.memory.moe, Generation)."""
    from notebookkit.memory import moe as moe_terms
    from notebookkit.memory.generation import layer_working_set

    shape = model_shape("Qwen/Qwen3-30B-A3B")
    # routing: logits 8*128*2 + their fp32 copy and fp32 softmax 2 * 8*128*4 + top-k 12*64 + their sum 4*8
    # + normalised 4*64
    routing = 2048 + 8192 + 768 + 32 + 256
    # experts: the router logits 8*128*2, routing outputs 12*64, the kernel's int32 permutation 4*64, offsets
    # 8*128 and schedule 12*129, forward transients max(h + rows 64*(768+2048)*2, rows 64*2048*2 + fp32 sum
    # 4*8*2048 + y 8*2048*2) = 360448
    experts = 2048 + 768 + 256 + 1024 + 12 * 129 + 360448
    block = 2 * 8 * 2048 * 2 + max(routing, experts)
    assert moe_terms.sparse_block_generation_bytes(shape, tokens=8, s=2) == block == 431628
    # attention 8*2*(2H + 2(dq + 2dk) + dq) + the mask 8*1024*2 is less: the step's peak is the sparse block
    attention = 8 * 2 * (4096 + 2 * (4096 + 1024) + 4096) + 8 * 1024 * 2
    assert attention < block
    assert layer_working_set(shape, 8, 1, 1024, 2, False, "auto") == block
    # under load_in_4bit the experts are decoded in the kernel's tiles: only the largest attention projection
    # (q_proj or o_proj, 2048 x 4096) is dequantised, not an expert and not the unused dense intermediate_size
    assert layer_working_set(shape, 8, 1, 1024, 2, True, "auto") == block + 2048 * 4096 * 2
    g = generation_memory(shape, 8, 1024, 2, prompt_len=512)
    assert g.prefill == layer_working_set(shape, 8, 512, 1024, 2, False, "auto") + 8 * shape.vocab_size * 2


def test_gpt_oss_attention_with_sinks_counts_its_explicit_fp32_scores():
    from notebookkit.memory.generation import layer_working_set

    shape = model_shape("openai/gpt-oss-20b")  # 64 query heads, 8 key/value heads of 64
    B, T, M, s = 2, 256, 1024, 2
    N, H, dq, dk = B * T, 2880, 64 * 64, 8 * 64
    attention = N * s * (2 * H + 2 * (dq + 2 * dk) + dq) + B * T * M * s
    attention += B * 64 * T * M * (2 * s + 12) + B * 8 * T * M  # scores, exp, probs; the mask per group row
    assert layer_working_set(shape, B, T, M, s, False, "auto") == attention  # more than the sparse block here
