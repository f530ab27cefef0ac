"""The embedded default's tiny ternary model (``notebookkit/tiny-llama-ternary``: the pre-trained
``tiny-llama`` ternarised and saved pre-quantised) loads as a ternary base with no flag; its held-out
loss is above the 16-bit model's (ternarising costs something) and far below chance (it is still the
pre-trained model); LoRA trains on it through the fused path."""

from __future__ import annotations

import math

import torch

from notebookkit.embedded.tiny import load_corpus
from notebookkit.memory.model_setup import base_format_of
from notebookkit.models import FastLanguageModel
from notebookkit.base_layers.low_bit_linear import TernaryLinear

from .common import TARGETS


def _tokens(tokenizer, docs, length=96):
    ids = tokenizer("\n".join(docs), return_tensors="pt")["input_ids"][0]
    rows = ids[: (len(ids) // length) * length].view(-1, length)
    return rows


def _loss(model, rows):
    model.eval()
    with torch.no_grad():
        return model(input_ids=rows, labels=rows).loss.item()


def test_tiny_ternary_loads_as_saved_and_trains_under_lora():
    model, tok = FastLanguageModel.from_pretrained("notebookkit/tiny-llama-ternary", max_seq_length=128,
                                                   dtype=torch.float32, show_banner=False)
    assert base_format_of(model) == "ternary"
    assert sum(isinstance(m, TernaryLinear) for m in model.modules()) == 7 * len(model.model.layers)
    on_load, _ = FastLanguageModel.from_pretrained("notebookkit/tiny-llama", max_seq_length=128, dtype=torch.float32,
                                                   load_in_ternary=True, show_banner=False)
    want, got = on_load.state_dict(), model.state_dict()  # the embedded build quantises as the loader does
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    dense, _ = FastLanguageModel.from_pretrained("notebookkit/tiny-llama", max_seq_length=128, dtype=torch.float32,
                                                 load_in_4bit=False, show_banner=False)
    heldout = _tokens(tok, load_corpus("heldout")[:12])[:4]
    loss_16, loss_t = _loss(dense, heldout), _loss(model, heldout)
    chance = math.log(model.config.vocab_size)
    print(f"\nheld-out loss: 16-bit {loss_16:.3f}, ternary {loss_t:.3f}, chance {chance:.3f}")
    assert loss_16 < loss_t < 0.5 * chance
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16, target_modules=TARGETS,
                                             use_gradient_checkpointing=False, show_banner=False)
    assert model.notebookkit_banner.is_on("LoRA fast path")
    model.train()
    model(input_ids=heldout, labels=heldout).loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
