"""The VLM shape counts what the loaded tiny VLMs hold, vision tower and text decoder separately."""

from __future__ import annotations

import pytest
import torch

from notebookkit.memory import KNOWN_MODELS, model_shape
from notebookkit.memory.vision_shapes import KNOWN_VLMS, VLM_CONFIGS, is_vlm, vlm_shape

TINY = ["notebookkit/tiny-qwen2.5-vl", "notebookkit/tiny-gemma3-vision"]


def _is_vision(name: str) -> bool:
    return "language_model" not in name and not name.startswith("lm_head")


@pytest.fixture(scope="module", params=TINY)
def loaded(request):
    from notebookkit import FastVisionModel

    model, processor = FastVisionModel.from_pretrained(request.param, dtype=torch.float32, load_in_4bit=False,
                                                       show_banner=False)
    return request.param, model, processor


def test_parameter_counts_and_bytes_match_the_loaded_model(loaded):
    name, model, _ = loaded
    shape = vlm_shape(name)
    vision = {n: p for n, p in model.named_parameters() if _is_vision(n)}
    text = {n: p for n, p in model.named_parameters() if not _is_vision(n)}
    assert sum(p.numel() for p in vision.values()) == shape.vision.num_params
    assert sum(p.numel() for p in text.values()) == shape.text_params
    assert sum(p.numel() * p.element_size() for p in vision.values()) == 4 * shape.vision.num_params
    linear = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and _is_vision(n))
    assert linear == shape.vision.linear_params  # what load_in_4bit quantises in the tower


def test_image_tokens_per_image_match_the_processor(loaded, caption_rows_tiny):
    name, model, processor = loaded
    shape = vlm_shape(name)
    image = caption_rows_tiny[0]["image"].convert("RGB")
    out = processor.image_processor(images=[image], return_tensors="pt")
    patches, tokens = shape.image_grid(image.size[::-1])
    if "image_grid_thw" in out:  # Qwen2.5-VL: one row of pixel values per patch
        assert out["pixel_values"].shape[0] == patches
        assert int(out["image_grid_thw"].prod()) == patches
    assert tokens == 16 and shape.default_image_size == 64
    assert patches == 64


@pytest.fixture(scope="module")
def caption_rows_tiny():
    from notebookkit.embedded.bundled import load_bundled

    ds = load_bundled("captions")
    return [ds[i] for i in range(2)]


def test_curated_vlms_have_the_public_sizes():
    qwen = KNOWN_VLMS["Qwen/Qwen2.5-VL-7B-Instruct"]
    gemma = KNOWN_VLMS["google/gemma-3-4b-it"]
    # Hub model cards: 8,292,166,656 (Qwen2.5-VL-7B) and 4,300,079,472 (Gemma 3 4B) parameters.
    assert qwen.num_params == 8_292_166_656
    assert gemma.num_params == 4_300_079_472
    assert qwen.image_grid(448) == (1024, 256)
    assert gemma.image_grid() == (4096, 256) and gemma.image_grid(224) == (4096, 256)
    # the text decoder of the multimodal Gemma 3 is the curated text shape
    assert gemma.text.num_params == KNOWN_MODELS["google/gemma-3-4b-it"].num_params
    assert vlm_shape("qwen2.5-vl-7b") is qwen  # the benchmark's short names


def test_one_source_for_the_benchmark_shapes():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import vision_step

    assert vision_step.SHAPES is VLM_CONFIGS


def test_vlm_or_text():
    assert is_vlm("Qwen/Qwen2.5-VL-7B-Instruct") and is_vlm(TINY[0]) and is_vlm(KNOWN_VLMS["google/gemma-3-4b-it"])
    assert not is_vlm("google/gemma-3-4b-it")  # the curated text decoder (the text panel's entry)
    assert not is_vlm("meta-llama/Llama-3.2-1B-Instruct")
    from notebookkit.embedded.tiny import ensure_tiny_model

    folder = str(ensure_tiny_model(TINY[0]))
    assert is_vlm(folder)
    assert model_shape(folder).model_type == "qwen2_5_vl_text"  # the text model's view is unchanged


def test_unsupported_config_says_which_are_known():
    with pytest.raises(ValueError, match="Qwen2.5-VL.*Gemma 3"):
        vlm_shape({"model_type": "llava", "vision_config": {}, "hidden_size": 8})


def test_a_loaded_text_model_is_not_a_vlm():
    import torch.nn as nn

    class TextOnly(nn.Module):  # a model whose config names a VLM but which holds no vision tower
        config = {"model_type": "gemma3", "vision_config": {"hidden_size": 8}}

    assert not is_vlm(TextOnly())
    assert is_vlm(dict(TextOnly.config))
