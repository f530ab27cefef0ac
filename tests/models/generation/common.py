"""Shared pieces of the generation tests: LoRA models of every family, left-padded prompts, and a
copy of a model on the fast path next to the stock one (same weights)."""

from __future__ import annotations

import copy

import torch

from notebookkit.models import patch_model
from notebookkit.models.generation import bind_generate

from ..helpers import MOE_FAMILIES, random_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # a mixture of experts' stacked weights
PAD = 299  # the test models' vocabulary is 300; prompts use ids < 256
PROMPT = 11
PAD_LENGTHS = (0, 4, 7)


def lora_model(family: str, seed: int = 0, **overrides):
    """A random ``family`` model (tests/models/helpers.py: 8-token sliding windows, small soft-caps)
    with LoRA r=4 on all seven projections (a mixture of experts: the attention's and the stacked experts'),
    ``lora_B`` drawn non-zero, no default EOS id, in eval mode."""
    from peft import LoraConfig, get_peft_model

    model = random_model(family, seed=seed, **overrides)
    torch.manual_seed(seed + 1)
    moe = dict(target_modules=TARGETS[:4], target_parameters=EXPERTS) if family in MOE_FAMILIES else {}
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **{"target_modules": TARGETS, **moe}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.generation_config.eos_token_id = None  # no stop id unless a test passes one
    return model.eval()


def fast_copy(stock):
    """A deep copy of ``stock`` patched onto the fused kernels with the fast ``generate`` bound."""
    fast = copy.deepcopy(stock)
    patch_model(fast)
    assert bind_generate(fast)
    return fast


def left_padded_prompts(seed: int = 0, pad_lengths=PAD_LENGTHS, length: int = PROMPT):
    """``(input_ids, attention_mask)``: one row per entry of ``pad_lengths``, padded on the left with ``PAD``."""
    ids = torch.randint(0, 256, (len(pad_lengths), length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pad_lengths):
        mask[row, :pad] = 0
    ids[mask == 0] = PAD
    return ids, mask
