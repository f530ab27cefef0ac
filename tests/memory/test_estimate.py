"""The memory model: hand-computed sizes for a tiny config, monotonicity, inputs it accepts."""

import pytest

from notebookkit.memory import estimate_training_memory, model_shape, normalize_plan
from notebookkit.memory.estimate import default_loss_chunk

# H=64, L=2, 4 query heads / 2 kv heads of 16, I=128, V=256, tied embeddings.
TINY = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=256,
            tie_word_embeddings=True)
KW = dict(dtype="bfloat16", lora_r=4, optimizer="adamw", batch_size=2, seq_len=32, cuda_context_bytes=0,
          cublas_workspace_bytes=0)


def test_tiny_config_matches_hand_computed_sizes_keep():
    est = estimate_training_memory(TINY, activation_plan="keep", **KW)
    # Linear params per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 + 3 * 64*128 = 36864; 2 layers: 73728.
    # Norms 2*64 per layer (256), final norm 64, embeddings 256*64 = 16384 (tied: no separate head).
    # bf16: (73728 + 256 + 64 + 16384) * 2 bytes = 180864.
    assert est.base_weights == 180864
    # LoRA r=4: q 4*(64+64)=512, k 4*(64+32)=384, v 384, o 512, gate/up/down 4*(64+128)=768 each
    # -> 4096 per layer, 8192 total; fp32 weights 4 + grads 4 + AdamW 8 = 16 bytes -> 131072, plus the
    # bf16 casts the fused kernels keep through the step: 8192 * 2 = 16384 -> 147456.
    assert est.inputs["lora_params"] == 8192
    assert est.details["adapters + optimizer: compute-dtype copies"] == 16384
    assert est.adapters == 131072 + 16384 == 147456
    # Keep, per token (what the fused kernels save): 4H + 2dq + 2dk + 2I = 256 + 128 + 64 + 256 = 704 bf16
    # values, plus the rank-space inputs s x A^T of q, k, v, o, gate and up (r = 4 each, down's is computed
    # again): 24 -> 728 bf16 values = 1456 B, plus fp32 (2 norm rstd + 4 heads of lse) = 24 B -> 1480 B;
    # N = 2*32 = 64 tokens -> 94720 per layer, 189440 for two.
    assert est.per_layer_activations == (94720, 94720)
    assert est.activations == 189440
    # Fused loss: the kernel's chunk is max(512, 64/ceil(256/64)) rows capped at N = 64 rows of
    # 256 bf16 logits = 32768 B; final-norm input and output + hidden grad 3*64*64*2 = 24576, plus
    # 16 B per token (fp32 row losses and 1/rms, int64 shifted labels) = 1024 -> 58368.
    assert default_loss_chunk(64, 64, 256, 2) == 64
    assert est.logits_loss == 58368
    # Backward of the last layer: gradient from above 8192 + dY W_down 64*128*2 = 16384 + dX 8192 =
    # 32768 (the attention moment is lower) < 58368: nothing beyond the loss buffers.
    assert est.temporaries == 0
    assert est.total == 180864 + 147456 + 189440 + 58368 == 576128
    assert est.peak_allocated == est.total


