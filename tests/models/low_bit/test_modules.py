"""The frozen 2-bit and ternary linear layers on their own: products, gradients, device and dtype
moves, state_dict, and PEFT wrapping them with LoRA (stock ``peft.get_peft_model``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from notebookkit.kernels.testing import rel_err
from notebookkit.base_layers.low_bit_linear import Q2Linear, TernaryLinear

LAYERS = {"2bit": Q2Linear, "ternary": TernaryLinear}


def _dense(seed=0, n_in=192, n_out=72, bias=True):
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out, bias=bias)


@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
def test_forward_and_input_gradient_are_those_of_the_decoded_weight(base_format):
    dense = _dense()
    layer = LAYERS[base_format].from_linear(dense)
    assert layer.weight is None and not list(layer.parameters(recurse=False))[0].requires_grad  # bias only, frozen
    w = layer.dequantized_weight(torch.float32)
    assert rel_err(w, dense.weight) < 0.6  # a low-bit fit, not garbage (2-bit ~0.33, ternary ~0.45)
    x = torch.randn(5, 3, 192, dtype=torch.float64).float().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = layer(x)
    y_ref = x_ref @ w.t() + dense.bias.detach()
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert rel_err(y, y_ref) < 1e-6 and rel_err(x.grad, x_ref.grad) < 1e-6


@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
def test_dtype_moves_keep_the_packed_tensors_bit_exact(base_format):
    layer = LAYERS[base_format].from_linear(_dense())
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.to(torch.bfloat16)
    layer.half()
    after = layer.state_dict()
    assert after["bias"].dtype == torch.float16
    for key in ("qweight", "scale") + (("zero",) if base_format == "2bit" else ()):
        assert after[key].dtype == before[key].dtype and torch.equal(after[key], before[key]), key
    layer.to("meta")
    assert layer.qweight.is_meta and layer.scale.dtype == torch.float16


@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
def test_state_dict_round_trip_into_an_empty_layer(base_format):
    layer = LAYERS[base_format].from_linear(_dense())
    empty = LAYERS[base_format](192, 72, bias=True, compute_dtype=torch.float32)
    empty.load_state_dict(layer.state_dict())
    x = torch.randn(4, 192)
    assert torch.equal(empty(x), layer(x))


@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
def test_stock_peft_wraps_them_and_trains_the_adapters(base_format):
    from peft import LoraConfig, get_peft_model

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(192)
            self.up_proj = LAYERS[base_format].from_linear(_dense(bias=False))

        def forward(self, x):
            return self.up_proj(self.norm(x))

    model = get_peft_model(Block(), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    wrapped = model.base_model.model.up_proj
    assert isinstance(wrapped.base_layer, LAYERS[base_format])
    x = torch.randn(3, 192, requires_grad=True)
    model(x).square().sum().backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(n.split(".")[-3] for n in trainable) == ["lora_A", "lora_B"]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_q2_refuses_a_width_its_groups_do_not_divide():
    with pytest.raises(ValueError, match="does not divide in_features 96"):
        Q2Linear(96, 32)
