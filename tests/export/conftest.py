"""Shared fixtures: tiny models with non-zero LoRA adapters, loaded once per module."""

from __future__ import annotations

import pytest
import torch

from notebookkit import FastLanguageModel


def lora_model(family: str, load_in_4bit: bool, seed: int = 0, r: int = 8, **load):
    """A tiny model of ``family`` with LoRA on all seven projections and random non-zero B (``load``: more
    arguments of ``from_pretrained``, e.g. ``dtype``, ``device_map``)."""
    return lora_model_from(f"notebookkit/tiny-{family}", load_in_4bit, seed, r, **load)


def _with_random_lora(model, seed: int, r: int, target_modules=None):
    """``model`` with LoRA r=``r`` (on ``target_modules``, default all seven projections) and random non-zero B,
    ready for inference."""
    extra = {} if target_modules is None else {"target_modules": target_modules}
    model = FastLanguageModel.get_peft_model(model, r=r, lora_alpha=16, show_banner=False, **extra)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_B" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    FastLanguageModel.for_inference(model)
    return model


def lora_model_from(name: str, load_in_4bit: bool, seed: int = 0, r: int = 8, **load):
    """The model ``name`` (a tiny default or a folder) with LoRA on all seven projections and random non-zero B."""
    model, tokenizer = FastLanguageModel.from_pretrained(str(name), load_in_4bit=load_in_4bit, show_banner=False, **load)
    return _with_random_lora(model, seed, r), tokenizer


#: LoRA targets of the low-bit models: every projection but ``down_proj``, which stays a packed layer without
#: an adapter (the export writes it dense)
LOW_BIT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]


def low_bit_lora_model(name: str, base_format: str, seed: int = 0, r: int = 8):
    """The model ``name`` on a ``"2bit"`` or ``"ternary"`` base with LoRA on :data:`LOW_BIT_TARGETS` and random non-zero B."""
    flag = {"2bit": "load_in_2bit", "ternary": "load_in_ternary"}[base_format]
    model, tokenizer = FastLanguageModel.from_pretrained(str(name), show_banner=False, **{flag: True})
    return _with_random_lora(model, seed, r, LOW_BIT_TARGETS), tokenizer


def q2_k_sized_llama(folder) -> str:
    """tiny-llama's tokenizer and config widened so that every row is whole Q2_K blocks of 256 (hidden 256,
    MLP 512, 2 layers), random weights of std 0.02 (the config's ``initializer_range``): tiny-llama's rows
    of 128 and 384 are not, and llama.cpp's q2_k quantiser writes them as Q4_0. Saved in ``folder`` once."""
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from notebookkit.embedded.tiny import ensure_tiny_model

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        source = ensure_tiny_model("notebookkit/tiny-llama")
        config = AutoConfig.from_pretrained(source)
        config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.head_dim = 256, 512, 2, 64
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:  # norms: not all ones
                    p.add_(0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.02)
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: the tiny models' matmuls are small, and on a shared 2-core machine two
    threads mostly wait on each other (a forward measured 12x slower with two under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama_nf4():
    return lora_model("llama", load_in_4bit=True)
