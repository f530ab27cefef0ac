"""Adapted linears outside the fused blocks on the LoRA projection kernels: PEFT's forward and gradients
(biased and unbiased, fp32 and 16-bit with fp32 adapters), the layers that stay on PEFT, and unpatching."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model

from notebookkit.kernels.testing import rel_err
from notebookkit.models.patching.patch_lora_linear import lora_linear_ready, patch_lora_linears
from notebookkit.models.patching.patcher import patch_summary, unpatch_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(24, 3 * 24, bias=True)
        self.proj = nn.Linear(24, 24, bias=False)
        self.fc = nn.Linear(24, 40, bias=True)

    def forward(self, x):
        return self.fc(torch.tanh(self.proj(self.qkv(x)[..., :24])))


def _adapted(dtype, dropout=0.0, device="cpu"):
    torch.manual_seed(0)
    model = Tower().to(device=device, dtype=dtype).requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                             target_modules=["qkv", "proj", "fc"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model


def _run(model, x):
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.float().pow(2).mean().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_matches_peft_forward_and_adapter_gradients(dtype, device):
    model = _adapted(dtype, device=device)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}  # PEFT's default
    x = torch.randn(3, 7, 24, device=device, dtype=dtype)
    stock, stock_grads = _run(model, x)
    exact, exact_grads = _run(_adapted(torch.float32, device=device), x.float())  # the fp32 yardstick
    assert patch_lora_linears(model) == 3
    assert patch_summary(model) == {"lora_linear": 3}
    fused, fused_grads = _run(model, x)
    assert fused.dtype == stock.dtype == dtype
    if dtype == torch.float32:
        assert rel_err(fused, stock) < 1e-6
        for name, g in stock_grads.items():
            assert rel_err(fused_grads[name], g) < 1e-5, name
    else:  # both round differently: each no further from the fp32 run than 2x PEFT's own distance (+ a floor)
        assert rel_err(fused, exact) <= 2 * rel_err(stock, exact) + 2e-3
        for name, g in exact_grads.items():
            assert fused_grads[name].dtype == torch.float32, name  # adapter gradients in the adapters' dtype
            assert rel_err(fused_grads[name], g) <= 2 * rel_err(stock_grads[name], g) + 5e-3, name
    assert unpatch_model(model) == 3 and patch_summary(model) == {}
    again, _ = _run(model, x)
    assert torch.equal(again, stock)


def test_layers_the_kernels_cannot_take_stay_on_peft():
    model = _adapted(torch.float32, dropout=0.1)
    layer = model.base_model.model.qkv
    assert "lora_dropout=0.1" in lora_linear_ready(layer)
    assert lora_linear_ready(model.base_model.model) == "not a PEFT LoRA layer"
    assert patch_lora_linears(model) == 0


def test_a_patched_layer_follows_the_adapter_being_switched_off():
    """Decided per call: with the adapter switched off the kernels run the base alone, as PEFT does."""
    model = _adapted(torch.float32)
    patch_lora_linears(model)
    x = torch.randn(5, 24)
    with model.disable_adapter():
        off = model(x)
    unpatch_model(model)
    with model.disable_adapter():
        assert torch.allclose(off, model(x), rtol=1e-6, atol=1e-6)
