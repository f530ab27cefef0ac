"""Patched vs unpatched: same weights, same inputs -> same logits, loss, LoRA grads and greedy text.

Every family of the architecture table, fp32 on CPU (kernels on their PyTorch references).
"""

from __future__ import annotations

import copy

import pytest
import torch

from notebookkit.kernels.testing import rel_err
from notebookkit.models import patch_model, patch_summary, unpatch_model
from notebookkit.models.patching.patch_lm_head import owner_of

from .helpers import FAMILIES, random_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(model, seed=1):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)  # non-zero B so every LoRA gradient is exercised
    return peft_model


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_loss_grad_parity(family):
    stock = random_model(family)
    fused = copy.deepcopy(stock)
    banner = patch_model(fused)
    assert banner.is_on("attention") and banner.is_on("MLP") and banner.is_on("RMSNorm"), str(banner)
    counts = patch_summary(fused)
    assert counts["attention"] == 2 and counts["mlp"] == 2 and counts["causal_lm"] == 1

    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 21))
    with torch.no_grad():
        assert rel_err(fused(input_ids=x).logits, stock(input_ids=x).logits) < 1e-5

    stock_l, fused_l = _lora(stock), _lora(fused)
    stock_l.train()
    fused_l.train()
    labels = x.clone()
    labels[0, :6] = -100
    out_s = stock_l(input_ids=x, labels=labels)
    out_f = fused_l(input_ids=x, labels=labels)
    assert out_f.logits is None  # training + labels: fused linear cross-entropy, no full logits
    assert abs(out_f.loss.item() - out_s.loss.item()) <= 1e-5 * abs(out_s.loss.item())
    out_s.loss.backward()
    out_f.loss.backward()
    gs, gf = _grads(stock_l), _grads(fused_l)
    assert gs.keys() == gf.keys() and len(gs) == 2 * 7 * 2
    for name in gs:
        assert rel_err(gf[name], gs[name]) < 1e-5, name


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_with_kv_cache_matches(family):
    stock = random_model(family)
    fused = copy.deepcopy(stock)
    patch_model(fused)
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 7))
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    got, want = fused.generate(input_ids=x, **kw), stock.generate(input_ids=x, **kw)
    _assert_same_greedy_text(stock, got, want, mask)


def _assert_same_greedy_text(stock, got, want, prompt_mask, tie=1e-4):
    """Greedy tokens equal, or, where a row first differs, the stock model's two candidates were within
    ``tie`` of each other (logits scaled by their spread): a near tie that the fused kernels' other
    summation order (fp32 logits agree to ~1e-6 here) may break the other way, on some CPU. A wrong
    kernel gives another token with a clear margin."""
    assert got.shape == want.shape
    for row in range(got.shape[0]):
        differ = (got[row] != want[row]).nonzero()
        if differ.numel() == 0:
            continue
        first = int(differ[0])
        prefix = want[row : row + 1, :first]
        mask = torch.cat([prompt_mask[row : row + 1], torch.ones(1, first - prompt_mask.shape[1], dtype=prompt_mask.dtype)], 1)
        with torch.no_grad():
            logits = stock(input_ids=prefix, attention_mask=mask[:, :first]).logits[0, -1].double()
        a, b = logits[want[row, first]], logits[got[row, first]]
        spread = (logits.max() - logits.min()).clamp_min(1e-30)
        assert (a - b).abs() <= tie * spread, (
            f"row {row}, token {first}: fused picked {int(got[row, first])}, stock {int(want[row, first])}, "
            f"logit margin {float((a - b) / spread):.2e} of the spread is not a near tie")


def test_greedy_check_catches_a_wrong_token():
    """The near-tie allowance cannot hide a wrong token: one with a clear margin fails the check."""
    stock = random_model("llama")
    x = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(x)
    want = stock.generate(input_ids=x, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        logits = stock(input_ids=want[:, :8], attention_mask=torch.ones(1, 8, dtype=torch.long)).logits[0, -1]
    got = want.clone()
    got[0, 8] = int(logits.argmin())
    with pytest.raises(AssertionError, match="not a near tie"):
        _assert_same_greedy_text(stock, got, want, mask)


def test_unpatch_restores_stock_forward_and_logits_when_asked():
    stock = random_model("qwen3")
    fused = copy.deepcopy(stock)
    patch_model(fused)
    x = torch.randint(0, 256, (1, 9))
    fused.train()
    out = fused(input_ids=x, labels=x, return_logits=True)
    assert out.logits is not None and out.logits.shape == (1, 9, 300)
    kept = fused(input_ids=x, logits_to_keep=1)
    assert kept.logits.shape == (1, 1, 300)
    n = unpatch_model(fused)
    assert n > 0 and patch_summary(fused) == {}
    assert all("forward" not in m.__dict__ for m in fused.modules())
    out = fused(input_ids=x, labels=x)
    assert out.logits is not None


def test_unknown_architecture_stays_stock():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    banner = patch_model(model)
    assert not banner.is_on("fast path")
    assert "gpt2" in str(banner) and "stock" in str(banner)
    assert patch_summary(model) == {}


def test_deepcopy_of_a_patched_model_is_independent():
    model = random_model("llama")
    patch_model(model)
    object.__setattr__(model, "max_seq_length", 32)
    twin = copy.deepcopy(model)
    assert owner_of(twin.model) is twin
    assert twin.model.forward.__self__ is twin.model
    x = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert torch.equal(twin(input_ids=x).logits, model(input_ids=x).logits)
        twin.model.layers[0].mlp.up_proj.weight.mul_(2)
        assert not torch.equal(twin(input_ids=x).logits, model(input_ids=x).logits)
