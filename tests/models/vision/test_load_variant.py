"""The vision variant of the load pipeline hands ``generate`` its image-prompt preparation."""

from __future__ import annotations

import torch

from notebookkit.models import FastLanguageModel, FastVisionModel
from notebookkit.models.generation.generate import PREPARE_PROMPT
from notebookkit.models.vision.decode import multimodal_prefill


def test_a_loaded_vlm_carries_its_prompt_preparation_and_a_text_model_none(vlm_folder):
    model, _ = FastVisionModel.from_pretrained(vlm_folder("gemma3"), max_seq_length=64, dtype=torch.float32,
                                               load_in_4bit=False, fast_path=False, show_banner=False)
    assert model.__dict__[PREPARE_PROMPT] is multimodal_prefill  # stock code too: it is the load's, not the patch's
    text, _ = FastLanguageModel.from_pretrained("notebookkit/tiny-llama", max_seq_length=64, load_in_4bit=False,
                                                show_banner=False)
    assert PREPARE_PROMPT not in text.__dict__


def test_for_inference_attaches_it_to_a_wrapper_loaded_elsewhere(vlm_folder):
    import transformers as tf

    from .conftest import VISION

    wrapper = getattr(tf, VISION["gemma3"].model_class).from_pretrained(vlm_folder("gemma3"))
    assert PREPARE_PROMPT not in wrapper.__dict__
    FastVisionModel.for_inference(wrapper)
    assert wrapper.__dict__[PREPARE_PROMPT] is multimodal_prefill
