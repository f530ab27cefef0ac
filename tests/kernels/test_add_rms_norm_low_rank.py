"""Residual add, RMSNorm and the rank-space product ``U = x A_cat^T`` in one launch
(``notebookkit.kernels.add_rms_norm_low_rank``): ``s`` and ``x`` equal to ``add_rms_norm``'s (bit for bit where the
rounding is the device's: not bf16 under the interpreter, whose casts truncate), ``U`` held to the rounding bound
of one fp32 sum of the *rounded* ``x`` rounded once, ``|U - ref| <= unit |ref| + g sum |x_k A_jk|``; the unfused
pair where the kernel does not apply. The kernel under the interpreter (CPU) and on CUDA."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.add_rms_norm import add_rms_norm
from notebookkit.kernels.add_rms_norm_low_rank import add_rms_norm_low_rank, add_rms_norm_low_rank_supported
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_within_one_rounding

CPU = pytest.param("cpu", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1"))
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


def _inputs(n, r, dtype, device, weight_dtype=None, seed=0):
    """A decode row ``h, a [1, 1, n]``, the norm's weight and ``A_cat [r, n]`` (rows n + 3 apart: a view)."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(1, 1, n, generator=g) * 2 + 0.3).to(dtype).to(device)
    a = torch.randn(1, 1, n, generator=g).to(dtype).to(device)
    w = (torch.randn(n, generator=g) * 0.3 + 1).to(weight_dtype or dtype).to(device)
    a_cat = (torch.randn(r, n + 3, generator=g) * 0.05).to(dtype).to(device)[:, :n]
    return h, a, w, a_cat


def assert_u_within_rounding(u, x, a_cat):
    """``U`` against the float64 product of the rounded ``x`` (one fp32 sum of ``N`` products, one rounding)."""
    products = x.reshape(1, -1).double() * a_cat.double()  # [R, N]
    assert u.dtype == x.dtype and u.shape == (1, a_cat.shape[0])
    assert_within_one_rounding(u, products.sum(1), products.abs().sum(1), x.shape[-1])


CASES = [  # (N, R, dtype, flavour, weight dtype): odd widths (masked columns), q/k/v's three ranks, a lone rank
    (37, 5, torch.float32, "llama", None),
    (123, 48, torch.float16, "llama", None),
    (300, 32, torch.bfloat16, "gemma", None),
    (96, 16, torch.float16, "gpt_oss", torch.float32),
]


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("n,r,dtype,flavour,weight_dtype", CASES,
                         ids=[f"N{n}-R{r}-{str(d)[6:]}-{f}" for n, r, d, f, _ in CASES])
def test_the_norm_is_add_rms_norms_and_u_the_product_of_its_rounded_output(device, n, r, dtype, flavour,
                                                                          weight_dtype):
    h, a, w, a_cat = _inputs(n, r, dtype, device, weight_dtype)
    with use_triton(True):
        assert add_rms_norm_low_rank_supported(h, a, w, flavour, a_cat)
        s, x, u = add_rms_norm_low_rank(h, a, w, 1e-6, flavour, a_cat)
        s_ref, x_ref = add_rms_norm(h, a, w, 1e-6, flavour)
    assert s.shape == x.shape == h.shape and s.dtype == x.dtype == dtype
    assert torch.equal(s, s_ref) and torch.equal(x, x_ref)
    assert_u_within_rounding(u, x, a_cat)


@pytest.mark.parametrize("device", [CPU])
def test_more_rows_or_a_promoted_norm_run_the_unfused_pair(device):
    """Two rows, and Llama's norm with an fp32 weight (its output promotes to fp32, A_cat is 16-bit): the
    kernel is not taken and the pair gives the same function, ``U`` in the norm's dtype."""
    h, a, w, a_cat = _inputs(64, 8, torch.float16, device)
    two = torch.cat([h, a], dim=1)
    with use_triton(True):
        assert not add_rms_norm_low_rank_supported(two, two, w, "llama", a_cat)
        s, x, u = add_rms_norm_low_rank(two, two, w, 1e-6, "llama", a_cat)
        assert u.shape == (2, 8)
        assert not add_rms_norm_low_rank_supported(h, a, w.float(), "llama", a_cat)
        s, x, u = add_rms_norm_low_rank(h, a, w.float(), 1e-6, "llama", a_cat)
    assert x.dtype == u.dtype == torch.float32
    assert torch.allclose(u, x.reshape(1, -1) @ a_cat.t().float(), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n,r", [(2048, 48), (4096, 32)])
def test_the_decode_rows_on_the_gpu(dtype, n, r):
    """The Llama-3.2-1B q/k/v row and the 8B gate/up row: bit for bit the add_rms_norm kernel's ``s, x``, ``U``
    within one rounding."""
    h, a, w, a_cat = _inputs(n, r, dtype, "cuda")
    s, x, u = add_rms_norm_low_rank(h, a, w, 1e-6, "llama", a_cat)
    s_ref, x_ref = add_rms_norm(h, a, w, 1e-6, "llama")
    assert torch.equal(s, s_ref) and torch.equal(x, x_ref)
    assert_u_within_rounding(u, x, a_cat)
