"""Residual add + RMSNorm in one kernel (the Llama, Gemma and gpt-oss flavours): the Triton kernel (interpreter on CPU, CUDA
on the GPU machine) against a float64 oracle, against the unfused pair it replaces (``h + a``, then the
``rms_norm`` kernel on the rounded sum), NaN-poisoned outputs, HF's dtype promotion, and the reference under
autograd.

The interpreter of triton 3.9 rounds fp32 -> bf16 by truncation (CUDA rounds to nearest even), so the
bit-exact checks of a bf16 sum run on the GPU only; on the CPU bf16 is held to its tolerance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from notebookkit.kernels.add_rms_norm import add_rms_norm, add_rms_norm_launch, add_rms_norm_reference
from notebookkit.kernels.rms_norm import NORM_FLAVOURS, rms_norm, rms_norm_reference
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_close, poisoned

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU = pytest.param("cpu", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1"))
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
DEVICES = [CPU, CUDA]
SHAPES = [(2, 1, 37), (5, 3, 123)]  # decode-like [B, 1, hidden] with an odd width, and a few rows of another
FLAVOURS = sorted(NORM_FLAVOURS)


def _inputs(shape, dtype, device, seed=0, weight_dtype=None):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(shape, generator=g) * 2 + 0.3).to(dtype).to(device)
    a = torch.randn(shape, generator=g).to(dtype).to(device)
    w = (torch.randn(shape[-1], generator=g) * 0.3 + 1).to(weight_dtype or dtype).to(device)
    return h, a, w


def _oracle(h, a, w, flavour):
    return add_rms_norm_reference(h.double(), a.double(), w.double(), 1e-6, flavour)


def _exact(dtype, device) -> bool:
    """Whether the kernel's rounding can be held bit for bit to PyTorch's here (module docstring)."""
    return device == "cuda" or dtype != torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_matches_float64(device, dtype, shape, flavour):
    h, a, w = _inputs(shape, dtype, device)
    with use_triton(True):
        s, y = add_rms_norm(h, a, w, 1e-6, flavour)
    s64, y64 = _oracle(h, a, w, flavour)
    assert s.dtype == dtype and y.dtype == dtype and s.shape == y.shape == shape
    assert_close(s, s64, dtype, "s")
    assert_close(y, y64, dtype, "y")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_same_as_the_unfused_add_then_norm(device, dtype, flavour):
    """``s`` is PyTorch's ``h + a`` bit for bit and ``y`` the ``rms_norm`` kernel on that rounded ``s``: the fused
    op computes what the decode step computed before, not only something close to the float64 value."""
    h, a, w = _inputs((3, 1, 123), dtype, device, seed=1)
    with use_triton(True):
        s, y = add_rms_norm(h, a, w, 1e-5, flavour)
        want_s = h + a
        want_y = rms_norm(want_s, w, 1e-5, flavour)
    if _exact(dtype, device):
        assert torch.equal(s, want_s)
        assert torch.equal(y, want_y)
    else:
        assert_close(s, want_s, dtype, "s")
        assert_close(y, want_y, dtype, "y")


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_path_is_the_unfused_pair(dtype):
    h, a, w = _inputs((4, 77), dtype, "cpu", seed=2)
    with use_triton(False):
        s, y = add_rms_norm(h, a, w, 1e-6, "gemma")
    assert torch.equal(s, h + a) and torch.equal(y, rms_norm_reference(h + a, w, 1e-6, "gemma"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_launcher_overwrites_poisoned_buffers(device, dtype):
    h, a, w = _inputs((37, 123), dtype, device, seed=3)
    s, y = poisoned(h.shape, dtype, device), poisoned(h.shape, dtype, device)
    add_rms_norm_launch(h, a, w, 1e-6, "llama", s, y)
    s64, y64 = _oracle(h, a, w, "llama")
    assert_close(s, s64, dtype, "s")
    assert_close(y, y64, dtype, "y")


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_and_mixed_weight_dtype_follow_hf(device):
    """A transposed (non-contiguous) delta, and an fp32 weight next to bf16 activations: Llama's ``w * cast(n)``
    promotes to fp32, Gemma's ``cast(n * (1 + w))`` and gpt-oss's ``cast(n * w)`` stay bf16, as in Hugging Face."""
    h, _, w = _inputs((3, 5, 40), torch.bfloat16, device, seed=4, weight_dtype=torch.float32)
    a = torch.randn(40, 5, 3, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(device).transpose(0, 2)
    for flavour in FLAVOURS:
        with use_triton(True):
            s, y = add_rms_norm(h, a, w, 1e-6, flavour)
        s64, y64 = _oracle(h, a, w, flavour)
        assert s.dtype == torch.bfloat16 and y.dtype == (torch.float32 if flavour == "llama" else torch.bfloat16)
        assert_close(s, s64, torch.bfloat16, "s")
        assert_close(y, y64, torch.bfloat16, f"y {flavour}")


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
def test_under_autograd_the_reference_runs_and_differentiates():
    h, a, w = _inputs((2, 1, 24), torch.float32, "cpu", seed=6)
    a.requires_grad_(True)
    with use_triton(True):
        s, y = add_rms_norm(h, a, w, 1e-6, "llama")
    (s.sum() + y.pow(2).sum()).backward()
    a64 = a.detach().double().requires_grad_(True)
    s64, y64 = _oracle(h, a64, w, "llama")
    (s64.sum() + y64.pow(2).sum()).backward()
    assert_close(a.grad, a64.grad, torch.float32, "da")


def test_mismatched_shapes_are_explained():
    with pytest.raises(ValueError, match="must have one shape"):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 9), torch.ones(8))
    with pytest.raises(ValueError, match="weight has shape"):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(9))


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
@settings(max_examples=6, deadline=None, database=None)
@given(
    lead=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    cols=st.integers(8, 300),
    dtype=st.sampled_from(DTYPES),
    flavour=st.sampled_from(FLAVOURS),
    seed=st.integers(0, 2**16),
)
def test_property_shapes_and_dtypes(lead, cols, dtype, flavour, seed):
    h, a, w = _inputs((*lead, cols), dtype, "cpu", seed=seed)
    with use_triton(True):
        s, y = add_rms_norm(h, a, w, 1e-6, flavour)
    s64, y64 = _oracle(h, a, w, flavour)
    assert_close(s, s64, dtype, "s", factor=2.0)
    assert_close(y, y64, dtype, "y", factor=2.0)


# ------------------------------------------------------------------------------------------------
# GPU only: an 8B model's decode row and a batch of them, in the two 16-bit dtypes
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [1, 16])
def test_decode_rows_cuda(rows, dtype, flavour):
    h, a, w = _inputs((rows, 1, 4096), dtype, "cuda", seed=7)
    s, y = add_rms_norm(h, a, w, 1e-5, flavour)
    assert torch.equal(s, h + a)
    assert_close(y, _oracle(h, a, w, flavour)[1], dtype, "y")
    assert_close(y, rms_norm(h + a, w, 1e-5, flavour), dtype, "y vs the unfused pair")
