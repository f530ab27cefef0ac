"""``get_peft_model(..., fp8_base_matmul=True)`` on a tiny random Llama (CPU: the FP8 product is
emulated): where the flag lives, one training step against the flag-off model, the error on a GPU
without FP8, and the memory estimate's view of it."""

from __future__ import annotations

import copy

import pytest
import torch

from notebookkit.kernels import lora_projection
from notebookkit.kernels.testing import rel_err
from notebookkit.memory.estimate import estimate_kwargs_from_model, estimate_training_memory
from notebookkit.models import FastLanguageModel, patch_model
from notebookkit.models.patching import lora_fast_path
from notebookkit.memory.model_setup import fp8_forward
from notebookkit.models.patching.lora_fast_path import fp8_base_matmul_count, projection_view, set_fp8_base_matmul

from .helpers import FAMILIES, random_model


def _peft(base, fp8: bool, checkpointing=True):
    model = FastLanguageModel.get_peft_model(
        base, r=4, lora_alpha=8, use_gradient_checkpointing=checkpointing, show_banner=False, fp8_base_matmul=fp8
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)  # non-zero B: every LoRA gradient is exercised
    return model


def _step(model, x, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=x, labels=labels)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["keep", "recompute"])
def test_training_step_matches_bf16_forward(checkpointing, monkeypatch):
    base = random_model("llama", attention_dropout=0.0)
    patch_model(base)
    ref = _peft(copy.deepcopy(base), fp8=False, checkpointing=checkpointing)
    model = _peft(base, fp8=True, checkpointing=checkpointing)
    layers = model.get_base_model().model.layers
    assert fp8_base_matmul_count(model) == 7 * len(layers)
    assert fp8_base_matmul_count(ref) == 0

    calls = []
    real = lora_projection.fp8_matmul_quantized
    monkeypatch.setattr(lora_projection, "fp8_matmul_quantized", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 12))
    labels = x.clone()
    labels[:, :3] = -100
    loss_ref, g_ref = _step(ref, x, labels)
    assert not calls
    loss, g = _step(model, x, labels)
    # forward: 4 per layer (q/k/v in one product, o, gate/up in one, down); recompute in backward:
    # q/k/v, o, gate/up (down is skipped on Llama). 7 and 6 with one product per projection.
    assert len(calls) == len(layers) * (4 + (3 if checkpointing else 0))
    assert abs(loss - loss_ref) <= 0.01 * abs(loss_ref), (loss, loss_ref)
    assert g.keys() == g_ref.keys() and len(g) == 2 * 7 * len(layers)
    # The backward is the 16-bit one, but it reads activations the FP8 forward computed (each GEMM
    # output off by ~3.5%, compounding over 2 layers and the softmax): measured on this model, all
    # LoRA gradients together are off by 0.109 relative (cosine 0.994), the worst tensor by 0.156.
    names = sorted(g)
    flat, flat_ref = torch.cat([g[n].flatten() for n in names]), torch.cat([g_ref[n].flatten() for n in names])
    assert rel_err(flat, flat_ref) <= 0.2
    assert torch.nn.functional.cosine_similarity(flat, flat_ref, dim=0) >= 0.98
    errs = {n: rel_err(g[n], g_ref[n]) for n in names}
    assert max(errs.values()) <= 0.25, max(errs.items(), key=lambda kv: kv[1])


def test_flag_lives_on_base_linears_and_switches_off():
    base = random_model("llama")
    patch_model(base)
    model = _peft(base, fp8=True, checkpointing=False)
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    assert hasattr(q, "base_layer") and fp8_forward(q.base_layer)
    view, reason = projection_view(q)
    assert reason is None and view.projection.fp8_forward is True
    with model.disable_adapter():
        view, _ = projection_view(q)
        assert view.projection.fp8_forward is True and not view.has_lora
    assert model.notebookkit_banner.is_on("FP8 forward")
    model.eval()  # generation and evaluation stay 16-bit
    assert projection_view(q)[0].projection.fp8_forward is False
    assert projection_view(q, training=True)[0].projection.fp8_forward is True
    model.train()
    assert set_fp8_base_matmul(model, False) == 0 and fp8_base_matmul_count(model) == 0
    assert projection_view(q)[0].projection.fp8_forward is False


def test_unsupported_gpu_raises_before_touching_the_model(monkeypatch):
    base = random_model("llama")
    patch_model(base)
    reason = "Tesla T4 (sm_75) has no FP8 tensor cores: FP8 matmuls need compute capability 8.9 or newer."
    monkeypatch.setattr(lora_fast_path, "kernel", lambda module, name: (lambda device: (False, reason)))
    with pytest.raises(ValueError, match=r"sm_75.*fp8_base_matmul=False"):
        FastLanguageModel.get_peft_model(base, r=4, show_banner=False, fp8_base_matmul=True)
    assert not hasattr(base, "peft_config") and fp8_base_matmul_count(base) == 0


def test_memory_estimate_counts_the_fp8_copies():
    base = random_model("llama")
    patch_model(base)
    model = _peft(base, fp8=True, checkpointing=True)
    kwargs = estimate_kwargs_from_model(model)
    assert kwargs.get("fp8_forward") is True
    common = dict(batch_size=1, seq_len=64, activation_plan="recompute", cuda_context_bytes=0)
    off = estimate_training_memory(base.config, **common)
    on = estimate_training_memory(base.config, fp8_forward=True, **common)
    assert on.inputs["fp8_forward"] and not off.inputs["fp8_forward"]
    assert on.total >= off.total


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_every_family_trains_with_the_fp8_forward(family, monkeypatch):
    """Each family's seven projections run the FP8 product in the forward (and nowhere else), and one
    step's loss and LoRA gradients stay close to the 16-bit model's (llama: the test above)."""
    base = random_model(family, attention_dropout=0.0)
    patch_model(base)
    ref = _peft(copy.deepcopy(base), fp8=False, checkpointing=False)
    model = _peft(base, fp8=True, checkpointing=False)
    n_layers = len(model.get_base_model().model.layers)
    assert fp8_base_matmul_count(model) == 7 * n_layers
    calls = []
    real = lora_projection.fp8_matmul_quantized
    monkeypatch.setattr(lora_projection, "fp8_matmul_quantized", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 12))
    loss_ref, g_ref = _step(ref, x, x)
    assert not calls
    loss, g = _step(model, x, x)
    assert len(calls) == 4 * n_layers  # every projection of every layer (q/k/v and gate/up grouped), forward only
    assert abs(loss - loss_ref) <= 0.01 * abs(loss_ref), (loss, loss_ref)
    names = sorted(g)
    flat, flat_ref = torch.cat([g[n].flatten() for n in names]), torch.cat([g_ref[n].flatten() for n in names])
    assert torch.nn.functional.cosine_similarity(flat, flat_ref, dim=0) >= 0.98