def test_the_cublas_workspace_of_the_card_joins_the_peak():
    """PyTorch's cuBLAS workspace for the training stream (32 MiB on sm_90, measured on an H100 in session 46;
    8.125 MiB on other cards) is allocated at the first matmul and kept: it joins the temporaries and the peak
    that ``max_memory_allocated`` sees, the planner counts the card it plans for, and a model on a CPU has none."""
    from notebookkit.memory import plan_activations
    from notebookkit.memory.cards import CARDS, DEFAULT_CUBLAS_WORKSPACE_BYTES, cublas_workspace_bytes
    from notebookkit.memory.estimate import estimate_kwargs_from_model

    assert cublas_workspace_bytes((9, 0)) == CARDS["h200"].cublas_workspace_bytes == 32 * 2**20
    assert cublas_workspace_bytes((7, 5)) == CARDS["t4"].cublas_workspace_bytes == CARDS["a100-80gb"].cublas_workspace_bytes
    assert DEFAULT_CUBLAS_WORKSPACE_BYTES == (4096 * 2 + 16 * 8) * 1024  # 8.125 MiB
    none = estimate_training_memory(TINY, activation_plan="keep", **KW)
    kw = dict(KW, cublas_workspace_bytes=32 * 2**20)
    hopper = estimate_training_memory(TINY, activation_plan="keep", **kw)
    assert hopper.peak_allocated - none.peak_allocated == hopper.total - none.total == 32 * 2**20
    assert hopper.temporaries - none.temporaries == hopper.cublas_workspace == 32 * 2**20
    assert hopper.details["temporaries: cuBLAS workspace (the training stream's)"] == 32 * 2**20
    # generation alongside (GRPO): the decode graphs' capture stream keeps one more, cache kept or freed
    for keep in (True, False):
        rl = dict(kw, method="grpo", generation=dict(batch_size=4, max_len=48, prompt_len=16, keep_cache=keep))
        with_rl, without = (estimate_training_memory(TINY, activation_plan="keep", **a) for a in
                            (rl, dict(rl, cublas_workspace_bytes=0)))
        assert with_rl.total - without.total == 2 * 32 * 2**20 and with_rl.generation - without.generation == 32 * 2**20
        assert with_rl.details["generation: cuBLAS workspace of the decode graphs' capture stream"] == 32 * 2**20
    default = dict(KW)
    del default["cublas_workspace_bytes"]
    assert estimate_training_memory(TINY, activation_plan="keep", **default).cublas_workspace == DEFAULT_CUBLAS_WORKSPACE_BYTES
    for card in ("t4", "h100"):
        assert plan_activations(TINY, card=card, **default).estimate.cublas_workspace == CARDS[card].cublas_workspace_bytes
    torch = pytest.importorskip("torch")
    assert estimate_kwargs_from_model(torch.nn.Linear(2, 2))["cublas_workspace_bytes"] == 0


def test_tiny_config_adapters_in_the_compute_dtype_keep_only_the_grouped_a_copies():
    # bf16 adapters under bf16 compute are used as they are, except A of q/k/v and of gate/up, copied
    # into one A_cat per group: r * H per grouped projection = 4 * 64 * 5 = 1280 per layer, 2560 for
    # two layers, 5120 bytes. Weights 2 + grads 2 + fp32 master 4 + AdamW 8 = 16 bytes -> 131072.
    est = estimate_training_memory(TINY, activation_plan="keep", adapter_dtype="bfloat16", **KW)
    assert est.details["adapters + optimizer: compute-dtype copies"] == 5120
    assert est.adapters == 131072 + 5120
    # A group with an untargeted member runs per projection (no A_cat): only gate/up are grouped here,
    # 4 * 64 * 2 * 2 layers = 1024 elements = 2048 bytes.
    part = estimate_training_memory(TINY, activation_plan="keep", adapter_dtype="bfloat16",
                                    target_modules=["q_proj", "v_proj", "gate_proj", "up_proj"], **KW)
    assert part.details["adapters + optimizer: compute-dtype copies"] == 2048
    # In another dtype, A_cat takes the place of the A casts: all adapters once in bf16, as before.
    assert estimate_training_memory(TINY, activation_plan="keep", **KW).details[
        "adapters + optimizer: compute-dtype copies"] == 8192 * 2


def test_tiny_config_matches_hand_computed_sizes_recompute_and_nf4():
    est = estimate_training_memory(TINY, activation_plan="recompute", **KW)
    # Layer inputs only: 64 tokens * 64 * 2 B = 8192 per layer.
    assert est.activations == 2 * 8192
    # Backward: the recomputed layer's 94720 less its (stored) input 8192 and gate/up's rank-space inputs
    # 64 * 2 * 4 * 2 = 1024 (its MLP is deferred: they are made in the backward's tiles), plus 32768 (above)
    # = 118272; minus the loss buffers 58368 -> 59904.
    assert est.temporaries == 118272 - 58368
    assert est.total == 180864 + 147456 + 16384 + 58368 + 59904
    q = estimate_training_memory(TINY, activation_plan="recompute", load_in_4bit=True, **KW)
    # NF4: 73728 * (1/2 + 1/64 + 4/(64*256)) = 36864 + 1152 + 18 = 38034; the rest stays bf16:
    # (16384 + 256 + 64) * 2 = 33408.
    assert q.base_weights == 38034 + 33408
    # One dequantised projection at a time in backward: the largest, 64*128 * 2 B = 16384 more.
    assert q.temporaries == est.temporaries + 16384
    off = estimate_training_memory(TINY, activation_plan="offload", **KW)
    assert off.host_offload == 2 * 8192
    # The last layer's input stays on the GPU (saved) and its backward prefetches nothing; by layer 0's backward
    # it is freed and layer 0's own input has come back in its place, with no layer before it to prefetch: no
    # input in flight beyond the saved one (until session 47 one more was counted).
    assert off.per_layer_activations == (0, 8192)
    assert off.activations == 8192
    assert off.temporaries == 8192 + (94720 - 1024 - 8192) + 32768 - 8192 - 58368


