"""The VLM memory model against what the tiny VLMs really hold (CPU, fp32, the CUDA code paths).

Each tiny VLM is loaded through ``FastVisionModel`` (LoRA r=8 on the attention and MLP linears of the
vision tower and the decoder) and trained on one collated batch of two caption rows. Every storage
saved for backward is counted once (``activation_probe.saved_bytes_by_layer``), charged to the vision
tower (with its projector) or to a decoder layer, and compared with the estimate's parts.
"""

from __future__ import annotations

import pytest
import torch

from notebookkit.memory import estimate_training_memory, layer_activation_bytes
from notebookkit.memory.vision_estimate import vision_lora_param_count
from notebookkit.memory.vision_shapes import KNOWN_VLMS, vlm_shape

from .activation_probe import cuda_like, saved_bytes_by_layer

R = 8
#: the vision activations are exact per block, merger and projector; what is left is a few hundred
#: bytes of Qwen2.5-VL's window attention (its first block's log-sum-exp, cu_seqlens under
#: checkpointing): measured 0.02% (keep) and 0.13% (recompute) apart on the tiny model; Gemma 3 exact.
VISION_TOLERANCE = 0.005


def _towers(base):
    vision = base.model.visual if hasattr(base.model, "visual") else base.model.vision_tower
    extra = [base.model.multi_modal_projector] if hasattr(base.model, "multi_modal_projector") else []
    blocks = list(vision.blocks) if hasattr(vision, "blocks") else list(vision.encoder.layers)
    return vision, extra, blocks


def _load(name: str, checkpointing, vision_layers: bool = True):
    from notebookkit import FastVisionModel

    model, processor = FastVisionModel.from_pretrained(name, dtype=torch.float32, load_in_4bit=False,
                                                       show_banner=False)
    model = FastVisionModel.get_peft_model(model, r=R, lora_alpha=R, finetune_vision_layers=vision_layers,
                                           use_gradient_checkpointing=checkpointing, show_banner=False)
    return model.train(), processor


def _batch(model, processor):
    from notebookkit.data import VisionDataCollator
    from notebookkit.embedded.bundled import load_bundled

    ds = load_bundled("captions")
    return VisionDataCollator(model.get_base_model(), processor, max_seq_length=256)([ds[0], ds[1]])


def _measure(model, batch):
    base = model.get_base_model()
    vision, extra, blocks = _towers(base)
    layers = [vision, *extra, *base.model.language_model.layers]
    with cuda_like():
        saved = saved_bytes_by_layer(model, layers=layers, **batch)
    n_vision = 1 + len(extra)
    vision_bytes = sum(sum(saved.get(i, {}).values()) for i in range(n_vision))
    decoder = [sum(saved.get(n_vision + i, {}).values()) for i in range(len(base.model.language_model.layers))]
    return vision_bytes, decoder


TINY = ["notebookkit/tiny-qwen2.5-vl", "notebookkit/tiny-gemma3-vision"]


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["keep", "recompute"])
def test_saved_activations_match_the_estimate(name, checkpointing):
    model, processor = _load(name, checkpointing)
    batch = _batch(model, processor)
    rows, seq = batch["input_ids"].shape
    shape = vlm_shape(name)
    vision_bytes, decoder = _measure(model, batch)
    est = estimate_training_memory(name, dtype="float32", lora_r=R, batch_size=rows, seq_len=seq,
                                   activation_plan="recompute" if checkpointing else "keep", cuda_context_bytes=0)
    masks = est.details.get("activations: decoder attention masks (image tokens attend both ways)", 0)
    predicted = sum(v for k, v in est.details.items() if k.startswith("activations: vision"))
    assert predicted > 0 and vision_bytes > 0
    assert abs(predicted - vision_bytes) <= VISION_TOLERANCE * vision_bytes, (predicted, vision_bytes)
    # the decoder's sequence holds the image tokens: its layers save what the text formula says for it
    mode = "recompute" if checkpointing else "keep"
    # fp32 on CUDA (cuda_like): no flash kernel for grouped K/V, so SDPA saves them repeated to every head;
    # rows of different lengths are padded, and SDPA keeps its additive copy of the padding mask
    padded = bool((batch["attention_mask"] == 0).any())
    text = layer_activation_bytes(shape.text, mode, batch_size=rows, seq_len=seq, dtype_bytes=4, lora_r=R,
                                  kv_repeated=shape.text.kv_dim < shape.text.q_dim, padded=padded)
    if "gemma" in name and not checkpointing:
        # Gemma 3: the bidirectional mask (the estimate's two masks, one per attention type, each charged
        # to the first layer of its type) and that layer type's RoPE cos/sin (2*T*head_dim, left out)
        assert masks == 2 * rows * seq * seq * 4
        text += masks // 2 + 2 * seq * shape.text.head_dim * 4
    assert decoder[-1] == text
    assert est.inputs["image_tokens_per_row"] == 16


