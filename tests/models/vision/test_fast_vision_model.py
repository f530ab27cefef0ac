"""FastVisionModel: what is patched (and reversibly), which layers get adapters, the banner, the
multimodal-RoPE check, training/inference modes, saving and reloading an adapter, and the errors."""

from __future__ import annotations

import pytest
import torch

from notebookkit.models import FastVisionModel
from notebookkit.models.vision.patcher import patch_vision_model, rope_table_problem
from notebookkit.models.patching.patcher import patch_summary, unpatch_model
from notebookkit.models.vision.targets import kind_of, select_targets, tower_of

from .conftest import VISION

FAMILIES = list(VISION)
# fused modules per tiny VLM: decoder norms / MLPs / attentions, plus the vision tower's norms, MLPs and
# (Qwen2.5-VL) window attentions
EXPECTED = {
    "qwen2": {"rms_norm": 2 * 2 + 1 + 2 * 2 + 1, "mlp": 2 + 2, "attention": 2, "vision_attention": 2,
              "causal_lm": 1},
    "gemma3": {"rms_norm": 2 * 6 + 1 + 1, "mlp": 2, "attention": 2, "causal_lm": 1},
}


def _load(folder: str, **kw):
    return FastVisionModel.from_pretrained(folder, max_seq_length=128, dtype=torch.float32,
                                           load_in_4bit=kw.pop("load_in_4bit", False), show_banner=False, **kw)


def _batch(processor, rows, with_labels: bool = True) -> dict:
    """Processor inputs of caption rows; labels on every non-padding token (the collator has its own tests)."""
    texts = [processor.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    batch = dict(processor(text=texts, images=[[r["image"]] for r in rows], return_tensors="pt", padding=True,
                           add_special_tokens=False))
    if with_labels:
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_parts_and_banner(family, vlm_folder):
    model, _ = _load(vlm_folder(family))
    assert patch_summary(model) == EXPECTED[family]
    banner = model.notebookkit_banner
    for line in ("RMSNorm", "MLP", "attention", "fused CE loss", "vision tower"):
        assert banner.is_on(line), str(banner)
    if VISION[family].rope == "mrope":
        assert "multimodal RoPE" in banner.line("attention")
    if VISION[family].tower_attention == "segments":
        assert "2 window/image attentions on the RoPE kernel" in banner.line("vision tower")
    else:
        assert "attention, LayerNorms and plain MLPs run stock" in banner.line("vision tower")


@pytest.mark.parametrize("family", FAMILIES)
def test_patching_changes_no_output_and_is_reversible(family, vlm_folder, caption_rows):
    """Patched and stock forwards on the same weights: logits (eval) and the training loss agree."""
    model, processor = _load(vlm_folder(family))
    batch = _batch(processor, caption_rows(2))
    model.eval()
    with torch.no_grad():
        fused = model(**batch).logits
    model.train()
    fused_loss = model(**batch).loss
    assert model(**batch).logits is None  # training with labels: no full logits
    assert unpatch_model(model) == sum(EXPECTED[family].values())
    assert patch_summary(model) == {}
    model.eval()
    with torch.no_grad():
        stock = model(**batch).logits
    model.train()
    stock_loss = model(**batch).loss
    assert (fused - stock).abs().max() <= 1e-5 * stock.abs().max()
    assert abs(fused_loss.item() - stock_loss.item()) <= 1e-5 * stock_loss.item()


def test_multimodal_rope_that_is_not_one_table_per_token_stays_stock(vlm_folder):
    model, _ = _load(vlm_folder("qwen2"))
    language = model.model.language_model
    assert rope_table_problem(language) is None
    unpatch_model(model)
    rotary = language.rotary_emb

    def three_tables(x, position_ids):  # what a transformers composing the sections in attention would give
        cos = torch.ones(3, position_ids.shape[1], position_ids.shape[2], 32)
        return cos, cos

    object.__setattr__(rotary, "forward", three_tables)
    problem = rope_table_problem(language)
    assert "shape (3, 1, 2, 32)" in problem
    banner = patch_vision_model(model)
    assert not banner.is_on("attention") and "multimodal RoPE not on the kernel" in banner.line("attention")
    assert patch_summary(model).get("attention") is None and patch_summary(model)["mlp"] == 4


@pytest.mark.parametrize("family", FAMILIES)
def test_the_switches_pick_the_layers(family, vlm_folder):
    import transformers as tf

    vision = VISION[family]
    model = getattr(tf, vision.model_class).from_pretrained(vlm_folder(family))
    every = select_targets(model, vision)
    assert every.names and all(tower_of(n, vision) and kind_of(n) for n in every.names)
    assert not any(n.startswith("lm_head") for n in every.names)
    for v, lang, attn, mlp in [(True, False, True, True), (False, True, True, False), (True, True, False, True)]:
        picked = select_targets(model, vision, v, lang, attn, mlp)
        assert picked.names == [n for n in every.names if {"vision": v, "language": lang}[tower_of(n, vision)]
                                and {"attention": attn, "MLP": mlp}[kind_of(n)]]
        assert picked.names
    language = select_targets(model, vision, False, True, True, True).names
    assert len(language) == 7 * model.config.get_text_config().num_hidden_layers


@pytest.mark.parametrize("family", FAMILIES)
def test_get_peft_model_adapts_both_towers_and_trains(family, vlm_folder, caption_rows):
    model, processor = _load(vlm_folder(family))
    peft = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False,
                                          show_banner=False)
    names = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert any(VISION[family].vision_tower.split(".")[-1] in n for n in names)
    assert any("language_model" in n for n in names)
    banner = peft.notebookkit_banner
    assert banner.is_on("LoRA fast path") and "vision:" in banner.header[-1] and "language:" in banner.header[-1]
    assert peft.training and not peft.get_base_model().config.get_text_config().use_cache
    batch = _batch(processor, caption_rows(2))
    peft(**batch).loss.backward()
    assert all(p.grad is not None for n, p in peft.named_parameters() if "lora_B" in n)


