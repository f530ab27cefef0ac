"""Q2 (notebookkit's 2-bit base format, ``notebookkit.kernels.q2``): the packing against the layout's
definition, the quantiser's error bounds (HQQ and least squares against min-max on Gaussian weights),
the dequantisation kernel under the interpreter (CPU) bit-exact against the format decoded by its
definition, and the messages for bad input. Small shapes: the file runs in seconds."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.q2 import (
    Q2Weight,
    dequantize_q2,
    dequantize_q2_reference,
    pack_codes,
    quantize_q2,
    unpack_codes,
)
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import poisoned

needs_interpreter = pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")


def _gauss(n, k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.02).to(dtype)


def _decode_by_definition(q: Q2Weight, dtype: torch.dtype) -> torch.Tensor:
    """The format read element by element from its definition (integer arithmetic, no shifts)."""
    n, k = q.shape
    byte = q.codes.long().repeat_interleave(4, dim=1)  # byte of column c is c // 4
    field = torch.arange(k).remainder(4)  # column 4j + t lives in bits 2t, 2t + 1
    code = (byte // (4 ** field)) % 4
    grp = torch.arange(k) // q.group_size
    w = (code.float() - q.zero.float()[:, grp]) * q.scale.float()[:, grp]
    return w.to(dtype)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_packing_layout_and_round_trip():
    assert pack_codes(torch.tensor([[1, 2, 3, 0]])).tolist() == [[1 | 2 << 2 | 3 << 4]]
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 4, (13, 84), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (13, 21)
    assert torch.equal(unpack_codes(packed), codes)
    with pytest.raises(ValueError, match="0..3"):
        pack_codes(codes + 1)


def test_quantiser_error_bounds_on_gaussian_weights():
    """Relative Frobenius error on N(0, 0.02^2) weights, G = 64. Measured (module docstring): min-max
    0.444, HQQ (20 rounds) 0.427, least squares (4 rounds, the default) 0.328; the bounds leave ~3%."""
    w = _gauss(128, 512)
    err = {m: _rel(dequantize_q2_reference(quantize_q2(w, method=m), torch.float32), w)
           for m in ("minmax", "hqq", "lsq")}
    assert err["hqq"] < err["minmax"] - 0.01, err
    assert err["lsq"] < err["hqq"] - 0.05, err
    assert err["minmax"] < 0.46 and err["hqq"] < 0.44 and err["lsq"] < 0.34, err
    # more least-squares rounds never make it worse (each round keeps the better fit per group)
    assert _rel(dequantize_q2_reference(quantize_q2(w, iters=8), torch.float32), w) <= err["lsq"] + 1e-6


def test_quantiser_exact_on_representable_weights_and_zero_groups():
    """A weight that *is* 4 levels a group (fp16 scale and zero) comes back to fp16 rounding; an all-zero
    group decodes to exact zeros, a constant group to its value."""
    g = torch.Generator().manual_seed(1)
    n, k, gs = 8, 128, 32
    codes = torch.randint(0, 4, (n, k), generator=g)
    codes[:, ::gs] = 0
    codes[:, 1::gs] = 3  # every level range is fully used, so min-max already finds the grid
    scale = (torch.rand(n, k // gs, generator=g) * 0.01 + 0.001).half().float()
    zero = (torch.rand(n, k // gs, generator=g) * 3).half().float()
    w = (codes.float().reshape(n, k // gs, gs) - zero[..., None]) * scale[..., None]
    w = w.reshape(n, k)
    w[2, :gs] = 0.0
    w[3, gs:2 * gs] = -0.0123
    for method in ("minmax", "hqq", "lsq"):
        wh = dequantize_q2_reference(quantize_q2(w, gs, method=method), torch.float32)
        assert _rel(wh, w) < 2e-3, method
        assert torch.equal(wh[2, :gs], torch.zeros(gs)), method
        assert torch.allclose(wh[3, gs:2 * gs], torch.full((gs,), -0.0123), rtol=1e-3, atol=0), method


def test_quantiser_keeps_dtype_and_layout():
    w = _gauss(24, 96, dtype=torch.bfloat16)
    q = quantize_q2(w, 32)
    assert q.dtype == torch.bfloat16 and q.shape == (24, 96) and q.group_size == 32
    assert q.codes.shape == (24, 24) and q.scale.shape == q.zero.shape == (24, 3)
    assert q.scale.dtype == q.zero.dtype == torch.float16
    assert dequantize_q2(q).dtype == torch.bfloat16
    assert q.nbytes() == 24 * 96 // 4 + 2 * 2 * 24 * 3


@pytest.mark.parametrize("gs", [16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", ["reference", pytest.param("triton", marks=needs_interpreter)])
def test_dequantize_bit_exact(path, dtype, gs):
    q = quantize_q2(_gauss(37, 256, seed=gs), gs)  # 37 rows: not a multiple of the kernel's row tile
    out = poisoned(q.shape, dtype, "cpu")
    if path == "reference":
        dequantize_q2_reference(q, out=out)
    else:
        with use_triton(True):
            dequantize_q2(q, out=out)
    assert torch.isfinite(out).all(), "NaN poison left: some elements were not written"
    assert torch.equal(out, _decode_by_definition(q, dtype))


def test_bad_input_messages():
    w = _gauss(8, 96)
    with pytest.raises(ValueError, match="does not divide in_features 96"):
        quantize_q2(w, 64)
    with pytest.raises(ValueError, match="power of two >= 16"):
        quantize_q2(w, 24)
    with pytest.raises(ValueError, match="power of two >= 16"):
        quantize_q2(w, 8)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32 weight, got torch.int8"):
        quantize_q2(w.to(torch.int8), 32)
    with pytest.raises(ValueError, match="2-D weight"):
        quantize_q2(w.reshape(-1), 32)
    with pytest.raises(ValueError, match="method must be"):
        quantize_q2(w, 32, method="gptq")
    bad = w.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        quantize_q2(bad, 32)
    q = quantize_q2(w, 32)
    with pytest.raises(ValueError, match="scale must be float16"):
        Q2Weight(q.codes, q.scale.float(), q.zero, q.shape, 32)
    with pytest.raises(ValueError, match="codes must be uint8"):
        Q2Weight(q.codes.to(torch.int16), q.scale, q.zero, q.shape, 32)
    with pytest.raises(ValueError, match="writes float16, bfloat16 or float32"):
        dequantize_q2_reference(q, torch.float64)
