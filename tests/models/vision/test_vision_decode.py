"""Generation of the tiny VLMs after ``FastVisionModel.for_inference``: image prompts on the fast decode steps.

Gemma 3: the prompt runs the model's own forward, the new tokens the fast decode step; the greedy
tokens must equal Hugging Face's ``generate`` on the same model (random LoRA, fp32, a left-padded
batch of different prompt lengths and images, plus a sliding window shorter than the prompt).
Qwen2.5-VL: the same, with the prompt's positions from the model's image grid and every decode step at
the per-row offset (``rope_deltas``) the prefill leaves. Text-only prompts run the fast path and equal
Hugging Face's tokens too.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from notebookkit import FastVisionModel
from notebookkit.models.generation import generation_state, is_bound

QUESTIONS = ["Describe this image.", "What colour is the shape in this small picture, and which shape is it?",
             "Shape?", "Describe this image in one sentence, please."]


def _model(folder: str, sliding_window: int | None = None):
    torch.manual_seed(0)
    model, processor = FastVisionModel.from_pretrained(folder, max_seq_length=256, dtype=torch.float32,
                                                       load_in_4bit=False, show_banner=False)
    if sliding_window is not None:  # shorter than the prompts: the prefill's sliding layers keep window - 1 keys
        text = model.config.get_text_config()
        text.sliding_window = sliding_window
        for layer in model.model.language_model.layers:
            if layer.self_attn.sliding_window is not None:
                layer.self_attn.sliding_window = sliding_window
    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False,
                                           show_banner=False)
    with torch.no_grad():  # adapters that change the answers, so the comparison covers the LoRA path
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model, processor


def _inputs(processor, rows, images: bool = True):
    messages = [[{"role": "user", "content": ([{"type": "image"}] if images else []) + [{"type": "text", "text": q}]}]
                for q in QUESTIONS[:len(rows)]]
    texts = [processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    processor.tokenizer.padding_side = "left"
    kwargs = dict(text=texts, return_tensors="pt", padding=True, add_special_tokens=False)
    if images:
        kwargs["images"] = [[r["image"]] for r in rows]
    return dict(processor(**kwargs))


def _hf_and_fast(model, inputs, new_tokens: int = 16):
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    model.eval()  # Hugging Face's generate: not bound before for_inference
    assert not is_bound(model)
    with torch.no_grad():
        reference = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    FastVisionModel.for_inference(model)
    assert is_bound(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    fallbacks = [str(w.message) for w in caught if "runs Hugging Face's generate" in str(w.message)]
    return reference, fast, fallbacks


@pytest.mark.parametrize("window", [None, 8], ids=["full", "window8"])
def test_gemma3_image_prompts_equal_hugging_face_on_the_fast_decode_steps(vlm_folder, caption_rows, window):
    model, processor = _model(vlm_folder("gemma3"), window)
    inputs = _inputs(processor, caption_rows(4, "eval"))
    assert inputs["attention_mask"].min() == 0  # left padding in the batch
    reference, fast, fallbacks = _hf_and_fast(model, inputs)
    assert not fallbacks, fallbacks
    assert generation_state(model).cache is not None  # the static cache was filled: the fast path ran
    new = reference[:, inputs["input_ids"].shape[1]:]
    assert len({tuple(r.tolist()) for r in new}) > 1, "the rows' answers must differ for the comparison to mean much"
    assert torch.equal(fast, reference)
    banner = model.notebookkit_banner
    assert banner.is_on("image prompts") and "model's own forward" in banner.line("image prompts")


def test_gemma3_prefill_without_the_images_differs(vlm_folder, caption_rows):
    """Negative control: the same prompts with the images' tokens but other images give other answers,
    so the equality above depends on the image features reaching the cache."""
    model, processor = _model(vlm_folder("gemma3"))
    FastVisionModel.for_inference(model)
    rows = caption_rows(4, "eval")
    def answers(rows):
        inputs = {k: v.to(model.device) for k, v in _inputs(processor, rows).items()}
        return model.generate(**inputs, max_new_tokens=16, do_sample=False)

    one, other = answers(rows), answers(rows[1:] + rows[:1])
    assert not torch.equal(one, other)


def test_qwen_image_prompts_equal_hugging_face_at_the_rope_offsets(vlm_folder, caption_rows, monkeypatch):
    """Qwen2.5-VL image prompts on the fast decode steps equal HF's generate; without the offsets they differ."""
    decode_loop = importlib.import_module("notebookkit.models.generation.generate")  # the module, not the function

    model, processor = _model(vlm_folder("qwen2"))
    inputs = _inputs(processor, caption_rows(3, "eval"))
    assert inputs["attention_mask"].min() == 0
    reference, fast, fallbacks = _hf_and_fast(model, inputs)
    assert not fallbacks, fallbacks
    assert generation_state(model).cache is not None
    deltas = generation_state(model).buffers[3].offset
    assert (deltas != 0).any(), "the image grid must move the positions for the test to mean much"
    new = reference[:, inputs["input_ids"].shape[1]:]
    assert len({tuple(r.tolist()) for r in new}) > 1
    assert torch.equal(fast, reference)
    assert model.notebookkit_banner.is_on("image prompts")

    real = decode_loop.cached_forward  # negative control: the decode steps without the offsets

    def no_offsets(*args, position_offsets=None, **kwargs):
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_loop, "cached_forward", no_offsets)
    generation_state(model).drop_cache()  # no graph captured with the offsets is replayed
    device_inputs = {k: v.to(model.device) for k, v in inputs.items()}
    assert not torch.equal(model.generate(**device_inputs, max_new_tokens=16, do_sample=False), reference)


