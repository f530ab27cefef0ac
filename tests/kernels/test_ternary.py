"""Ternary format (notebookkit.kernels.ternary): packing, the quantiser, the BitNet checkpoint converter,
dequantisation (reference and Triton under the interpreter) and bad-input messages. Small shapes."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.ternary import (
    TernaryWeight,
    dequantize_ternary,
    dequantize_ternary_reference,
    pack_ternary,
    quantize_ternary,
    ternary_from_bitnet,
    unpack_ternary,
)

needs_interpreter = pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ternary(shape, seed=0) -> torch.Tensor:
    return torch.randint(-1, 2, shape, generator=_gen(seed), dtype=torch.int8)


@pytest.mark.parametrize("k", [1, 3, 4, 5, 77])
def test_pack_round_trip_exact(k):
    t = _ternary((9, k), seed=k)
    packed = pack_ternary(t)
    assert packed.dtype == torch.uint8 and packed.shape == (9, -(-k // 4))
    assert torch.equal(unpack_ternary(packed, k), t)


def test_pack_bit_layout():
    # weights k = 0..3 of a row at bits 0,2,4,6 as t + 1; padding is code 1
    t = torch.tensor([[-1, 0, 1, 1, -1]], dtype=torch.int8)
    packed = pack_ternary(t)
    assert packed.tolist() == [[0b10_10_01_00, 0b01_01_01_00]]


@pytest.mark.parametrize("group", ["tensor", "row", 16, 64])
def test_quantiser_codes_and_refit_never_worse(group):
    w = torch.randn(33, 150, generator=_gen(1)) * torch.exp(torch.randn(33, 1, generator=_gen(2)))
    errs = []
    for steps in (0, 1, 4):
        q = quantize_ternary(w, group, steps)
        t = unpack_ternary(q.packed, q.in_features)
        assert set(t.unique().tolist()) <= {-1, 0, 1}
        assert q.scales.dtype == torch.float16
        errs.append((dequantize_ternary_reference(q, torch.float32) - w).norm().item())
    # least squares given the codes, then alternating: each no worse (fp16 scale rounding aside)
    assert errs[1] <= errs[0] * (1 + 1e-3) and errs[2] <= errs[1] * (1 + 1e-3), errs
    if group != "tensor":  # rows of different scale: one scale for all is far worse (the error table)
        assert errs[2] / w.norm().item() < 0.5  # Gaussian: ~0.44 with four refits


def test_quantiser_absmean_is_bitnet_per_tensor():
    w = torch.randn(8, 40, generator=_gen(3))
    q = quantize_ternary(w, "tensor", refit_steps=0)
    s = w.abs().mean()
    assert torch.allclose(q.scales.float(), s.expand(8, 1), rtol=1e-3)
    assert torch.equal(unpack_ternary(q.packed, 40), torch.clamp(torch.round(w / s), -1, 1).to(torch.int8))


def test_quantiser_zero_rows_and_partial_group():
    w = torch.randn(4, 70, generator=_gen(4))
    w[1] = 0
    q = quantize_ternary(w, 64)
    assert q.scales.shape == (4, 2)
    d = dequantize_ternary_reference(q, torch.float32)
    assert torch.isfinite(d).all() and (d[1] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("path", ["reference", pytest.param("triton", marks=needs_interpreter)])
def test_dequantize_matches_definition(path, dtype):
    q = quantize_ternary(torch.randn(37, 301, generator=_gen(5)), 16)  # > 1 tile both ways (16 x 256)
    want = (unpack_ternary(q.packed, 301).float()
            * q.scales.float().repeat_interleave(16, dim=1)[:, :301]).to(dtype)
    if path == "reference":
        out = dequantize_ternary_reference(q, dtype)
    else:
        with use_triton(True):
            out = dequantize_ternary(q, dtype)
    assert out.dtype == dtype and torch.equal(out, want)


# --- BitNet b1.58 checkpoints (transformers integrations/bitnet.py layout) -------------------------


def _bitnet_pack(t: torch.Tensor) -> torch.Tensor:
    """Pack ternary [O, I] the way transformers' BitNet ``pack_weights`` documents: row ``i * R + r`` in
    bits ``2i`` of stored row ``r``, code ``t + 1``, ``R = ceil(O / 4)``."""
    o = t.shape[0]
    r = -(-o // 4)
    codes = torch.zeros((4 * r, t.shape[1]), dtype=torch.uint8)
    codes[:o] = (t + 1).to(torch.uint8)
    out = torch.zeros((r, t.shape[1]), dtype=torch.uint8)
    for i in range(4):
        out |= codes[i * r:(i + 1) * r] << (2 * i)
    return out


def test_bitnet_docstring_example():
    # the example in transformers' unpack_weights docstring
    packed = torch.tensor([[0b10100001, 0b00011000], [0b10010000, 0b00001010]], dtype=torch.uint8)
    want = torch.tensor([[0, -1], [-1, 1], [-1, 1], [-1, 1], [1, 0], [0, -1], [1, -1], [1, -1]], dtype=torch.int8)
    q = ternary_from_bitnet(packed, torch.tensor([2.0]))
    assert torch.equal(unpack_ternary(q.packed, 2), want)
    assert (q.scales == 0.5).all()  # bitlinear: W = t / weight_scale


def test_bitnet_bitlinear_converts():
    t = _ternary((12, 10), seed=6)
    packed = _bitnet_pack(t)
    try:  # transformers' own packer, when it imports
        from transformers.integrations.bitnet import pack_weights
        assert torch.equal(pack_weights(t.clone().to(torch.int8)), packed)
    except ImportError:
        pass
    ws = torch.tensor([4.0], dtype=torch.bfloat16)
    q = ternary_from_bitnet(packed, ws, {"quant_method": "bitnet", "linear_class": "bitlinear"})
    assert q.shape == (12, 10)
    assert torch.equal(dequantize_ternary_reference(q, torch.float32), t.float() / 4)


def test_bitnet_out_features_not_multiple_of_four():
    t = _ternary((10, 6), seed=7)
    q = ternary_from_bitnet(_bitnet_pack(t), torch.tensor(1.0), out_features=10)
    assert torch.equal(unpack_ternary(q.packed, 6), t)


def test_bitnet_autobitlinear_offline_converts():
    t = _ternary((8, 5), seed=8)
    cfg = {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "offline"}
    for weight in (t.to(torch.bfloat16), _bitnet_pack(t)):
        q = ternary_from_bitnet(weight, torch.tensor([0.25]), cfg)
        assert torch.equal(dequantize_ternary_reference(q, torch.float32), t.float() * 0.25)  # W = t * scale


@pytest.mark.parametrize("cfg,weight,scale,match", [
    ({"linear_class": "tritlinear"}, None, None, "Unknown BitNet layout linear_class='tritlinear'"),
    ({"linear_class": "autobitlinear", "quantization_mode": "online"}, None, None, "quantize_ternary"),
    ({"quant_method": "gptq"}, None, None, "quant_method='gptq'"),
    (None, None, torch.ones(4), "one number per layer"),
    (None, None, torch.tensor([0.0]), "positive and finite"),
    (None, torch.full((2, 3), 0xFF, dtype=torch.uint8), None, "code 3"),
    (None, torch.randn(4, 3), None, "must be packed uint8"),
    ({"linear_class": "autobitlinear"}, torch.randn(4, 3), None, "not ternary"),
])
def test_bitnet_bad_inputs(cfg, weight, scale, match):
    weight = _bitnet_pack(_ternary((4, 3))) if weight is None else weight
    scale = torch.tensor([1.0]) if scale is None else scale
    with pytest.raises(ValueError, match=match):
        ternary_from_bitnet(weight, scale, cfg)


def test_bad_inputs():
    with pytest.raises(ValueError, match="values must be -1, 0 or 1"):
        pack_ternary(torch.tensor([[2, 0]]))
    with pytest.raises(ValueError, match="code 3"):
        unpack_ternary(torch.tensor([[0xFF]], dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="2-D float weight"):
        quantize_ternary(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_ternary(torch.tensor([[float("nan"), 1.0]]))
    with pytest.raises(ValueError, match="group_size must be"):
        quantize_ternary(torch.randn(2, 8), group_size="col")
    with pytest.raises(ValueError, match="does not fit fp16"):
        quantize_ternary(torch.full((2, 8), 1e6))
    with pytest.raises(ValueError, match="scales must be fp16 of shape"):
        TernaryWeight(torch.zeros(2, 2, dtype=torch.uint8), torch.ones(2, 1), 8, 8)
    with pytest.raises(ValueError, match="needs ceil"):
        TernaryWeight(torch.zeros(2, 3, dtype=torch.uint8), torch.ones(2, 1, dtype=torch.float16), 8, 8)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        dequantize_ternary(quantize_ternary(torch.randn(2, 8)), torch.int8)
