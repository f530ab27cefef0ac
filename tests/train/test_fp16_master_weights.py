"""fp16 training: every trainable parameter is an fp32 master weight, whatever made it trainable and whichever
trainer runs the step (notebookkit/models/patching/master_weights.py, applied in the model's training forward).

An optimizer step is run as Hugging Face's Trainer runs it under ``fp16=True``: the optimizer is built first,
then the forward, the backward of the scaled loss and ``GradScaler.unscale_``, which refuses fp16 gradients
("Attempting to unscale FP16 gradients": the check is the same on every device, so a CPU shows it). Each path
makes something trainable the way the notebooks do: the trainers' own construction (TRL casts a quantised
model's adapters to bf16) and ``train_token_rows`` (the GRPO notebook's priming and GRPO runs), which makes the
fp16 embedding trainable after the trainer was built. On b043a28 every case here failed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from notebookkit.models import FastLanguageModel  # noqa: E402
from notebookkit.train import train_token_rows  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _fp16_lora(four_bit: bool = True):
    model, tok = FastLanguageModel.from_pretrained("notebookkit/tiny-llama", max_seq_length=64, dtype="float16",
                                                   load_in_4bit=four_bit, show_banner=False)
    return FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, show_banner=False), tok


def _scaled_step(model, batch: dict) -> None:
    """One fp16 optimizer step in the Trainer's order; raises where the scaler refuses the gradients."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    model.train()
    loss = model(**batch).loss
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}


def _text_batch(tok) -> dict:
    ids = tok(["one two three four five six"] * 2, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "labels": ids.clone()}


def _trainer(kind: str, model, tok, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, GRPOConfig, SFTConfig, SFTTrainer

    from notebookkit.train import FastDPOTrainer, FastGRPOTrainer, FastORPOTrainer, ORPOConfig, format_reward
    from notebookkit.train import make_sft_trainer

    common = dict(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, bf16=False, fp16=False)
    text = Dataset.from_list([{"text": "one two three four"}] * 4)
    pairs = Dataset.from_list([{"prompt": "Sky?", "chosen": "Blue.", "rejected": "Green."}] * 2)
    if kind == "make_sft_trainer":
        return make_sft_trainer(model, tok, text, max_steps=1, report_to=[], use_cpu=True, bf16=False, fp16=False,
                                output_dir=str(tmp_path), show_banner=False)
    if kind == "trl_sft":
        return SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=text, processing_class=tok)
    if kind == "grpo":
        args = GRPOConfig(**common, per_device_train_batch_size=2, num_generations=2, max_completion_length=4)
        return FastGRPOTrainer(model=model, reward_funcs=[format_reward], args=args, processing_class=tok,
                               train_dataset=Dataset.from_list([{"prompt": "Sky?"}] * 2), show_banner=False)
    cls, config = (FastDPOTrainer, DPOConfig) if kind == "dpo" else (FastORPOTrainer, ORPOConfig)
    return cls(model=model, args=config(**common, max_length=32), train_dataset=pairs, processing_class=tok,
               show_banner=False)


@pytest.mark.parametrize("kind", ["make_sft_trainer", "trl_sft", "dpo", "orpo", "grpo"])
def test_every_trainer_steps_in_fp16_with_token_rows_trained(tmp_path, kind):
    model, tok = _fp16_lora()
    trainer = _trainer(kind, model, tok, tmp_path)
    embedding = trainer.model.get_input_embeddings()
    with train_token_rows(trainer.model, [5, 7]):
        _scaled_step(trainer.model, _text_batch(tok))
        assert embedding(torch.tensor([[5]])).dtype == torch.float16  # the layers above still get fp16 rows
    assert embedding.weight.dtype == torch.float16 and not embedding.weight.requires_grad  # given back as it was


def test_generation_between_steps_inside_the_token_rows_block():
    """GRPO generates inside the ``with`` block, with the table an fp32 master: the decode path keeps fp16
    (its KV cache dtype is the model's, the tied head takes fp16 hidden states)."""
    model, tok = _fp16_lora(four_bit=False)
    batch = _text_batch(tok)
    with train_token_rows(model, [5, 7]):
        _scaled_step(model, batch)
        FastLanguageModel.for_inference(model)
        out = model.generate(input_ids=batch["input_ids"][:1, :4], max_new_tokens=3, do_sample=False)
        FastLanguageModel.for_training(model)
        _scaled_step(model, batch)
    assert out.shape == (1, 7)
    FastLanguageModel.for_inference(model)  # the table is fp16 again, its hooks stay: they must follow it
    assert model.generate(input_ids=batch["input_ids"][:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)


def test_adapters_cast_to_16_bit_after_preparation_train_as_fp32():
    """TRL's cast (a quantised model's adapters to bf16), done after get_peft_model, is undone at the first
    training forward; values are kept exactly, frozen weights are not touched."""
    model, tok = _fp16_lora()
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters() if not p.requires_grad}
    with torch.no_grad():
        model.train()(**_text_batch(tok))  # no gradients: not a training forward, nothing is cast
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.bfloat16}
    model.train()(**_text_batch(tok))
    after = dict(model.named_parameters())
    assert all(after[n].dtype == torch.float32 and torch.equal(after[n].detach(), before[n]) for n in before)
    assert {n: (p.dtype, p.data_ptr()) for n, p in after.items() if not p.requires_grad} == frozen


def test_bf16_models_keep_their_trainable_dtype():
    model, tok = FastLanguageModel.from_pretrained("notebookkit/tiny-llama", max_seq_length=64, dtype="bfloat16",
                                                   load_in_4bit=False, show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, show_banner=False)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    model.train()(**_text_batch(tok))
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.bfloat16}


def test_plain_peft_model_with_the_hook(tmp_path):
    """The calibration's plain-PEFT side (a model notebookkit did not patch) under TRL's SFTTrainer."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from notebookkit.embedded.tiny import resolve_model_name
    from notebookkit.models.patching.master_weights import hold_fp32_masters

    _, tok = _fp16_lora(four_bit=False)
    plain = AutoModelForCausalLM.from_pretrained(resolve_model_name("notebookkit/tiny-llama"), dtype=torch.float16)
    plain = get_peft_model(plain, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for p in plain.parameters():
        if p.requires_grad:
            p.data = p.data.half()
    hold_fp32_masters(plain)
    trainer = SFTTrainer(model=plain, processing_class=tok, train_dataset=Dataset.from_list([{"text": "a b"}] * 2),
                         args=SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True))
    _scaled_step(trainer.model, _text_batch(tok))


def test_vision_model_steps_in_fp16():
    from notebookkit import FastVisionModel
    from notebookkit.data.vision_collator import VisionDataCollator
    from notebookkit.data.bundled import load_bundled

    model, processor = FastVisionModel.from_pretrained("notebookkit/tiny-qwen2.5-vl", dtype="float16",
                                                       load_in_4bit=False, show_banner=False)
    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, show_banner=False)
    for p in model.parameters():  # as TRL leaves a quantised model's adapters
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    rows = [load_bundled("captions")[i] for i in range(2)]
    batch = dict(VisionDataCollator(model, processor)(rows))
    _scaled_step(model, batch)