def test_inputs_in_flight_join_the_end_of_the_forward_only_when_its_copies_may_still_run():
    # Plan (offload, keep, keep) of a 3-layer TINY: the end of the forward holds two kept layers' 2 * 94720 B
    # and the loss buffers 58368 (247808). Layer 0's input (8192), fetched back, is in flight in its backward,
    # after layers 1 and 2 freed theirs (no layer before it to prefetch): recompute 94720 - 1024 - 8192 + working
    # set 32768 + 8192 = 126464 < 247808, and its copy to the host ended while the two kept layers ran their
    # forward: not part of the peak (until session 32 it was added to it).
    est = estimate_training_memory({**TINY, "num_hidden_layers": 3}, activation_plan=["offload", "keep", "keep"], **KW)
    assert est.activations == 2 * 94720 and est.temporaries == 0
    assert est.total == est.base_weights + est.adapters + 2 * 94720 + 58368
    # Plan (offload, keep): one kept layer's forward may not outlast layer 0's copy: its input counted at the end
    # of the forward, 94720 + 58368 + 8192 = 161280 > the recompute of layer 0 (126464).
    one = estimate_training_memory(TINY, activation_plan=["offload", "keep"], **KW)
    assert one.activations == 94720 and one.temporaries == 8192
    assert one.total == 180864 + 147456 + 94720 + 58368 + 8192
    # Plan (offload, recompute, keep): a recomputed layer's forward covers the copy as a kept one's does (two
    # layers follow the offloaded one): 8192 + 94720 saved and the loss buffers, nothing in flight; the recompute
    # of layer 1 (8192 + 85504 + 32768 + 8192 = 134656) stays below. Until session 48 only kept layers were
    # counted, so the copy was added (the 8B shape at 65,536 tokens with 21 offloaded, 10 recomputed and 1 kept
    # layer was predicted 21.65 GiB against 20.58 measured; now 20.65).
    mixed = estimate_training_memory({**TINY, "num_hidden_layers": 3}, activation_plan=["offload", "recompute", "keep"],
                                     **KW)
    assert mixed.activations == 8192 + 94720 and mixed.temporaries == 0
    # Plan (keep, offload): layer 0's activations are still saved during layer 1's backward, whose input stayed
    # on the GPU (the last layer) and which has no host copy to prefetch (layer 0 is kept):
    # 94720 + 8192 + (94720 - 1024 - 8192) + 32768 = 221184, nothing in flight.
    late = estimate_training_memory(TINY, activation_plan=["keep", "offload"], **KW)
    assert late.activations == 94720 + 8192
    assert late.temporaries == 94720 + 8192 + 85504 + 32768 - late.activations - 58368


def test_kept_last_layers_are_freed_before_the_first_recompute():
    # The backward runs from the last layer down. Plan (recompute, keep): the kept layer 1 has freed
    # its 94720 B before layer 0 is recomputed, so the peak is the end of the forward: saved 8192 +
    # 94720 = 102912 plus the loss buffers 58368 (the kept layer's backward working set, 32768, is
    # smaller). The recompute of layer 0 needs only 8192 + (94720 - 1024 - 8192) + 32768 = 126464 < 161280.
    late = estimate_training_memory(TINY, activation_plan=["recompute", "keep"], **KW)
    assert late.activations == 102912
    assert late.temporaries == 0
    assert late.total == 180864 + 147456 + 102912 + 58368 == 489600
    # Plan (keep, recompute): layer 0's activations are still saved while layer 1 is recomputed:
    # 102912 + 85504 + 32768 = 221184, i.e. 59904 beyond the saved activations and loss buffers.
    early = estimate_training_memory(TINY, activation_plan=["keep", "recompute"], **KW)
    assert early.temporaries == 221184 - 102912 - 58368 == 59904
    assert early.total == late.total + 59904
    # The H200 rows of such a plan, and a measured CPU step: tests/models/test_mixed_plan.py.


