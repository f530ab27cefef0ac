"""Shared fixtures: tiny models with non-zero LoRA adapters, loaded once per module."""

from __future__ import annotations

import pytest
import torch

from notebookkit import FastLanguageModel


def lora_model(family: str, load_in_4bit: bool, seed: int = 0, r: int = 8):
    """A tiny model of ``family`` with LoRA on all seven projections and random non-zero B."""
    model, tokenizer = FastLanguageModel.from_pretrained(f"notebookkit/tiny-{family}", load_in_4bit=load_in_4bit, show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=r, lora_alpha=16, show_banner=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    FastLanguageModel.for_inference(model)
    return model, tokenizer


@pytest.fixture(scope="module")
def llama_nf4():
    return lora_model("llama", load_in_4bit=True)