def _uneven_batch(processor, shape):
    """One row with an 80x48-pixel image, built by hand (the tiny processor resizes to 64x64): a 10x6
    patch grid, whose 4x4-patch windows leave shorter ones at the last row and column."""
    tok = processor.tokenizer
    patches, image_tokens = shape.vision.image_grid((80, 48))
    ids = (tok("a photo of", add_special_tokens=False)["input_ids"] + tok.convert_tokens_to_ids(
        ["<|vision_start|>"] + ["<|image_pad|>"] * image_tokens + ["<|vision_end|>"])
        + tok("a red circle", add_special_tokens=False)["input_ids"])
    ids = torch.tensor([ids])
    v = shape.vision
    torch.manual_seed(0)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone(),
                pixel_values=torch.randn(patches, v.in_channels * v.temporal_patch_size * v.patch_size**2),
                image_grid_thw=torch.tensor([[1, 10, 6]]))


def test_uneven_windows_are_gathered_and_the_estimate_follows():
    name = TINY[0]
    shape = vlm_shape(name)
    lengths = shape.vision.window_lengths((80, 48))
    assert lengths == [16, 8, 16, 8, 8, 4]  # not in decreasing order: the window blocks gather
    model, processor = _load(name, False)
    batch = _uneven_batch(processor, shape)
    vision_bytes, _ = _measure(model, batch)
    est = estimate_training_memory(name, dtype="float32", lora_r=R, batch_size=1, seq_len=batch["input_ids"].shape[1],
                                   image_size=(80, 48), activation_plan="keep", cuda_context_bytes=0)
    predicted = sum(v for k, v in est.details.items() if k.startswith("activations: vision"))
    assert abs(predicted - vision_bytes) <= VISION_TOLERANCE * vision_bytes, (predicted, vision_bytes)
    even = estimate_training_memory(name, dtype="float32", lora_r=R, batch_size=1, seq_len=batch["input_ids"].shape[1],
                                    image_size=(80, 64), activation_plan="keep", cuda_context_bytes=0)
    assert shape.vision.window_lengths((80, 64)) == [16, 16, 16, 16, 8, 8]  # in order: no gather
    assert even.details["activations: vision blocks (all saved)"] > est.details["activations: vision blocks (all saved)"]


@pytest.mark.parametrize("name", TINY)
def test_frozen_tower_saves_nothing(name):
    model, processor = _load(name, False, vision_layers=False)
    vision_bytes, _ = _measure(model, _batch(model, processor))
    assert vision_bytes == 0
    est = estimate_training_memory(name, dtype="float32", lora_r=R, batch_size=2, seq_len=80, activation_plan="keep",
                                   finetune_vision_layers=False)
    assert not any(k.startswith("activations: vision") and v for k, v in est.details.items())
    assert est.inputs["vision_lora_params"] == 0


@pytest.mark.parametrize("name", TINY)
def test_vision_lora_parameters_match_peft(name):
    model, _ = _load(name, False)
    vision = sum(p.numel() for n, p in model.named_parameters()
                 if "lora_" in n and "language_model" not in n)
    assert vision == vision_lora_param_count(vlm_shape(name), R)


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("switches", [dict(finetune_attention_modules=False), dict(finetune_mlp_modules=False),
                                      dict(finetune_language_layers=False)], ids=["mlp-only", "attention-only",
                                                                                   "vision-only"])
