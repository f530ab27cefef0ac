"""A random-weight model built directly in the 2-bit / ternary format (the 70B benchmark's builder) on a
tiny config: every projection packed, nothing left on meta, the codes' weights have the asked spread,
the same seed gives the same model, and it trains under LoRA through the fused path."""

from __future__ import annotations

import pytest
import torch

from notebookkit.memory.model_setup import base_format_of
from notebookkit.models import FastLanguageModel
from notebookkit.base_layers.low_bit_linear import Q2Linear, TernaryLinear
from notebookkit.models.low_bit.random_model import random_low_bit_model

from ..helpers import family_config
from .common import TARGETS, batch

LAYER = {"2bit": Q2Linear, "ternary": TernaryLinear}


@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_random_model_is_built_packed_with_the_asked_spread(family, base_format):
    cfg = family_config(family, intermediate_size=128)
    model = random_low_bit_model(cfg, base_format, device="cpu", dtype=torch.float32, seed=3, std=0.05)
    layers = [m for m in model.modules() if isinstance(m, LAYER[base_format])]
    assert len(layers) == 2 * 7 and base_format_of(model) == base_format
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    spread = torch.cat([m.dequantized_weight(torch.float32).flatten() for m in layers]).std().item()
    assert abs(spread - 0.05) < 0.05 * 0.02, spread
    norm = model.model.norm.weight
    assert torch.equal(norm, torch.zeros_like(norm) if family == "gemma" else torch.ones_like(norm))
    again = random_low_bit_model(cfg, base_format, device="cpu", dtype=torch.float32, seed=3, std=0.05)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=batch()["input_ids"]).logits).all()


def test_random_2bit_model_trains_under_lora_on_the_fused_path():
    model = random_low_bit_model(family_config("llama", intermediate_size=128), "2bit", device="cpu",
                                 dtype=torch.float32, std=0.08)
    FastLanguageModel.patch(model)
    model = FastLanguageModel.get_peft_model(model, r=4, target_modules=TARGETS, use_gradient_checkpointing=False,
                                             show_banner=False)
    model.train()
    loss = model(**batch()).loss
    loss.backward()
    assert model.notebookkit_banner.is_on("LoRA fast path"), str(model.notebookkit_banner)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
