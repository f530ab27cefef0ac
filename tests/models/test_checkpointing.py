"""Gradient checkpointing modes give the same gradients as no checkpointing (CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from notebookkit.kernels.testing import rel_err
from notebookkit.memory import PinnedBufferPool
from notebookkit.models import checkpointing as ckpt
from notebookkit.models import patch_model
from notebookkit.models.checkpointing import apply_checkpointing, normalize_mode, offload_checkpoint

from .helpers import random_model
from .test_patch_parity import _lora


def _grads(model, x, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=x, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_mode_names():
    assert normalize_mode("unsloth") == "offload"
    assert normalize_mode(True) == "recompute"
    assert normalize_mode(False) == "none"
    with pytest.raises(ValueError):
        normalize_mode("maybe")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("plan", [True, ["keep", "recompute"], "offload", "direct-offload-function"])
def test_checkpointed_grads_match(plan, family):
    base = random_model(family, attention_dropout=0.0)
    patch_model(base)
    ref = _lora(base)
    ref.train()
    model = copy.deepcopy(ref)
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 12))
    labels = x.clone()
    labels[:, :3] = -100
    loss_ref, g_ref = _grads(ref, x, labels)
    if plan == "direct-offload-function":
        # The offload autograd function itself (on CPU the input stays on the device).
        apply_checkpointing(model, True)
        calls = []

        def counted(*args, **kwargs):
            calls.append(1)
            return offload_checkpoint(*args, keep_on_device=False, state={}, **kwargs)

        for layer in model.get_base_model().model.layers:
            layer._gradient_checkpointing_func = counted
    else:
        apply_checkpointing(model, plan)
    layers = model.get_base_model().model.layers
    assert any(layer.gradient_checkpointing for layer in layers)
    loss, g = _grads(model, x, labels)
    if plan == "direct-offload-function":
        assert len(calls) == len(layers)
    assert torch.allclose(loss, loss_ref, rtol=1e-6)
    for n in g_ref:
        assert rel_err(g[n], g_ref[n]) < 1e-5, n


def test_trainer_cannot_silently_replace_our_mode():
    model = _lora(random_model("llama"))
    apply_checkpointing(model, ["recompute", "keep"])
    base = model.get_base_model()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert [layer.gradient_checkpointing for layer in base.model.layers] == [True, False]


@pytest.mark.parametrize("family,skipped", [("llama", True), ("qwen3", True), ("gemma2", False)])
def test_recompute_skips_the_unread_down_projection(family, skipped, monkeypatch):
    """A recomputed layer runs gate and up again but not down, unless a post-MLP norm reads its output."""
    import notebookkit.kernels.lora_mlp as lora_mlp_module

    base = random_model(family, attention_dropout=0.0)
    patch_model(base)
    model = _lora(base)
    model.train()
    layers = model.get_base_model().model.layers
    apply_checkpointing(model, True)
    calls = []
    real = lora_mlp_module.projection_forward
    monkeypatch.setattr(lora_mlp_module, "projection_forward", lambda *a: calls.append(1) or real(*a))
    x = torch.randint(0, 256, (2, 12))
    model(input_ids=x, labels=x).loss.backward()
    per_layer = 3 + (2 if skipped else 3)  # forward, then the recompute in backward
    assert len(calls) == per_layer * len(layers)
    assert all(getattr(layer.mlp, "_notebookkit_output_unused", False) is False for layer in layers)


def test_offload_state_uses_its_buffer_pool_from_the_first_empty_state():
    state: dict = {}
    pool = ckpt._pool(state)
    assert isinstance(pool, PinnedBufferPool) and len(pool) == 0  # empty, so falsy: still the pool
    assert ckpt._pool(state) is pool and ckpt._pool({"pool": False}) is None
