"""The memory model for preference and RL steps (``method=``): DPO / ORPO run chosen and rejected as one batch
of ``2 * pairs`` rows with the chunked log-prob buffers (plus DPO's no-grad reference pass on top of the saved
policy activations); GRPO's loss covers only the completion positions and holds generation alongside; the
model panel's estimate follows the training panel's method."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from notebookkit.memory import estimate_training_memory, generation_memory, model_shape
from notebookkit.memory.generation import layer_working_set

from .test_generation_memory import KW, LLAMA8B, TINY

SHAPE = model_shape(TINY)


@pytest.mark.parametrize("plan", ["keep", "recompute"])
def test_dpo_and_orpo_count_chosen_and_rejected_rows(plan):
    pairs = dict(KW, batch_size=3, activation_plan=plan)
    sft_rows = estimate_training_memory(TINY, **dict(pairs, batch_size=6))
    orpo = estimate_training_memory(TINY, method="orpo", **pairs)
    dpo = estimate_training_memory(TINY, method="dpo", **pairs)
    tokens = 6 * KW["seq_len"]
    assert orpo.inputs["rows"] == dpo.inputs["rows"] == 6
    assert orpo.activations == dpo.activations == sft_rows.activations
    assert orpo.logits_loss == dpo.logits_loss == sft_rows.logits_loss + 4 * tokens  # + the fp32 entropy per row
    # ORPO has no reference: its working set is SFT's. DPO's reference forward (no grad) runs while the
    # policy's activations and loss buffers are held: the step's extra is at least one such layer.
    peak = lambda e: e.logits_loss + e.temporaries  # noqa: E731  (beyond weights, adapters, activations)
    assert peak(sft_rows) <= peak(orpo) <= peak(sft_rows) + 4 * tokens
    reference = layer_working_set(SHAPE, 6, KW["seq_len"], KW["seq_len"], 2, False, "sdpa")
    assert dpo.temporaries == max(orpo.temporaries, reference)
    assert dpo.total == dpo.base_weights + dpo.adapters + dpo.activations + dpo.logits_loss + dpo.temporaries


def test_dpo_8b_pairs_need_more_than_sft_of_the_pairs():
    qlora = dict(load_in_4bit=True, dtype="float16", batch_size=2, seq_len=1024)
    sft = estimate_training_memory(LLAMA8B, **qlora)
    dpo = estimate_training_memory(LLAMA8B, method="dpo", **qlora)
    assert dpo.activations == 2 * sft.activations and dpo.total > sft.total


def test_grpo_scores_completions_only_and_holds_generation():
    kw = dict(KW, batch_size=4, seq_len=48)
    full = estimate_training_memory(TINY, method="grpo", **kw)
    tail = estimate_training_memory(TINY, method="grpo", completion_len=16, **kw)
    sft = estimate_training_memory(TINY, **kw)
    assert tail.activations == full.activations == sft.activations
    chunked = estimate_training_memory(TINY, **dict(kw, batch_size=1, seq_len=4 * 16))  # 64 scored rows
    assert tail.logits_loss == chunked.logits_loss + 4 * 64 < full.logits_loss
    keep = dict(kw, activation_plan="keep")  # every layer kept: FastGRPOTrainer keeps the cache through training
    kept = estimate_training_memory(TINY, method="grpo", completion_len=16, **keep)
    held = generation_memory(SHAPE, 4, 48, 2, prompt_len=32, attention=tail.inputs["attention"]).held
    explicit = estimate_training_memory(TINY, method="grpo", completion_len=16, **keep,
                                        generation=dict(batch_size=4, max_len=48, prompt_len=32))
    assert kept.generation == explicit.generation >= held > 0 and kept.total == explicit.total
    bigger = estimate_training_memory(TINY, method="grpo", completion_len=16, **keep,
                                      generation=dict(batch_size=16, max_len=48, prompt_len=32))
    assert bigger.generation > kept.generation  # e.g. steps_per_generation > 1: a larger generation batch


def test_bad_method_and_completion_length_say_what_to_change():
    with pytest.raises(ValueError, match=r"method='ppo'; use one of \['sft', 'dpo', 'orpo', 'grpo'\]"):
        estimate_training_memory(TINY, method="ppo", **KW)
    with pytest.raises(ValueError, match="completion_len must be between 1 and seq_len=32"):
        estimate_training_memory(TINY, method="grpo", completion_len=40, **KW)


def test_model_panel_estimate_follows_the_training_method():
    from notebookkit.widgets.model_panel import ModelChoice, compute_estimate
    from notebookkit.widgets.training_panel import TrainingChoice

    model = ModelChoice(model_name=LLAMA8B, load_in_4bit=True, max_seq_length=1024)
    lora = SimpleNamespace(r=16, activation_mode="recompute")  # one fixed plan (auto would re-plan per method)
    sft = compute_estimate(model, lora, TrainingChoice(per_device_train_batch_size=2))
    dpo = compute_estimate(model, lora, TrainingChoice(per_device_train_batch_size=2, method="dpo"))
    assert dpo.estimate.inputs["method"] == "dpo" and dpo.estimate.inputs["rows"] == 4
    assert dpo.estimate.total > sft.estimate.total


def test_model_panel_draws_grpo_generation():
    from notebookkit.widgets.model_panel import ModelPanel

    panel = ModelPanel(model_name=LLAMA8B, load_in_4bit=True, max_seq_length=1024)
    from notebookkit.widgets.training_panel import TrainingPanel

    from notebookkit.widgets.lora_panel import LoRAPanel

    # every layer kept: the cache stays through training, drawn as its own bar part (it has a colour)
    panel.link(lora=LoRAPanel(use_gradient_checkpointing=False),
               training=TrainingPanel(method="grpo", per_device_train_batch_size=8))
    assert panel.last_result.estimate.inputs["generation"]["keep_cache"] is True
    assert panel.last_result.estimate.generation > 0
    panel.link(lora=LoRAPanel(use_gradient_checkpointing=True))  # recompute: freed after each generation
    assert panel.last_result.estimate.inputs["generation"]["keep_cache"] is False


def test_grpo_with_the_cache_freed_counts_only_the_larger_of_generating_and_training():
    from notebookkit.memory.generation import generation_term

    kw = dict(KW, batch_size=4, seq_len=48)
    gen = dict(batch_size=4, max_len=48, prompt_len=32)
    for plan in ("recompute", "offload", "keep"):
        kept = estimate_training_memory(TINY, method="grpo", completion_len=16, activation_plan=plan,
                                        generation=dict(gen, keep_cache=True), **kw)
        freed = estimate_training_memory(TINY, method="grpo", completion_len=16, activation_plan=plan,
                                         generation=dict(gen, keep_cache=False), **kw)
        default = estimate_training_memory(TINY, method="grpo", completion_len=16, activation_plan=plan, **kw)
        assert freed.total < kept.total and freed.generation < kept.generation
        assert default.total == (kept if plan == "keep" else freed).total  # FastGRPOTrainer's default rule
        transients = freed.activations + freed.logits_loss + freed.temporaries
        call = generation_memory(SHAPE, 4, 48, 2, prompt_len=32, attention=freed.inputs["attention"])
        assert freed.generation == max(0, call.total - transients)
        assert generation_term(dict(gen, keep_cache=False), SHAPE, 2, False, freed.inputs["attention"], 0)[0] \
            == call.total
    with pytest.raises(ValueError, match="keep_cache"):
        estimate_training_memory(TINY, method="grpo", generation=dict(gen, keep=False), **kw)