@pytest.mark.parametrize("plan", ["keep", "recompute", "offload"])
@pytest.mark.parametrize("fused", [True, False])
def test_monotonic_in_batch_and_seq(plan, fused):
    name = "meta-llama/Llama-3.2-1B-Instruct"
    totals = [estimate_training_memory(name, batch_size=b, seq_len=1024, activation_plan=plan, fused_loss=fused).total
              for b in (1, 2, 4, 8)]
    assert totals == sorted(totals) and len(set(totals)) == 4
    totals = [estimate_training_memory(name, batch_size=2, seq_len=t, activation_plan=plan, fused_loss=fused).total
              for t in (128, 512, 2048, 8192)]
    assert totals == sorted(totals) and len(set(totals)) == 4


def test_more_memory_for_more_kept_layers_bigger_rank_and_fp32_optimizer():
    name = "Qwen/Qwen3-4B"
    keep = estimate_training_memory(name, activation_plan="keep", seq_len=4096)
    rec = estimate_training_memory(name, activation_plan="recompute", seq_len=4096)
    off = estimate_training_memory(name, activation_plan="offload", seq_len=4096)
    assert keep.total > rec.total > off.total
    assert (estimate_training_memory(name, lora_r=64).adapters > estimate_training_memory(name, lora_r=16).adapters)
    assert (estimate_training_memory(name, optimizer="adamw_8bit").adapters
            < estimate_training_memory(name, optimizer="adamw").adapters)
    assert estimate_training_memory(name, load_in_4bit=True).base_weights < 0.4 * keep.base_weights
    assert (estimate_training_memory(name, fused_loss=False, seq_len=4096).logits_loss
            > 10 * estimate_training_memory(name, fused_loss=True, seq_len=4096).logits_loss)


def test_8b_qlora_matches_published_shapes():
    est = estimate_training_memory("meta-llama/Llama-3.1-8B-Instruct", load_in_4bit=True, batch_size=2,
                                   seq_len=4096, activation_plan="offload")
    assert est.inputs["lora_params"] == 41943040  # r=16 on all seven projections, as PEFT counts it
    assert 5.0 < est.base_weights / 2**30 < 5.7
    assert est.shape.num_params == pytest.approx(8.03e9, rel=0.01)


def test_parts_add_up_and_table_names_them():
    est = estimate_training_memory("google/gemma-2-2b-it", load_in_4bit=True, activation_plan="recompute")
    assert sum(est.parts().values()) == est.total
    text = str(est)
    for word in ("base weights", "adapters + optimizer", "activations", "logits / loss", "temporaries", "total"):
        assert word in text


def test_accepts_hf_config_dict_with_text_config_and_per_layer_plans():
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    a = estimate_training_memory(cfg, activation_plan=["keep", "recompute"], **KW)
    b = estimate_training_memory({"model_type": "gemma3", "text_config": TINY}, activation_plan="keep", **KW)
    assert a.plan == ("keep", "recompute")
    assert model_shape(cfg).num_layers == 2 and b.shape.hidden_size == 64
    assert normalize_plan(True, 3) == ("recompute",) * 3
    assert normalize_plan("unsloth", 2) == ("offload", "offload")


@pytest.mark.parametrize("bad", [dict(optimizer="adamq"), dict(activation_plan="auto"), dict(dtype="int3"),
                                 dict(activation_plan=["keep"]), dict(target_modules=["qkv"]), dict(seq_len=0)])
def test_bad_inputs_raise_readable_errors(bad):
    with pytest.raises(ValueError, match="notebookkit"):
        estimate_training_memory(TINY, **{**KW, **bad})


