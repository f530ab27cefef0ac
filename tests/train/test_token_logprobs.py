"""token_logprobs on the tiny default models with LoRA (CPU, fp32): per-token log-probs and the LoRA
gradients through the backbone + chunked linear_logprobs equal the model's own materialised logits
(log_softmax + gather), Gemma-2's final soft-cap and a temperature included; the reference (adapters
disabled, no second model) equals the adapter-free model and leaves the adapters on afterwards."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.linear_logprobs import linear_logprobs
from notebookkit.kernels.testing import rel_err
from notebookkit.models import FastLanguageModel
from notebookkit.train.token_logprobs import causal_lm_parts, token_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def lora_model(request):
    model, _ = FastLanguageModel.from_pretrained(
        f"notebookkit/tiny-{request.param}", max_seq_length=64, load_in_4bit=False, show_banner=False
    )
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, show_banner=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # lora_B starts at 0: give the adapters an effect, so "disabled" means something
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.train()
    return request.param, model


def _batch(vocab: int, seed: int = 1, b: int = 3, t: int = 19):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[1, -3:] = 0  # right padding
    return ids, mask


def _materialised(model, ids, mask, temperature=1.0):
    """Per-token log-probs from the model's own forward (full logits, soft-cap applied by the model)."""
    logits = model(input_ids=ids, attention_mask=mask, return_logits=True).logits.float() / temperature
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return logp.masked_fill(targets == -100, 0.0)


def _lora_grads(model, logp, weights):
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    return torch.autograd.grad((logp * weights).sum(), params)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_lora_grads_match_materialised_logits(lora_model, temperature):
    family, model = lora_model
    ids, mask = _batch(model.config.vocab_size)
    weights = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(2))
    ours = token_logprobs(model, ids, mask, temperature=temperature, chunk_size=7)
    ref = _materialised(model, ids, mask, temperature)
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    assert rel_err(ours, ref) < 1e-5, f"{family}: logp {rel_err(ours, ref):.2e}"
    assert (ours[mask[:, 1:] == 0] == 0).all()
    for i, (g, r) in enumerate(zip(_lora_grads(model, ours, weights), _lora_grads(model, ref, weights))):
        assert r.abs().sum() > 0
        assert rel_err(g, r) < 1e-5, f"{family}: LoRA gradient {i}: {rel_err(g, r):.2e}"


def test_logits_to_keep_scores_the_completion_only(lora_model):
    _, model = lora_model
    ids, mask = _batch(model.config.vocab_size, seed=3)
    full = token_logprobs(model, ids, mask)
    tail = token_logprobs(model, ids, mask, logits_to_keep=6, chunk_size=5)
    assert tail.shape == (ids.shape[0], 6)
    assert rel_err(tail, full[:, -6:]) < 1e-5


def test_masked_positions_skip_the_lm_head_with_the_same_results(lora_model, monkeypatch):
    """A prompt masked in labels (TRL's DPO) and padding never reach the LM head; log-probs and LoRA gradients
    equal scoring every row and zeroing the masked ones."""
    import notebookkit.train.token_logprobs as module

    _, model = lora_model
    ids, mask = _batch(model.config.vocab_size, seed=5)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :7] = -100  # the prompt
    rows = []
    real = module.linear_logprobs

    def counting(hidden, *args, **kwargs):
        rows.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(module, "linear_logprobs", counting)
    ours = token_logprobs(model, ids, mask, labels=labels, chunk_size=5)
    assert rows == [int((labels[:, 1:] != -100).sum())]
    every = token_logprobs(model, ids, mask, chunk_size=5)  # padding only: every row but the padded ones
    expected = every.masked_fill(labels[:, 1:] == -100, 0.0)
    assert rel_err(ours, expected) < 1e-6 and (ours[labels[:, 1:] == -100] == 0).all()
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(6))
    for g, r in zip(_lora_grads(model, ours, weights), _lora_grads(model, expected, weights)):
        assert r.abs().sum() > 0 and rel_err(g, r) < 1e-5
    _, entropy = token_logprobs(model, ids, mask, labels=labels, chunk_size=5, return_entropy=True)
    _, every_entropy = token_logprobs(model, ids, mask, chunk_size=5, return_entropy=True)
    assert rel_err(entropy, every_entropy.masked_fill(labels[:, 1:] == -100, 0.0)) < 1e-6


