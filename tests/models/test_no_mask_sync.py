"""A plainly causal forward builds no Hugging Face mask, so a training step has no host sync at all.

Hugging Face's mask builders check the positions they make themselves for packed rows, a host read
(``find_packed_sequence_indices``) that waits for the GPU to finish the previous step at the start of
every forward. When every attention layer is notebookkit's and the caller passes no attention mask,
positions or cache, and no sliding window is shorter than the sequence, the mask is plain causal:
the patched backbone then lets Hugging Face build none, and the attention layers apply causality
without a mask tensor. Losses and gradients are those of the masked path; anything else (padding,
positions, a window shorter than the sequence) still gets Hugging Face's masks.
"""

from __future__ import annotations

import pytest
import torch
import transformers.masking_utils as masking_utils

from notebookkit.models.patching import patch_lm_head
from notebookkit.models import patch_model
from notebookkit.models.patching.checkpointing import apply_checkpointing

from .helpers import random_model
from .test_patch_parity import _lora

FAMILIES = ["llama", "mistral", "qwen3", "gemma2", "gemma3"]


def _count_packed_checks(monkeypatch) -> list:
    calls = []
    real = masking_utils.find_packed_sequence_indices

    def spy(position_ids):
        calls.append(tuple(position_ids.shape))
        return real(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", spy)
    return calls


def _step(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, **kwargs).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_causal_step_skips_hf_masks_with_the_same_result(family, monkeypatch):
    model = _lora(random_model(family))
    patch_model(model)
    model.train()
    apply_checkpointing(model, "recompute")  # as training runs: no KV cache in the forward
    config = model.get_base_model().model.config
    assert not config.use_cache
    impl = config._attn_implementation
    seq = 8  # not longer than any test family's sliding window
    ids = torch.randint(3, 256, (2, seq), generator=torch.Generator().manual_seed(0))

    checks = _count_packed_checks(monkeypatch)
    loss, grads = _step(model, ids)
    assert checks == [], "Hugging Face checked its own positions for packing (a host sync on CUDA)"
    assert config._attn_implementation == impl  # restored after the forward

    monkeypatch.setattr(patch_lm_head, "plainly_causal", lambda *a: False)  # the masked path, as before
    ref_loss, ref_grads = _step(model, ids)
    assert checks, "the reference path should build Hugging Face's masks"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_window_shorter_than_the_sequence_keeps_hf_masks(family):
    """Sliding windows of 8 tokens (Mistral, Gemma 2 and 3), sequence of 20: Hugging Face's
    masks stay, and the patched model matches the stock one."""
    stock = random_model(family)
    model = _lora(random_model(family))
    ids = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    backbone = model.get_base_model().model
    with torch.no_grad():
        expected = _lora(stock)(input_ids=ids, labels=ids).loss
    patch_model(model)
    assert not patch_lm_head.plainly_causal(backbone, (), {"input_ids": ids}, ids)
    with torch.no_grad():
        got = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_what_a_caller_passes_keeps_hf_masks():
    model = _lora(random_model("llama"))
    patch_model(model)
    backbone = model.get_base_model().model
    ids = torch.randint(3, 256, (2, 8))
    assert patch_lm_head.plainly_causal(backbone, (), {"input_ids": ids}, ids)
    for extra in ({"attention_mask": torch.ones_like(ids)}, {"position_ids": torch.arange(8)[None]},
                  {"past_key_values": object()}, {"cache": object()}):
        assert not patch_lm_head.plainly_causal(backbone, (), {"input_ids": ids, **extra}, ids), extra
    assert not patch_lm_head.plainly_causal(backbone, (ids, torch.ones_like(ids)), {}, ids)  # positional mask


def test_padded_batch_still_masks_the_padding():
    """Left padding through the patched model gives the stock model's loss on the tokens predicted from real ones."""
    stock = _lora(random_model("llama"))
    model = _lora(random_model("llama"))
    patch_model(model)
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 4] = -100  # predicted from a padding position, whose output is arbitrary in both models
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        expected = stock(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_unpatched_attention_keeps_hf_masks(monkeypatch):
    """A model whose attention layers stay on Hugging Face's code never skips their masks."""
    from notebookkit.models.patching import patcher

    monkeypatch.setattr(patcher, "attention_ready", lambda attn, sinks=False: "kept stock for this test")
    model = _lora(random_model("llama"))
    patch_model(model)
    backbone = model.get_base_model().model
    backbone.config.use_cache = False
    ids = torch.randint(3, 256, (2, 8))
    assert not patch_lm_head.plainly_causal(backbone, (), {"input_ids": ids}, ids)
    checks = _count_packed_checks(monkeypatch)
    with torch.no_grad():
        model(input_ids=ids, labels=ids)
    assert checks


def test_config_restored_when_the_forward_raises():
    model = _lora(random_model("llama"))
    patch_model(model)
    config = model.get_base_model().model.config
    impl = config._attn_implementation
    with pytest.raises(Exception):
        model(input_ids=torch.full((1, 8), 10_000), labels=None)  # token ids past the vocabulary
    assert config._attn_implementation == impl


@pytest.mark.parametrize("builder", ["create_causal_mask", "create_sliding_window_causal_mask"])
def test_hugging_face_returns_a_prepared_mask_as_it_is(builder, monkeypatch):
    """What the plainly causal forward relies on (transformers 4.56-5.24): a 4-D ``attention_mask`` is
    an already prepared mask, returned as it is, before the positions are checked for packed rows."""
    import inspect

    from notebookkit.models.patching.patch_attention import is_plain_causal, plain_causal_mask

    config = random_model("mistral").config
    embeds = torch.zeros(2, 8, config.hidden_size)
    marker = plain_causal_mask(embeds.device)
    build = getattr(masking_utils, builder)
    values = {"cache_position": torch.arange(8), "past_key_values": None, "cache": None,
              "position_ids": torch.arange(8)[None].expand(2, -1)}
    params = list(inspect.signature(build).parameters)[3:]
    checks = _count_packed_checks(monkeypatch)
    assert build(config, embeds, marker, **{k: values[k] for k in params if k in values}) is marker
    assert checks == [] and is_plain_causal(marker) and not is_plain_causal(torch.ones(2, 1, 8, 8, dtype=torch.bool))