def test_partial_adapters_are_counted_as_adapted(name, switches):
    """The finetune_* switches adapt part of a tower: the estimate read off the model counts those
    adapters, not every linear (the PEFT config's names cover both towers)."""
    from notebookkit import FastVisionModel
    from notebookkit.memory.estimate import estimate_for_model, estimate_kwargs_from_model

    model, _ = FastVisionModel.from_pretrained(name, dtype=torch.float32, load_in_4bit=False, show_banner=False)
    model = FastVisionModel.get_peft_model(model, r=R, lora_alpha=R, use_gradient_checkpointing=False,
                                           show_banner=False, **switches)
    lora = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    vision = sum(p.numel() for n, p in lora if "language_model" not in n)
    decoder = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in lora if "language_model" in n}
    kwargs = estimate_kwargs_from_model(model)
    assert kwargs["vision_lora_params"] == vision
    if "finetune_language_layers" not in switches:  # half the tower's linears adapted, not all of them
        assert vision < vision_lora_param_count(vlm_shape(name), R)
    assert set(kwargs["target_modules"]) == decoder
    est = estimate_for_model(model, batch_size=1, seq_len=128)
    full = estimate_training_memory(name, dtype="float32", lora_r=R, batch_size=1, seq_len=128,
                                    activation_plan="keep", vision_lora_params=vision,
                                    target_modules=sorted(decoder))
    assert est.inputs["vision_lora_params"] == vision and est.adapters == full.adapters
    adapted = sum(p.numel() for _, p in lora)
    assert est.inputs["lora_params"] + vision == adapted  # every adapter counted once, none invented


def test_weights_of_the_vision_tower_in_4bit():
    """NF4 on the tower's linears (vision_loader quantises them, as transformers does), 16-bit elsewhere."""
    qwen = KNOWN_VLMS["Qwen/Qwen2.5-VL-7B-Instruct"]
    e16 = estimate_training_memory(qwen, load_in_4bit=False, seq_len=1024)
    e4 = estimate_training_memory(qwen, load_in_4bit=True, seq_len=1024)
    assert e16.details["base weights: vision tower linears"] == 2 * qwen.vision.linear_params
    nf4 = e4.details["base weights: vision tower linears (NF4)"]
    assert qwen.vision.linear_params * 0.5 < nf4 < qwen.vision.linear_params * 0.52
    text_only = estimate_training_memory("Qwen/Qwen2.5-VL-7B-Instruct", seq_len=1024)
    assert text_only.base_weights > estimate_training_memory(qwen.text, seq_len=1024).base_weights


def test_image_tokens_must_fit_in_the_sequence():
    with pytest.raises(ValueError, match="image tokens.*seq_len=200.*raise it"):
        estimate_training_memory("google/gemma-3-4b-it".replace("google/gemma-3-4b-it", "gemma-3-4b"), seq_len=200)


def test_text_estimates_are_unchanged_by_the_vision_keywords():
    a = estimate_training_memory("meta-llama/Llama-3.2-1B-Instruct", seq_len=1024)
    b = estimate_training_memory("meta-llama/Llama-3.2-1B-Instruct", seq_len=1024, images_per_row=3, image_size=896)
    assert a.as_dict() == b.as_dict() and "vision" not in a.inputs


