"""The memory model's peak against the live bytes of a real training step (CPU, CUDA code paths).

A small Llama-shaped model (bf16, LoRA r=4 on all seven projections, AdamW) runs a warm-up step,
then a measured one under ``activation_probe.LiveBytes`` with the CUDA paths (Triton kernels under
the interpreter, grouped-query SDPA). Everything allocated during the step and alive at once is
the step's working set: activations, loss buffers, backward temporaries and LoRA gradients. The
estimate's ``peak_allocated`` minus the parts that exist before the step (weights, LoRA weights,
optimizer states) must match it. The estimate counts the LoRA gradients as alive throughout (as
with gradient accumulation), so it may be above by about their size.

The same for a whole step of the tiny mixture-of-experts models on the grouped path (``grouped_mm`` as an
sm_90 card takes it in bf16): Qwen3-MoE with every layer kept, gpt-oss with NF4 experts recomputed. With every
layer kept the step peaks in the last layer's backward, when one layer's LoRA gradients of L exist, so the
estimate less the others' gradients must still bound it (the LoRA gradients would otherwise hide a missing
activation term of their size).
"""

from __future__ import annotations

import pytest
import torch

from notebookkit.memory import estimate_training_memory

from .activation_probe import LiveBytes, cuda_like

CONFIG = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=1, head_dim=32, vocab_size=1024, tie_word_embeddings=True,
              max_position_embeddings=512)
B, T, R = 2, 64, 4


def measured_step_peak(model, ids: torch.Tensor) -> int:
    """The live bytes' peak of one AdamW training step on ``ids`` (CUDA paths), after a first step made the
    optimizer states: everything the step allocates and holds at once."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with cuda_like(release_launch_args=True):
        step()  # optimizer states now exist
        probe = LiveBytes()
        with probe:
            step()
    return probe.peak


def predicted_step_bytes(est) -> tuple[int, int]:
    """(the estimate's peak less what exists before a step: weights, LoRA weights, optimizer states; the LoRA
    gradients it counts)."""
    before_step = (est.base_weights + est.details["adapters + optimizer: LoRA weights"]
                   + est.details["adapters + optimizer: optimizer states"])
    return est.peak_allocated - before_step, est.details["adapters + optimizer: gradients"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from notebookkit.embedded.tiny import ensure_tiny_model

    path = tmp_path_factory.mktemp("llama-probe")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16).save_pretrained(path)
    AutoTokenizer.from_pretrained(ensure_tiny_model("notebookkit/tiny-llama")).save_pretrained(path)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("mode,load_in_4bit,tile_rows", [
    ("keep", False, None), ("recompute", False, None), ("recompute", True, None),
    (["recompute", "keep"], False, None),  # the planner's order: last kept
    ("recompute", True, 48),  # the recompute's MLP backward in tiles of 48 of the 128 tokens (48, 48, 32)
], ids=["keep", "recompute", "recompute-nf4", "recompute-then-keep", "recompute-nf4-tiles"])
def test_step_working_set_matches_the_estimate(folder, mode, load_in_4bit, tile_rows, monkeypatch):
    from notebookkit import FastLanguageModel, sequence_tiles

    if tile_rows:  # the kernel and the memory model read the same rule
        monkeypatch.setattr(sequence_tiles, "MLP_TILE_MIN_ROWS", tile_rows)
        monkeypatch.setattr(sequence_tiles, "MLP_TILE_BYTES", tile_rows * CONFIG["intermediate_size"] * 2)

    model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=T, dtype=torch.bfloat16,
                                                 load_in_4bit=load_in_4bit, show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=R, lora_alpha=R, use_gradient_checkpointing=mode == "recompute",
                                             show_banner=False).train()
    if isinstance(mode, list):  # a per-layer plan
        FastLanguageModel.for_training(model, mode)
    peak = measured_step_peak(model, torch.randint(0, CONFIG["vocab_size"], (B, T)))
    est = estimate_training_memory(dict(CONFIG, model_type="llama"), load_in_4bit=load_in_4bit, lora_r=R,
                                   batch_size=B, seq_len=T, activation_plan=mode, cuda_context_bytes=0,
                                   cublas_workspace_bytes=0)
    predicted, grads = predicted_step_bytes(est)
    print(f"{mode} nf4={load_in_4bit}: measured {peak}, predicted {predicted} (LoRA grads {grads})")
    assert peak <= predicted <= peak + grads + 0.03 * peak


@pytest.mark.slow
@pytest.mark.parametrize("family,load_in_4bit,mode", [("qwen3_moe", False, False), ("gpt_oss", True, "recompute")],
                         ids=["qwen3_moe-keep", "gpt_oss-nf4-recompute"])
def test_moe_step_working_set_matches_the_estimate(family, load_in_4bit, mode, monkeypatch, one_thread):
    import notebookkit.kernels.moe_experts as kernel
    from notebookkit import FastLanguageModel
    from notebookkit.memory import estimate_for_model

    monkeypatch.setattr(kernel, "grouped_mm_applies", lambda *args: True)
    model, _ = FastLanguageModel.from_pretrained(f"notebookkit/tiny-{family}", max_seq_length=T, dtype=torch.bfloat16,
                                                 load_in_4bit=load_in_4bit, show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=8, use_gradient_checkpointing=mode,
                                             show_banner=False).train()
    peak = measured_step_peak(model, torch.randint(5, 900, (B, T // 2), generator=torch.Generator().manual_seed(0)))
    predicted, grads = predicted_step_bytes(estimate_for_model(model, batch_size=B, seq_len=T // 2))
    print(f"{family} {mode} nf4={load_in_4bit}: measured {peak}, predicted {predicted} (LoRA grads {grads})")
    assert peak <= predicted <= peak + grads + 0.03 * peak
    if mode is False:  # every layer kept: the step peaks in the last layer's backward, one layer's gradients of L made
        layers = model.config.num_hidden_layers
        assert peak <= predicted - grads * (layers - 1) / layers
