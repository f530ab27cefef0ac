"""Panels construct headless, `.value` follows the widgets, the VRAM estimate follows the rank."""

import re
import warnings

import pytest

from notebookkit.widgets import ConfigPanels, LoRAPanel, ModelPanel, TrainingPanel


def _gib(text: str) -> float:
    m = re.search(r"Estimated peak VRAM: ([0-9.]+) (GiB|MiB)", text)
    assert m, text
    return float(m.group(1)) * (1 if m.group(2) == "GiB" else 1 / 1024)


def test_model_panel_overrides_and_value():
    p = ModelPanel(model_name="Qwen/Qwen3-4B", load_in_4bit=True, max_seq_length=4096, card="t4")
    v = p.value
    assert (v.model_name, v.load_in_4bit, v.max_seq_length, v.card) == ("Qwen/Qwen3-4B", True, 4096, "t4")
    assert v.from_pretrained_kwargs() == dict(model_name="Qwen/Qwen3-4B", max_seq_length=4096, dtype=None,
                                              load_in_4bit=True)
    p.weights.value = "16bit"  # the weight-format dropdown (tests/widgets/test_weight_formats.py)
    p.max_seq_length.value = 1024
    assert p.value.load_in_4bit is False and p.value.max_seq_length == 1024
    before = p.last_result.estimate.total
    p.offload_embedding.value = True  # Qwen3-4B ties its embedding to the LM head: nothing moves
    assert p.value.from_pretrained_kwargs()["offload_embedding"] is True
    assert p.last_result.estimate.total == before
    assert "nbk-vram-estimate" in p.estimate._dom_classes
    assert "Estimated peak VRAM" in p.estimate_text and "T4" in p.estimate_text
    with pytest.raises(TypeError, match="unknown settings"):
        ModelPanel(model="x")


def test_estimate_verdict_changes_with_model_and_card():
    p = ModelPanel(model_name="meta-llama/Llama-3.1-8B-Instruct", load_in_4bit=False, max_seq_length=2048, card="t4")
    assert "does not fit" in p.estimate_text
    p.card.value = "a100-80gb"
    assert re.search(r"— fits", p.estimate_text)
    p.model_name.value = "not/a-model-anyone-has"
    assert "unknown" in p.estimate_text


