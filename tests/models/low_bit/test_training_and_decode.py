"""A tiny 2-bit and a tiny ternary model: LoRA training lowers the loss, and the fast decode path
(``for_inference`` + ``generate``) gives the tokens and scores of the dense twin on stock code."""

from __future__ import annotations

import pytest
import torch

from notebookkit.models import FastLanguageModel

from .common import checkpoint, dense_twin, load, with_lora


@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
def test_lora_on_a_low_bit_base_learns_a_token_stream(base_format):
    """Eight AdamW steps on a repeating 5-token stream (learnable: the next token is a function of the
    last): the loss falls by more than a quarter, every step on the fused path."""
    model, _ = load(checkpoint("llama"), base_format)
    model = with_lora(model)
    assert model.notebookkit_banner.is_on("LoRA fast path")
    stream = torch.tensor([5, 60, 17, 99, 42] * 8).unsqueeze(0)
    batch = {"input_ids": stream, "labels": stream.clone()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=2e-2)
    model.train()
    losses = []
    for _ in range(8):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    print(f"\n[{base_format}] losses {[round(x, 3) for x in losses]}")
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.75 * losses[0], losses


@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
def test_fast_decode_equals_the_dense_twin(base_format):
    """Greedy tokens of the fast ``generate`` (static cache, fused projections: the base through
    ``low_bit_matvec``) equal Hugging Face's ``generate`` on the dense twin, 16 new tokens, two prompts."""
    model, _ = load(checkpoint("qwen3"), base_format)
    model = with_lora(model)
    twin = dense_twin(model)
    FastLanguageModel.for_inference(model)
    twin.eval()
    prompt = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got, want = model.generate(input_ids=prompt, **kw), twin.generate(input_ids=prompt, **kw)
    assert torch.equal(got, want), f"\nfast  {got[:, 6:].tolist()}\ndense {want[:, 6:].tolist()}"
