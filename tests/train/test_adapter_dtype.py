"""fp16 mixed precision needs fp32 adapters; TRL casts a quantised model's adapters to bf16.

The premise is checked on TRL itself (so the test says when a TRL release stops doing it), then the
fix on notebookkit's trainer: ``FastSFTTrainer`` with ``fp16`` on leaves every trainable parameter
fp32. fp16 Trainer arguments need a GPU, so the trainer part sets the flag after construction and
calls the same function the constructor calls; the GPU notebook test
(tests/notebooks/test_notebooks_gpu.py::test_chat_sft_t4_emulation_fp16_under_15_gib) runs it end to end.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("trl")

from notebookkit.models import FastLanguageModel  # noqa: E402
from notebookkit.train.adapter_dtype import keep_fp32_adapters_under_fp16  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _qlora():
    model, tok = FastLanguageModel.from_pretrained(
        "notebookkit/tiny-llama", max_seq_length=64, load_in_4bit=True, show_banner=False
    )
    return FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, show_banner=False), tok


def _trainable_dtypes(model) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters() if p.requires_grad}


def _trainer(cls, model, tok, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig

    data = Dataset.from_list([{"text": "one two three four"}] * 4)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to=[], per_device_train_batch_size=2,
                     bf16=False, fp16=False)
    return cls(model=model, args=args, train_dataset=data, processing_class=tok)


def test_trl_casts_quantised_adapters_to_bf16(tmp_path):
    from trl import SFTTrainer

    model, tok = _qlora()
    assert _trainable_dtypes(model) == {torch.float32}
    trainer = _trainer(SFTTrainer, model, tok, tmp_path)
    assert _trainable_dtypes(trainer.model) == {torch.bfloat16}, "TRL no longer casts: the fix may be unneeded"


def test_fp16_trainer_gets_fp32_adapters_back(tmp_path):
    from notebookkit.train.sft import FastSFTTrainer

    model, tok = _qlora()
    trainer = _trainer(FastSFTTrainer, model, tok, tmp_path)
    assert _trainable_dtypes(trainer.model) == {torch.bfloat16}  # fp16 off here (CPU): TRL's choice stays
    frozen = {n: (p.dtype, p.data_ptr()) for n, p in trainer.model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.args = types.SimpleNamespace(fp16=True)
    assert keep_fp32_adapters_under_fp16(trainer) == len(before)
    after = dict(trainer.model.named_parameters())
    assert _trainable_dtypes(trainer.model) == {torch.float32}
    assert all(torch.equal(after[n].detach(), before[n]) for n in before)  # same values, wider type
    assert {n: (p.dtype, p.data_ptr()) for n, p in after.items() if not p.requires_grad} == frozen
    assert keep_fp32_adapters_under_fp16(trainer) == 0  # already fp32
    trainer.args = types.SimpleNamespace(fp16=False)
    assert keep_fp32_adapters_under_fp16(trainer) == 0
