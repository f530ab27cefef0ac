"""The tiny vision-language models of the embedded default: names, versions, determinism, processor,
chat template and the image-token budget they promise (16 features for a 64x64 image)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from notebookkit.embedded import generate_vision_models as gv
from notebookkit.embedded import tiny
from notebookkit.families import FAMILIES, for_model_type, for_vision_model_type, vision_families

from .conftest import VISION

NAMES = list(VISION)
CHAT = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A large red star on a white background."}]},
]


def test_vision_rows_are_in_the_record():
    assert set(vision_families()) == {"qwen2_5_vl", "gemma3"}
    for family in vision_families().values():
        vision = family.vision
        assert for_vision_model_type(vision.model_type) is family
        assert vision.model_type in family.multimodal_model_types
        assert for_model_type(vision.model_type) is None  # the text patcher never half-patches a wrapper
        assert for_model_type(vision.text_model_type, multimodal=True) is family
        assert vision.image_token in vision.image_tokens
        assert vision.image_tokens[0] in vision.tokenizer_template  # the template renders an image part
        assert set(vision.tiny.token_ids.values()) <= set(vision.image_tokens)
    assert FAMILIES["llama"].vision is None


def test_reserved_names_resolve_and_are_versioned_apart():
    assert set(tiny.TINY_VISION_MODELS) == {"notebookkit/tiny-qwen2.5-vl", "notebookkit/tiny-gemma3-vision"}
    assert not set(tiny.TINY_VISION_MODELS) & set(tiny.TINY_MODELS)  # the text consumers see text models only
    assert tiny.is_tiny_vision_model_name("NotebookKit/Tiny-Qwen2.5-VL")
    folder = tiny.tiny_model_folder("notebookkit/tiny-qwen2.5-vl")
    assert folder.name == f"tiny-qwen2.5-vl-{tiny.vision_model_version()}"
    assert tiny.vision_model_version() != tiny.model_version()
    with pytest.raises(tiny.UnknownTinyModelError, match="tiny-gemma3-vision .*FastVisionModel"):
        tiny.resolve_model_name("notebookkit/tiny-gemma3-vl")


@pytest.mark.parametrize("family", NAMES)
def test_folder_loads_as_a_hub_checkpoint(family, vlm_folder):
    import transformers as tf
    from transformers import AutoConfig

    from notebookkit.models.common.banner import Banner
    from notebookkit.models.vision.processor import load_processor

    folder = Path(vlm_folder(family))
    vision = VISION[family]
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == vision.model_type and config.architectures == [vision.model_class]
    text = config.get_text_config()
    assert text.model_type == vision.text_model_type and text.num_hidden_layers == FAMILIES[family].tiny.layers
    processor = load_processor(str(folder), vision, Banner())
    ids = [processor.tokenizer.convert_tokens_to_ids(t) for t in vision.image_tokens]
    assert ids == list(range(2048, 2048 + len(ids)))  # appended after the shared vocabulary
    assert text.vocab_size == 2048 + len(ids)
    rendered = processor.apply_chat_template(CHAT, tokenize=False)
    assert "Describe this image." in rendered and "A large red star" in rendered
    from notebookkit.embedded.generate_datasets import draw_shape

    image = draw_shape("star", "red", "white", "large", "in the middle")
    batch = processor(text=[rendered], images=[[image]], return_tensors="pt", add_special_tokens=False)
    image_id = processor.tokenizer.convert_tokens_to_ids(vision.image_token)
    assert int((batch["input_ids"] == image_id).sum()) == 16
    model = getattr(tf, vision.model_class).from_pretrained(folder)
    out = model(**batch)
    assert out.logits.shape[-1] == text.vocab_size and out.logits.isfinite().all()


def test_rebuild_gives_the_same_bytes(tmp_path):
    from notebookkit.embedded.tiny import MODEL_SEED, load_base_tokenizer

    base = load_base_tokenizer()
    digests = []
    for i in range(2):
        folder = tmp_path / f"build{i}"
        gv.build_vision_model_folder("gemma3", folder, base, MODEL_SEED)
        digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())})
    assert digests[0] == digests[1]
    projector = json.loads((tmp_path / "build0" / "processor_config.json").read_text())
    assert projector["processor_class"] == "Gemma3Processor" and projector["image_seq_length"] == 16


def test_gemma3_projection_is_not_left_at_zero():
    """transformers initialises Gemma 3's projection into the decoder to zero: no image would reach it."""
    ids = {"bos_token_id": 2, "config_eos_token_id": 1, "pad_token_id": 0}
    image_ids = {t: 2048 + i for i, t in enumerate(VISION["gemma3"].image_tokens)}
    model = gv.build_random_vision_model("gemma3", 2051, ids, image_ids, seed=0)
    weight = model.model.multi_modal_projector.mm_input_projection_weight.detach()
    assert abs(float(weight.std()) - VISION["gemma3"].tiny.redraw_std) < 0.01


def test_a_family_without_vision_is_named():
    with pytest.raises(ValueError, match="llama family has no vision-language model.*qwen2, gemma3"):
        gv.vision_row("llama")


def test_the_build_table_lists_the_vision_models(vlm_folder):
    from notebookkit.embedded import cli

    models = []
    for name in tiny.TINY_VISION_MODELS:
        info = tiny.tiny_model_info(name)
        info["cached"] = True
        models.append(info)
    table = cli.format_report({"models": models, "datasets": [], "parts": {}, "seconds": 0.0})
    assert "notebookkit/tiny-qwen2.5-vl " in table and "vision-language (qwen2_5_vl)" in table
    [gemma_line] = [line for line in table.splitlines() if "tiny-gemma3-vision" in line]
    assert "pre-trained 440 steps" in gemma_line and gemma_line.endswith("vision-language (gemma3)")
    gemma = next(m for m in models if m["vision"] == "gemma3-vision")
    assert gemma["pretrained"] and gemma["pretrain"]["heldout_loss_after"] < gemma["pretrain"]["heldout_loss_before"]