def test_qwen_decode_tables_pass_positions_on_three_axes(vlm_folder, caption_rows, monkeypatch):
    """transformers 5.17's multimodal rotary module takes only ``[3, B, T]`` positions (later versions also
    ``[B, T]``): the decode steps' tables are built with one position per token on all three axes."""
    model, processor = _model(vlm_folder("qwen2"))
    rotary = model.get_base_model().model.language_model.rotary_emb
    stock = type(rotary).forward

    def three_axes_only(self, x, position_ids):
        if position_ids.dim() != 3:
            raise IndexError("too many indices for tensor of dimension 2")
        return stock(self, x, position_ids)

    monkeypatch.setattr(type(rotary), "forward", three_axes_only)
    reference, fast, fallbacks = _hf_and_fast(model, _inputs(processor, caption_rows(2, "eval")))
    assert not fallbacks, fallbacks
    assert torch.equal(fast, reference)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_text_only_prompts_run_the_fast_path(vlm_folder, caption_rows, family):
    model, processor = _model(vlm_folder(family))
    reference, fast, fallbacks = _hf_and_fast(model, _inputs(processor, caption_rows(3), images=False))
    assert not fallbacks, fallbacks
    assert torch.equal(fast, reference)


@pytest.mark.parametrize("start", ["training", "eval", "for_inference"])
def test_caption_replies_use_the_fast_path_and_restore_the_mode(vlm_folder, caption_rows, start, monkeypatch):
    from notebookkit.models.vision import decode as vision_decode
    from notebookkit.models.vision_generate import generate_vision_replies

    model, processor = _model(vlm_folder("gemma3"))
    if start == "eval":
        model.eval()
    elif start == "for_inference":
        FastVisionModel.for_inference(model)
    prefills = []
    real = vision_decode._hf_prefill
    monkeypatch.setattr(vision_decode, "_hf_prefill", lambda images, **kw: prefills.append(images) or real(images, **kw))
    rows = caption_rows(3, "eval")
    replies = generate_vision_replies(model, processor, rows, max_new_tokens=8)
    assert len(replies) == 3 and len(prefills) == 1  # one batch, its image prompt on the fast decode steps
    assert model.training == (start == "training")
    assert is_bound(model) == (start == "for_inference")