def test_softcap_is_read_from_the_family_table(lora_model):
    family, model = lora_model
    backbone, lm_head, cap = causal_lm_parts(model)
    assert cap == (30.0 if family == "gemma2" else None)
    if cap is None:
        return
    # The tiny model's logits are far below the cap (near-uniform): scale the head so they reach it.
    ids, mask = _batch(model.config.vocab_size, seed=4)
    original = lm_head.weight.detach().clone()
    try:
        with torch.no_grad():
            hidden = backbone(input_ids=ids, attention_mask=mask)[0]
            lm_head.weight.mul_(2 * cap / (hidden @ lm_head.weight.t()).abs().max())
        ours = token_logprobs(model, ids, mask, chunk_size=8)
        ref = _materialised(model, ids, mask)
        assert rel_err(ours, ref) < 1e-5
        weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(6))
        for g, r in zip(_lora_grads(model, ours, weights), _lora_grads(model, ref, weights)):
            assert rel_err(g, r) < 1e-5, f"LoRA gradient with the soft-cap active: {rel_err(g, r):.2e}"
        # Negative control: the same hidden states scored without the soft-cap miss the model's logits.
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        uncapped = linear_logprobs(backbone(input_ids=ids, attention_mask=mask)[0][:, :-1], lm_head.weight, labels)
        assert rel_err(uncapped, ref) > 1e-2
    finally:
        with torch.no_grad():
            lm_head.weight.copy_(original)


def test_reference_disables_the_adapters_without_a_second_model(lora_model):
    _, model = lora_model
    ids, mask = _batch(model.config.vocab_size, seed=5)
    n_params = sum(p.numel() for p in model.parameters())
    policy_before = token_logprobs(model, ids, mask)
    reference = token_logprobs(model, ids, mask, reference=True, chunk_size=9)
    with torch.no_grad(), model.disable_adapter():
        expected = _materialised(model, ids, mask)
    assert not reference.requires_grad
    assert rel_err(reference, expected) < 1e-5
    assert rel_err(reference, policy_before.detach()) > 1e-4, "the adapters had no effect: the test proves nothing"
    policy_after = token_logprobs(model, ids, mask)
    assert torch.equal(policy_after, policy_before), "the adapters must be back on after the reference pass"
    assert sum(p.numel() for p in model.parameters()) == n_params


def test_bad_inputs_explain_what_to_change(lora_model):
    _, model = lora_model
    ids, mask = _batch(model.config.vocab_size)
    with pytest.raises(ValueError, match="logits_to_keep"):
        token_logprobs(model, ids, mask, logits_to_keep=ids.shape[1])
    with pytest.raises(ValueError, match="labels"):
        token_logprobs(model, ids, mask, labels=ids[:, 1:])
    with pytest.raises(ValueError, match="get_peft_model"):
        token_logprobs(model.get_base_model(), ids, mask, reference=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logit_stats_equal_the_materialised_logits(lora_model, temperature):
    """Mean logit over the vocabulary and top-1 flags (TRL's logits/* and mean_token_accuracy), chunked."""
    family, model = lora_model
    ids, mask = _batch(model.config.vocab_size, seed=7)
    backbone, lm_head, _ = causal_lm_parts(model)
    original = lm_head.weight.detach().clone()
    with torch.no_grad():
        hidden = backbone(input_ids=ids, attention_mask=mask)[0]
        lm_head.weight.mul_(40.0)  # sharpen the near-uniform tiny head: a clear top-1, and the soft-cap reached
    try:
        with torch.no_grad():
            top = hidden[:, :-1] @ lm_head.weight.t()
            ids[:, 1:] = torch.where(torch.rand(ids[:, 1:].shape, generator=torch.Generator().manual_seed(8)) < 0.5,
                                     top.argmax(-1), ids[:, 1:])  # half the labels are the top-1 token
        logp, entropy, mean_logits, is_top1 = token_logprobs(
            model, ids, mask, temperature=temperature, chunk_size=6, return_entropy=True, return_logit_stats=True)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, return_logits=True).logits.float()[:, :-1] / temperature
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        assert rel_err(mean_logits, logits.mean(-1)) < 1e-5, family
        expected_top1 = (logits.argmax(-1) == targets) & (targets != -100)
        assert torch.equal(is_top1, expected_top1) and 0 < int(is_top1.sum()) < int((targets != -100).sum())
        assert rel_err(logp, _materialised(model, ids, mask, temperature)) < 1e-5
        assert not mean_logits.requires_grad and entropy.shape == logp.shape
    finally:
        with torch.no_grad():
            lm_head.weight.copy_(original)