def test_the_pair_is_not_the_model(vlm_folder):
    pair = _load(vlm_folder("gemma3"))
    with pytest.raises(TypeError, match=r"is a tuple \(Gemma3ForConditionalGeneration, Gemma3Processor\), not a "
                                        r"model.*`model, processor = FastVisionModel.from_pretrained"):
        FastVisionModel.get_peft_model(pair)


@pytest.mark.parametrize("kw, match", [
    (dict(finetune_vision_layers=False, finetune_language_layers=False), "both False, so no layer"),
    (dict(finetune_attention_modules=False, finetune_mlp_modules=False), "both False, so no layer"),
    (dict(r=0), "r=0 is not a positive whole number"),
])
def test_bad_arguments_leave_the_model_unchanged(kw, match, vlm_folder):
    model, _ = _load(vlm_folder("gemma3"))
    with pytest.raises(ValueError, match=match):
        FastVisionModel.get_peft_model(model, show_banner=False, **kw)
    assert not hasattr(model, "peft_config")


def test_a_text_model_is_refused_with_the_supported_list():
    with pytest.raises(ValueError, match=r"(?s)'notebookkit/tiny-qwen3' has model_type 'qwen3', which has no vision "
                                         r"support.*qwen2_5_vl .*Qwen/Qwen2.5-VL-7B-Instruct.*FastLanguageModel"):
        FastVisionModel.from_pretrained("notebookkit/tiny-qwen3", show_banner=False)


def test_generate_save_and_reload_the_adapter(vlm_folder, caption_rows, tmp_path):
    model, processor = _load(vlm_folder("qwen2"))
    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False,
                                           show_banner=False)
    batch = _batch(processor, caption_rows(2))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    FastVisionModel.for_inference(model)
    assert not model.training and model.get_base_model().config.get_text_config().use_cache
    prompt = [processor.apply_chat_template(r["messages"][:1], tokenize=False, add_generation_prompt=True)
              for r in caption_rows(2)]
    inputs = processor(text=prompt, images=[[r["image"]] for r in caption_rows(2)], return_tensors="pt",
                       padding=True, add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape == (2, inputs["input_ids"].shape[1] + 3)
    with torch.no_grad():
        before = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    model.save_pretrained(tmp_path / "adapter")
    processor.save_pretrained(tmp_path / "adapter")
    again, processor2 = FastVisionModel.from_pretrained(str(tmp_path / "adapter"), max_seq_length=128,
                                                       dtype=torch.float32, load_in_4bit=False, show_banner=False)
    FastVisionModel.for_inference(again)
    with torch.no_grad():
        after = again(**{k: v for k, v in batch.items() if k != "labels"}).logits
    assert (before - after).abs().max() <= 1e-5 * before.abs().max()
    assert again.notebookkit_banner.is_on("LoRA fast path")
    # the reloaded tower's adapters run the LoRA projection kernels, as after get_peft_model
    assert patch_summary(again)["lora_linear"] == patch_summary(model)["lora_linear"] > 0
    assert again.notebookkit_banner.is_on("vision LoRA")
    FastVisionModel.for_training(again)
    assert again.training and not again.get_base_model().config.get_text_config().use_cache


def test_a_batch_longer_than_max_seq_length_is_refused_in_training(vlm_folder, caption_rows):
    model, processor = FastVisionModel.from_pretrained(vlm_folder("gemma3"), max_seq_length=32, dtype=torch.float32,
                                                       load_in_4bit=False, show_banner=False)
    model.train()
    with pytest.raises(ValueError, match=r"sequences of 6\d tokens \(image tokens included\), longer than "
                                         r"max_seq_length=32 given to FastVisionModel.from_pretrained"):
        model(**_batch(processor, caption_rows(1)))
