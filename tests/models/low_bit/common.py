"""Shared pieces of the low-bit model tests: small checkpoints of each family whose projections a
2-bit base can hold (widths multiples of 64), loading them, and the dense twin the fused path is
compared against."""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

from notebookkit.models import FastLanguageModel, unpatch_model
from notebookkit.base_layers.low_bit_linear import is_low_bit_linear

from ..helpers import byte_tokenizer, random_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FLAGS = {"2bit": "load_in_2bit", "ternary": "load_in_ternary"}
_CACHE = Path(os.environ.get("NOTEBOOKKIT_TEST_MODELS", tempfile.gettempdir())) / "notebookkit-low-bit-tests"


def checkpoint(family: str, **overrides) -> str:
    """A saved 16-bit random ``family`` model (hidden 64, MLP 128 unless overridden) with a byte tokenizer."""
    overrides.setdefault("intermediate_size", 128)
    tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    path = _CACHE / f"{family}-{tag}"
    if not (path / "model.safetensors").is_file():
        path.mkdir(parents=True, exist_ok=True)
        random_model(family, **overrides).save_pretrained(path)
        byte_tokenizer().save_pretrained(path)
    return str(path)


def load(path: str, base_format: str | None = None, **kw):
    kw.setdefault("max_seq_length", 64)
    kw.setdefault("dtype", torch.float32)
    if base_format is not None:
        kw[FLAGS[base_format]] = True
    return FastLanguageModel.from_pretrained(path, show_banner=False, **kw)


def with_lora(model, seed: int = 1):
    """``get_peft_model`` on all seven projections with a non-zero ``B`` (every LoRA gradient exercised)."""
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=TARGETS,
                                             use_gradient_checkpointing=False, show_banner=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_B" in name:  # drawn on the CPU: the same values on every device
                p.copy_(torch.empty(p.shape).normal_(0.0, 0.05, generator=g))
    return model


def dense_twin(model):
    """A deep copy of ``model`` on stock code (no notebookkit patch) with every low-bit layer replaced by
    an fp32 ``nn.Linear`` holding the weight its codes stand for: the oracle of the fused path."""
    twin = copy.deepcopy(model)
    unpatch_model(twin)
    replaced = 0
    for name, module in list(twin.named_modules()):
        if is_low_bit_linear(module):
            dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                              device=module.qweight.device)
            with torch.no_grad():
                dense.weight.copy_(module.dequantized_weight(torch.float32))
                if module.bias is not None:
                    dense.bias.copy_(module.bias)
            dense.requires_grad_(False)
            owner, _, leaf = name.rpartition(".")
            setattr(twin.get_submodule(owner), leaf, dense)
            replaced += 1
    assert replaced and not any(is_low_bit_linear(m) for m in twin.modules())
    return twin


def batch(n: int = 2, t: int = 13, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (n, t), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
