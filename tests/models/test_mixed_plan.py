"""A per-layer plan whose first layers recompute (or offload) and whose last layers keep, as the
``"auto"`` planner chooses under a tight ``max_memory`` ("1 keep, 15 offload" on Llama-3.2-1B, batch
8 x 2048, under 5.6 GiB).

* The kept layer is really kept: reached through ``use_gradient_checkpointing="auto"``, it runs its
  forward once per step (the recomputed layers twice), its base GEMMs run in FP8 once, and it saves
  exactly the activations the memory model gives a kept layer.
* The memory model's peak for such a plan: the kept layers' activations are freed (their backward
  comes first) before any recomputed layer rebuilds its own, so the two are never held together.
  Counting both over-predicted the H200 row by 0.8 GiB (4.72 GiB predicted, 3.92 measured).
"""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels import lora_projection
from notebookkit.memory import estimate_training_memory, layer_activation_bytes, model_shape
from notebookkit.memory.model_setup import recorded_activation_plan
from notebookkit.models.patching import checkpointing

from ..memory.activation_probe import cuda_like, decoder_layers, saved_bytes_by_layer

B, T = 2, 32


def _tiny_llama(plan, fp8: bool, monkeypatch):
    """The tiny Llama through ``get_peft_model(use_gradient_checkpointing="auto")``, the planner
    answering ``plan`` (on CPU it would keep every layer)."""
    from notebookkit import FastLanguageModel
    from notebookkit.embedded.tiny import ensure_tiny_model

    path = str(ensure_tiny_model("notebookkit/tiny-llama"))
    model, _ = FastLanguageModel.from_pretrained(path, max_seq_length=T, dtype=torch.bfloat16, load_in_4bit=False,
                                                 show_banner=False)
    monkeypatch.setattr(checkpointing, "auto_plan", lambda *a, **k: (list(plan), "auto: plan given by the test", None))
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=8, use_gradient_checkpointing="auto",
                                             planning_batch_size=B,  # the batch it trains: no re-plan
                                             fp8_base_matmul=fp8, show_banner=False)
    monkeypatch.undo()
    return model.train(), model_shape(path)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_kept_last_layer_runs_once_and_saves_all_it_needs(fp8, monkeypatch):
    L = 4
    plan = ["recompute"] * (L - 1) + ["keep"]
    model, shape = _tiny_llama(plan, fp8, monkeypatch)
    layers = decoder_layers(model)
    assert len(layers) == L and recorded_activation_plan(model.get_base_model()) == plan
    assert [layer.gradient_checkpointing for layer in layers] == [True] * (L - 1) + [False]

    runs = {("attn", i): 0 for i in range(L)} | {("mlp", i): 0 for i in range(L)}
    for i, layer in enumerate(layers):
        layer.self_attn.register_forward_hook(lambda *_, i=i: runs.__setitem__(("attn", i), runs[("attn", i)] + 1))
        layer.mlp.register_forward_hook(lambda *_, i=i: runs.__setitem__(("mlp", i), runs[("mlp", i)] + 1))
    fp8_calls = []
    real = lora_projection.fp8_matmul_quantized
    monkeypatch.setattr(lora_projection, "fp8_matmul_quantized", lambda *a: fp8_calls.append(1) or real(*a))

    ids = torch.randint(0, shape.vocab_size, (B, T))
    with cuda_like():
        saved = saved_bytes_by_layer(model, input_ids=ids, labels=ids)  # forward and backward of one step

    assert [runs[("attn", i)] for i in range(L)] == [2] * (L - 1) + [1]
    assert [runs[("mlp", i)] for i in range(L)] == [2] * (L - 1) + [1]
    # forward: 4 base products a layer (q/k/v grouped, o, gate/up grouped, down); recompute: q/k/v, o,
    # gate/up (Llama's down projection is skipped)
    assert len(fp8_calls) == (4 * L + 3 * (L - 1) if fp8 else 0)
    keep = layer_activation_bytes(shape, "keep", batch_size=B, seq_len=T, dtype_bytes=2, lora_r=8)
    x = B * T * shape.hidden_size * 2
    assert [sum(saved[i].values()) for i in range(1, L - 1)] == [x] * (L - 2)  # recomputed: the input only
    # The kept layer: every activation, plus the RoPE cos/sin tables (at most [B, T, head_dim] each, in
    # bf16) that no earlier layer saved (the recomputed layers saved only their inputs).
    extra = sum(saved[L - 1].values()) - keep
    assert 0 <= extra <= 2 * B * T * shape.head_dim * 2, dict(saved[L - 1])


LLAMA_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True)
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("plan,measured_gib", [
    ("offload", 3.879),
    (["offload"] * 15 + ["keep"], 3.919),
])
def test_estimate_of_the_h200_rows(plan, measured_gib):
    """1B bf16, LoRA r=16 on all seven, batch 8 x 2048, FP8 forward, AdamW: the peaks one H200 measured
    (``torch.cuda.max_memory_allocated``, benchmarks/train_step.py, transformers 5.17)."""
    est = estimate_training_memory(LLAMA_1B, batch_size=8, seq_len=2048, dtype="bfloat16", lora_r=16,
                                   target_modules=ALL7, fp8_forward=True, activation_plan=plan)
    predicted = est.peak_allocated / 2**30
    assert abs(predicted - measured_gib) <= 0.03 * measured_gib, (predicted, measured_gib)


@pytest.mark.parametrize("other", ["recompute", "offload"])
def test_keeping_the_last_layer_costs_no_second_set_of_activations(other):
    """A recomputed layer's backward rebuilds what a kept layer holds, and the kept last layer has run
    its backward (and freed it all) before any other layer recomputes. So keeping the last layer instead
    of recomputing it does not raise the peak beyond the gate/up rank-space inputs ``s x A^T`` that a kept MLP
    saves and a deferred one makes in its backward's tiles (``N * 2r`` values, 1 MiB here); instead of
    offloading it, by one layer input more at most (an offloaded last layer's input is also the one in flight)."""
    kw = dict(batch_size=8, seq_len=2048, dtype="bfloat16", lora_r=16, target_modules=ALL7)
    L = LLAMA_1B["num_hidden_layers"]
    x = 8 * 2048 * LLAMA_1B["hidden_size"] * 2
    uniform = estimate_training_memory(LLAMA_1B, activation_plan=other, **kw).peak_allocated
    mixed = estimate_training_memory(LLAMA_1B, activation_plan=[other] * (L - 1) + ["keep"], **kw).peak_allocated
    gate_up_low_rank = 8 * 2048 * 2 * 16 * 2
    assert mixed <= uniform + gate_up_low_rank + (x if other == "offload" else 0), ((mixed - uniform) / 2**20, "MiB")


# The measured step of such a plan against the estimate: tests/memory/test_step_peak_cpu.py
# (case recompute-then-keep).
