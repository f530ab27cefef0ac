"""TRL smoke tests on the fused path (tiny default, CPU): SFT, DPO, GRPO, and resume from a checkpoint."""

from __future__ import annotations

import pytest
import torch

from notebookkit.models import FastLanguageModel, patch_summary

from .helpers import tiny_folder

pytest.importorskip("trl")


def _model(family="llama", r=4, **kw):
    model, tok = FastLanguageModel.from_pretrained(
        tiny_folder(family), max_seq_length=64, load_in_4bit=False, show_banner=False
    )
    model = FastLanguageModel.get_peft_model(model, r=r, lora_alpha=8, show_banner=False, **kw)
    assert patch_summary(model)["attention"] == model.get_base_model().config.num_hidden_layers
    return model, tok


def _common(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False, fp16=False, seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    base.update(kw)
    return base


def _text_dataset(n=8):
    from datasets import Dataset

    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    return Dataset.from_list([{"text": " ".join(words[i % 8 :] + words[: i % 8])} for i in range(n)])


def _losses(trainer):
    return [round(h["loss"], 6) for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("packing", [False, True])
def test_sft_trainer(tmp_path, packing):
    from trl import SFTConfig, SFTTrainer

    model, tok = _model()
    args = SFTConfig(**_common(tmp_path, max_steps=3, max_length=48, packing=packing))
    trainer = SFTTrainer(model=model, args=args, train_dataset=_text_dataset(), processing_class=tok)
    trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    # still on the fused path after TRL set-up
    assert patch_summary(model)["attention"] == model.get_base_model().config.num_hidden_layers


def test_dpo_trainer(tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model, tok = _model()
    data = Dataset.from_list(
        [{"prompt": f"Q{i}: say yes.", "chosen": " yes yes", "rejected": " no no"} for i in range(4)]
    )
    args = DPOConfig(**_common(tmp_path, max_steps=2, max_length=32))
    trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    assert len(_losses(trainer)) == 2


def test_grpo_trainer(tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tok = _model()
    data = Dataset.from_list([{"prompt": f"Count to {i}:"} for i in range(4)])

    def reward_len(completions, **kwargs):
        return [float(len(c)) / 10.0 for c in completions]

    args = GRPOConfig(**_common(
        tmp_path, max_steps=2, num_generations=2, max_completion_length=6, generation_batch_size=2,
    ))
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    assert trainer.state.global_step == 2


def test_resume_from_checkpoint_gives_identical_losses(tmp_path):
    from trl import SFTConfig, SFTTrainer

    data = _text_dataset(12)
    kw = dict(max_steps=4, max_length=48, save_strategy="steps", save_steps=2, data_seed=0)
    model, tok = _model()
    full = SFTTrainer(model=model, args=SFTConfig(**_common(tmp_path / "a", **kw)), train_dataset=data, processing_class=tok)
    full.train()
    expected = _losses(full)

    model, tok = _model()
    resumed = SFTTrainer(model=model, args=SFTConfig(**_common(tmp_path / "a", **kw)), train_dataset=data, processing_class=tok)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    got = _losses(resumed)[-2:]  # the resumed log history starts with the checkpoint's own entries
    assert len(expected) == 4 and got == expected[2:], (got, expected)