def test_the_model_panel_estimates_a_vlm():
    from notebookkit.widgets.catalog import model_names, resolve_shape
    from notebookkit.widgets.model_panel import ModelChoice, compute_estimate

    assert "Qwen/Qwen2.5-VL-7B-Instruct" in model_names("Vision-language")
    assert resolve_shape("Qwen/Qwen2.5-VL-7B-Instruct") is KNOWN_VLMS["Qwen/Qwen2.5-VL-7B-Instruct"]
    res = compute_estimate(ModelChoice("Qwen/Qwen2.5-VL-7B-Instruct", True, 2048, None, "t4"))
    assert res.estimate is not None and res.estimate.inputs["vision"]
    assert res.estimate.details["base weights: vision tower linears (NF4)"] > 0
    # the vision notebook's CPU default (its panel's estimate)
    tiny = compute_estimate(ModelChoice(TINY[0], False, 512, None, "auto"))
    assert tiny.estimate is not None and tiny.estimate.inputs["image_tokens_per_row"] == 16
    from notebookkit.widgets.model_panel import _count, estimate_html

    shape = vlm_shape(TINY[0])  # the footnote counts both towers
    lora = tiny.estimate.inputs["lora_params"] + vision_lora_param_count(shape, 16)
    assert f"{_count(shape.num_params)} params, LoRA {_count(lora)} trainable" in estimate_html(tiny)
    assert _count(shape.num_params) != _count(shape.text.num_params)
    assert compute_estimate(ModelChoice("google/gemma-3-4b-it", True, 2048, None, "t4")).estimate.inputs.get(
        "vision") is None  # the catalog's Gemma 3 4B entry is its text decoder


@pytest.mark.parametrize("name", TINY)
def test_the_planner_of_a_loaded_vlm_uses_the_vlm_estimate(name):
    from notebookkit.memory import plan_activations
    from notebookkit.memory.estimate import estimate_for_model

    model, _ = _load(name, False)
    est = estimate_for_model(model, batch_size=2, seq_len=128)
    assert est.inputs["vision"] and est.inputs["finetune_vision_layers"] and est.inputs["image_size"] == 64
    assert est.inputs["vision_lora_params"] == vision_lora_param_count(vlm_shape(name), R)
    plan = plan_activations(model, card="t4", batch_size=2, seq_len=128)
    assert plan.estimate.inputs["vision"] and len(plan.modes) == 2
    frozen, _ = _load(name, False, vision_layers=False)
    assert estimate_for_model(frozen, batch_size=2, seq_len=128).inputs["finetune_vision_layers"] is False


@pytest.mark.parametrize("name", TINY)
def test_load_in_4bit_quantises_the_linears_the_shape_counts(name):
    """The loader's NF4 layers in the tower hold exactly the shape's linear weights (counted, never decoded)."""
    from notebookkit import FastVisionModel

    model, _ = FastVisionModel.from_pretrained(name, dtype=torch.float32, load_in_4bit=True, show_banner=False)
    quantised = [m for n, m in model.named_modules() if type(m).__name__ == "Linear4bit" and "language_model" not in n]
    elements = sum(m.weight.quant_state.shape.numel() for m in quantised)
    assert elements == vlm_shape(name).vision.linear_params
    packed = sum(m.weight.numel() * m.weight.element_size() for m in quantised)
    assert packed == elements // 2  # half a byte per weight; absmax on top, as the decoder's


def test_the_planner_charges_the_vision_recompute():
    """One checkpointed decoder layer checkpoints every vision block: the plan pays the tower's recompute."""
    from notebookkit.memory import plan_activations
    from notebookkit.memory.planner import _vision_recompute_seconds

    qwen = KNOWN_VLMS["Qwen/Qwen2.5-VL-7B-Instruct"]
    kw = dict(load_in_4bit=True, seq_len=1024, batch_size=2)
    plan = plan_activations(qwen, max_memory="t4", **kw)
    assert plan.counts()["keep"] < len(plan)  # the tower's kept activations do not fit a T4 with all layers kept
    assert plan.estimate.details["activations: vision block inputs (checkpointed)"] > 0
    vision = _vision_recompute_seconds(qwen, kw, plan.card)
    assert 0 < vision <= plan.extra_seconds
    frozen = plan_activations(qwen, max_memory="t4", finetune_vision_layers=False, **kw)
    assert frozen.counts()["keep"] == len(frozen) and _vision_recompute_seconds(qwen, dict(kw, finetune_vision_layers=False), None) == 0