def test_fp8_forward_working_set_is_the_one_byte_copies_of_the_largest_product():
    """FP8 forward: FP8 copies of the input and weights of the largest FP8 product, ``N*in + sum in*out``
    bytes, where q/k/v and gate/up are one product each when their sizes are multiples of 16 (their
    weights in one FP8 buffer); an NF4 weight in whole 64-element blocks goes to FP8 in one kernel
    (no 16-bit copy), else its dequantised bf16 weight joins them."""
    from notebookkit.memory.estimate import backward_working_set, fp8_products

    shape = model_shape(TINY)
    N = 2 * 32
    assert fp8_products(shape) == [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",)]
    # gate/up: N*64 + 64*(128 + 128) = 20480 > down N*128 + 128*64 = 16384 > q/k/v N*64 + 64*128 = 12288
    largest = N * 64 + 64 * (128 + 128)
    assert largest == 20480
    kw = dict(batch_size=2, seq_len=32, dtype_bytes=2)
    assert backward_working_set(shape, **kw)["fp8_forward"] == 0
    assert backward_working_set(shape, fp8_forward=True, **kw)["fp8_forward"] == largest
    assert backward_working_set(shape, fp8_forward=True, load_in_4bit=True, **kw)["fp8_forward"] == largest
    odd = model_shape(dict(TINY, hidden_size=72, head_dim=18))  # rows of 72: not whole NF4 blocks
    assert len(fp8_products(odd)) == 7  # 72 is no multiple of 16: one product per projection
    odd_largest = max(N * i + i * o for i, o in odd.projection_shapes().values())
    dequant = max(i * o for i, o in odd.projection_shapes().values()) * 2
    assert backward_working_set(odd, fp8_forward=True, load_in_4bit=True, **kw)["fp8_forward"] == odd_largest + dequant
    # and the estimate takes it: with FP8 the peak is never lower
    plain = estimate_training_memory(TINY, activation_plan="recompute", **KW)
    fp8 = estimate_training_memory(TINY, activation_plan="recompute", fp8_forward=True, **KW)
    assert fp8.total >= plain.total and fp8.inputs["fp8_forward"] is True


def test_what_is_in_flight_follows_the_layers_on_the_host():
    """In the backward a layer whose input went to the host fetches it and prefetches the previous such layer's
    input and first parked tile, and its own next tile when it has several; the last layer's input stays on the
    GPU and is freed by then (session 47: a 2-layer 8B shape at 16,384 tokens was predicted 0.70 GiB over)."""
    from notebookkit.memory.estimate import in_flight_bytes

    X, T = 100, 7
    om, off, keep = "offload_mlp", "offload", "keep"
    assert in_flight_bytes((om,) * 32, X, T, tiles=2) == X + 2 * T  # layer 30: 2 inputs, 2 tiles, less layer 31's
    assert in_flight_bytes((om,) * 32, X, T, tiles=1) == X + T
    assert in_flight_bytes((om, om), X, T, tiles=2) == T  # layer 0: nothing before it to prefetch
    assert in_flight_bytes((om, om), X, T, tiles=1) == 0
    assert in_flight_bytes((off, off), X, T, tiles=2) == 0
    assert in_flight_bytes((off, keep), X, T, tiles=2) == X  # layer 0's own input, the last layer's kept
    assert in_flight_bytes((keep, off), X, T, tiles=2) == 0  # no layer on the host
    assert in_flight_bytes((om, keep, om, keep), X, T, tiles=2) == 2 * X + 2 * T  # the chain skips kept layers
    # layer 1 prefetches its own next tile, layer 2 layer 1's first one
    assert in_flight_bytes((off, om, off, off), X, T, tiles=2) == X + T
    assert in_flight_bytes((om, om, om), X, 0, tiles=2) == X  # MLPs not deferred: nothing parked


def test_offload_mlp_parks_gate_up_on_the_host():
    """"offload_mlp": every offloaded layer but the last also keeps its MLP's e, g (2 N I values) in pinned host
    memory; the GPU holds one more [tokens, 2 I] tile in flight (the previous layer's, prefetched), two tiles
    when a layer's MLP backward has several. A post-MLP norm (Gemma 2) or LoRA dropout parks nothing."""
    llama = "meta-llama/Llama-3.1-8B-Instruct"
    I, L = 14336, 32
    for batch, seq, tiles in [(2, 4096, 1), (1, 16384, 2)]:
        kw = dict(load_in_4bit=True, dtype="bfloat16", batch_size=batch, seq_len=seq)
        off = estimate_training_memory(llama, activation_plan="offload", **kw)
        mlp = estimate_training_memory(llama, activation_plan="offload_mlp", **kw)
        rows = min(batch * seq, 9216)  # sequence_tiles.mlp_tile_rows(14336, 2)
        assert mlp.peak_allocated - off.peak_allocated == tiles * 2 * rows * I * 2
        assert mlp.host_offload - off.host_offload == (L - 1) * 2 * batch * seq * I * 2
    for model, extra in [("google/gemma-2-2b-it", {}), (llama, dict(lora_dropout=0.1))]:
        kw = dict(load_in_4bit=True, dtype="bfloat16", batch_size=2, seq_len=1024, **extra)
        off = estimate_training_memory(model, activation_plan="offload", **kw)
        mlp = estimate_training_memory(model, activation_plan="offload_mlp", **kw)
        assert (mlp.peak_allocated, mlp.host_offload) == (off.peak_allocated, off.host_offload)
