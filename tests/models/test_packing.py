"""Packed (padding-free) batches and gradient accumulation on the fused path."""

from __future__ import annotations


import pytest
import torch

from notebookkit.kernels.testing import rel_err
from notebookkit.models import patch_model

from .helpers import random_model
from .test_patch_parity import _lora


def _packed(lengths, seed, vocab=256):
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(3, vocab, (n,), generator=g) for n in lengths])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, pos


def _loss_and_grads(model, ids, pos, labels, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=pos, labels=labels, **kw)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), grads


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_changing_one_packed_example_leaves_the_others_exactly_unchanged(family, with_mask):
    model = random_model(family)
    patch_model(model)
    model = _lora(model)
    model.train()
    lengths = [7, 9, 6]
    ids, pos = _packed(lengths, seed=0)
    labels = ids.clone()
    labels[pos == 0] = -100  # no example predicts the first token of the next one
    start, stop = lengths[0], lengths[0] + lengths[1]
    labels[:, start:stop] = -100  # the example we change contributes no loss
    kw = {"attention_mask": torch.ones_like(ids)} if with_mask else {}
    loss_a, grads_a = _loss_and_grads(model, ids, pos, labels, **kw)
    changed = ids.clone()
    changed[:, start:stop] = torch.randint(3, 256, (1, lengths[1]), generator=torch.Generator().manual_seed(5))
    loss_b, grads_b = _loss_and_grads(model, changed, pos, labels, **kw)
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_packed_row_equals_separate_rows(family):
    model = random_model(family)
    patch_model(model)
    lengths = [5, 8, 4]
    ids, pos = _packed(lengths, seed=1)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits[0]
        offset = 0
        for n in lengths:
            alone = model(input_ids=ids[:, offset : offset + n]).logits[0]
            assert rel_err(packed[offset : offset + n], alone) < 1e-5
            offset += n


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_gradient_accumulation_uneven_micro_batches_equals_one_batch(family):
    model = random_model(family)
    patch_model(model)
    model = _lora(model)
    model.train()
    g = torch.Generator().manual_seed(3)
    lengths = [5, 11, 8, 14]
    seqs = [torch.randint(3, 256, (n,), generator=g) for n in lengths]
    labels = []
    for s in seqs:
        lab = s.clone()
        lab[:2] = -100
        labels.append(lab)
    n_items = sum(int((lab[1:] != -100).sum()) for lab in labels)

    model.zero_grad(set_to_none=True)
    for s, lab in zip(seqs, labels):
        out = model(input_ids=s[None], labels=lab[None], num_items_in_batch=torch.tensor(n_items))
        out.loss.backward()
    accum = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    width = max(lengths)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    big_labels = torch.full_like(ids, -100)
    for i, (s, lab) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)], mask[i, : len(s)], big_labels[i, : len(s)] = s, 1, lab
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=big_labels)
    out.loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert rel_err(accum[name], p.grad) < 1e-5, name


def test_positions_made_by_hugging_face_are_not_read_on_the_host(monkeypatch):
    """A forward without position_ids skips the packed-rows check (a GPU sync per forward on CUDA):
    Hugging Face's own positions are one segment per row. Positions the caller passes are still checked,
    and the hint never outlives the forward it was given for, not even one that raised."""
    from notebookkit.models.patching import forward_state, patch_attention

    model = random_model("llama")
    patch_model(model)
    model = _lora(model)
    model.train()
    checked = []
    real = patch_attention.packed_causal_mask
    monkeypatch.setattr(patch_attention, "packed_causal_mask", lambda pos: checked.append(pos) or real(pos))
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(3))

    loss_default = model(input_ids=ids, labels=ids).loss
    loss_default.backward()
    assert checked == []
    loss_explicit = model(input_ids=ids, labels=ids, position_ids=torch.arange(12)[None].expand(2, -1)).loss
    assert len(checked) == 1  # passed by the caller: checked, once for all layers
    assert torch.equal(loss_default.detach(), loss_explicit.detach())

    with pytest.raises(Exception):
        model(input_ids=ids.float(), labels=ids)  # fails inside the backbone, before any attention layer
    assert forward_state.current() is None  # the failed forward's pass (and its hint) is gone
    ids_packed, pos = _packed([5, 7], seed=2)
    masks = []
    real_of_pass = patch_attention.packed_mask_of_pass
    monkeypatch.setattr(patch_attention, "packed_mask_of_pass", lambda p: masks.append(real_of_pass(p)) or masks[-1])
    model(input_ids=ids_packed, position_ids=pos, labels=ids_packed)
    assert len(checked) == 2 and all(m is not None for m in masks) and masks  # packed rows still isolated
