"""scale_in_place: x <- x * f in fp32 with f read on the device (Triton under the interpreter on CPU,
CUDA on the GPU machine), against float64, for every dtype, odd sizes, and the fp16 loss-scale case
that a 16-bit multiply turns into inf."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.scale_in_place import scale_in_place, scale_in_place_reference

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 4097, 10_003])
@pytest.mark.parametrize("path", ["triton", "reference"])
def test_equals_one_rounding_of_the_fp32_product(device, dtype, n, path):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 1e-3).to(dtype).to(device)
    factor = torch.tensor(65536.0 * (1 + torch.rand((), generator=g).item()), device=device)
    want = (x.double() * factor.double()).to(dtype)  # one rounding of the exact product
    out = x.clone()
    with use_triton(path == "triton"):
        got = scale_in_place(out, factor)
    assert got is out
    assert torch.isfinite(got).all()
    # fp32 product then one rounding: equal to the once-rounded exact product except at exact ties.
    assert (got.double() - want.double()).abs().max() <= want.double().abs().max() * torch.finfo(dtype).eps


@pytest.mark.parametrize("device", DEVICES)
def test_loss_scale_65536_on_fp16_stays_finite(device):
    """The bug this op exists for: 65536 rounded to fp16 is inf, so x.mul_(f.half()) poisons x."""
    x = torch.full((300,), 2.0**-20, dtype=torch.float16, device=device)
    factor = torch.tensor(65536.0, device=device)
    assert torch.isinf(x.clone().mul_(factor.to(torch.float16))).all()  # what the old code did
    with use_triton(True):
        out = scale_in_place(x.clone(), factor)
    assert torch.equal(out, torch.full_like(x, 2.0**-4))


def test_reference_takes_the_factor_in_fp32():
    x = torch.full((5,), 2.0**-20, dtype=torch.float16)
    out = scale_in_place_reference(x, torch.tensor(65536.0))
    assert torch.equal(out, torch.full_like(out, 2.0**-4))


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="one-element factor"):
        scale_in_place(torch.ones(3), torch.ones(2))
    with pytest.raises(ValueError, match="contiguous"):
        scale_in_place(torch.ones(4, 4).t()[:, :2], torch.tensor(2.0))