def test_lora_panel_value_and_fast_path_note():
    p = LoRAPanel(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    v = p.value
    assert (v.r, v.lora_alpha, v.target_modules, v.use_gradient_checkpointing) == (8, 16, ["q_proj", "v_proj"], "auto")
    assert "nbk-rank-slider" in p.rank._dom_classes
    assert p.note.value == ""
    p.dropout.value = 0.1
    assert "fast path" in p.note.value and not p.value.fast_path
    p.targets["o_proj"].value = True
    p.checkpointing.value = "offload"
    kw = p.value.peft_kwargs()
    assert kw["target_modules"] == ["q_proj", "v_proj", "o_proj"] and kw["use_gradient_checkpointing"] == "offload"
    assert LoRAPanel(use_gradient_checkpointing="unsloth").value.use_gradient_checkpointing == "offload"


def test_lora_panel_fp8_switch_follows_the_gpu(monkeypatch):
    """The FP8 forward can only be ticked where the GPU has FP8 tensor cores; elsewhere it is off and says why."""
    from notebookkit.widgets import lora_panel

    monkeypatch.setattr(lora_panel, "fp8_available", lambda: (False, "Tesla T4 (sm_75) has no FP8 tensor cores"))
    p = LoRAPanel(fp8_base_matmul=True)
    assert p.fp8.disabled and p.fp8.value is False and "sm_75" in p.fp8.tooltip
    assert p.value.peft_kwargs()["fp8_base_matmul"] is False
    assert "asked for but is off" in p.note.value and "sm_75" in p.note.value
    monkeypatch.setattr(lora_panel, "fp8_available", lambda: (True, "NVIDIA H200 (sm_90) has FP8 tensor cores."))
    p = LoRAPanel()
    assert not p.fp8.disabled and p.value.fp8_base_matmul is False
    p.fp8.value = True
    assert p.value.peft_kwargs()["fp8_base_matmul"] is True


def test_training_panel_value_and_epochs_switch():
    p = TrainingPanel(max_steps=30, per_device_train_batch_size=4, gradient_accumulation_steps=2, optim="adamw_torch")
    v = p.value
    assert (v.max_steps, v.per_device_train_batch_size, v.effective_batch_size) == (30, 4, 8)
    p.stop_by.value = "epochs"
    p.epochs.value = 2
    kw = p.value.trainer_kwargs()
    assert kw["max_steps"] == -1 and kw["num_train_epochs"] == 2
    p.learning_rate.value = 1e-4
    p.packing.value = True
    assert p.value.learning_rate == pytest.approx(1e-4) and p.value.packing


def test_rank_change_updates_vram_estimate_text():
    panels = ConfigPanels(model=dict(model_name="meta-llama/Llama-3.2-1B-Instruct", card="l4", max_seq_length=2048),
                          lora=dict(r=16, use_gradient_checkpointing=True), training=dict(per_device_train_batch_size=2))
    before = panels.model.estimate.value
    gib_before = _gib(panels.model.estimate_text)
    panels.lora.rank.value = 128
    assert panels.model.estimate.value != before
    assert _gib(panels.model.estimate_text) > gib_before
    # batch size in the training panel moves the estimate too
    gib_mid = _gib(panels.model.estimate_text)
    panels.training.batch_size.value = 8
    assert _gib(panels.model.estimate_text) > gib_mid
    v = panels.value
    assert v.lora.r == 128 and v.training.per_device_train_batch_size == 8
    assert panels.estimate.estimate.inputs["lora_r"] == 128


def test_tiny_model_estimate_on_cpu_changes_with_rank():
    panels = ConfigPanels(model=dict(model_name="notebookkit/tiny-llama", load_in_4bit=False, max_seq_length=256,
                                     card="auto"))
    before = panels.model.estimate_text
    assert "Estimated peak" in before
    panels.lora.rank.value = 64
    assert panels.model.estimate_text != before


def test_panels_render_as_widgets():
    panels = ConfigPanels()
    bundle = panels.model.widget._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    for cls in ("nbk-model-panel", "nbk-lora-panel", "nbk-training-panel"):
        assert any(cls in w.widget._dom_classes for w in (panels.model, panels.lora, panels.training))


def test_estimate_says_the_longest_sequence_for_the_card():
    from notebookkit.widgets.model_panel import ModelChoice, compute_estimate, estimate_html

    name = "meta-llama/Llama-3.1-8B-Instruct"
    longest = {card: compute_estimate(ModelChoice(name, True, 2048, None, card)).longest_seq for card in ("t4", "l4")}
    assert 2048 < longest["t4"] < longest["l4"]
    assert longest["t4"] == compute_estimate(ModelChoice(name, True, 8192, None, "t4")).longest_seq  # slider-independent
    text = estimate_html(compute_estimate(ModelChoice(name, True, 2048, None, "t4")))
    assert f"{longest['t4']:,} tokens" in text


def test_training_panel_preference_method():
    from trl import DPOConfig

    from notebookkit.train import ORPOConfig

    p = TrainingPanel(method="dpo", beta=0.2, max_steps=10, optim="adamw_torch")
    assert p.value.method == "dpo" and p.value.beta == pytest.approx(0.2)
    kw = p.value.trainer_kwargs()
    assert "packing" not in kw and "method" not in kw and kw["beta"] == pytest.approx(0.2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DPOConfig(output_dir="unused", use_cpu=True, **kw)  # every key is a DPOConfig field
    # TRL's configs default the Trainer's checkpointing on under its deprecated name; the panel passes the same
    # value under the name this transformers reads, so a notebook's config cell shows no FutureWarning
    assert not [w for w in caught if "gradient_checkpointing" in str(w.message)], [str(w.message) for w in caught]
    p.method.value = "orpo"
    p.beta.value = 0.5
    assert p.value.method == "orpo" and "ORPO" in p.summary.value
    ORPOConfig(output_dir="unused", use_cpu=True, **p.value.trainer_kwargs())
    assert p.packing not in p.widget.children  # packing is an SFT setting
    sft = TrainingPanel()
    assert sft.value.method == "sft" and "beta" not in sft.value.trainer_kwargs()
    assert sft.method not in sft.widget.children
    with pytest.raises(ValueError, match="method='ppo'"):
        TrainingPanel(method="ppo")


def test_training_panel_grpo_kl_beta():
    from trl import GRPOConfig

    p = TrainingPanel(method="grpo", beta=0.0, per_device_train_batch_size=16, gradient_accumulation_steps=1,
                      optim="adamw_torch")
    kw = p.value.trainer_kwargs()
    assert p.value.method == "grpo" and kw["beta"] == 0.0 and "packing" not in kw
    assert p.beta.description == "KL beta" and p.method not in p.widget.children
    assert "16 completions" in p.summary.value
    GRPOConfig(output_dir="unused", use_cpu=True, num_generations=8, **kw)


def test_training_panel_keeps_a_zero_learning_rate_until_the_slider_moves():
    p = TrainingPanel(learning_rate=0.0)
    assert p.value.learning_rate == 0.0 and p.value.trainer_kwargs()["learning_rate"] == 0.0
    assert "a control run, nothing trains" in p.summary.value
    p.learning_rate.value = 1e-4
    assert p.value.learning_rate == pytest.approx(1e-4) and "control run" not in p.summary.value


def test_offload_embedding_moves_an_untied_table_off_the_card():
    p = ModelPanel(model_name="meta-llama/Llama-3.1-8B-Instruct", load_in_4bit=True, max_seq_length=2048, card="t4")
    on_card = p.last_result.estimate
    p.offload_embedding.value = True
    moved = p.last_result.estimate
    assert on_card.base_weights - moved.base_weights == 128256 * 4096 * 2 and moved.inputs["offload_embedding"]
    assert "pinned host memory" in p.estimate_text
    # the "auto" plan spends the freed room: no fewer layers keep their activations than before
    assert moved.plan.count("keep") >= on_card.plan.count("keep") and moved.total <= p.last_result.budget_bytes


def test_dtype_dropdown_shows_a_choice_on_every_machine():
    """dtype=None ("auto", the default on a CPU) used to leave the Dropdown blank: its value None meant no selection."""
    from notebookkit.widgets.model_panel import ModelPanel

    auto = ModelPanel(model_name="notebookkit/tiny-llama", max_seq_length=512)
    assert auto.dtype.label == "auto" and auto.value.dtype is None
    half = ModelPanel(model_name="notebookkit/tiny-llama", max_seq_length=512, dtype="float16")
    assert half.dtype.label == "float16" and half.value.dtype == "float16"
