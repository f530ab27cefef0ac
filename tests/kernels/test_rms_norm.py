"""RMSNorm (the Llama, Gemma and gpt-oss flavours): Triton kernels (interpreter on CPU, CUDA on the GPU machine) against a
float64 reference and the PyTorch path, the reference against Hugging Face's norm modules, NaN-poisoned outputs,
in-place backward, dW only when needed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from notebookkit.kernels.rms_norm import (
    NORM_FLAVOURS, rms_norm, rms_norm_backward, rms_norm_forward, rms_norm_reference,
)
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_close, poisoned

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
SHAPES = [(3, 5, 64), (37, 123)]  # [B, T, hidden] and an odd 2-D shape
FLAVOURS = sorted(NORM_FLAVOURS)


def _inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.3).to(dtype).to(device)
    w = (torch.randn(shape[-1], generator=g) * 0.3 + 1).to(dtype).to(device)
    dy = torch.randn(shape, generator=g).to(dtype).to(device)
    return x, w, dy


def _run(x, w, dy, flavour, triton, need_dx=True, need_dw=True, inplace_backward=False):
    xl = x.detach().clone().requires_grad_(need_dx)
    wl = w.detach().clone().requires_grad_(need_dw)
    with use_triton(triton):
        y = rms_norm(xl, wl, 1e-6, flavour, inplace_backward=inplace_backward)
    y.backward(dy.clone())
    return y.detach(), xl.grad, wl.grad


def _oracle(x, w, dy, flavour):
    return _run(x.double(), w.double(), dy.double(), flavour, triton=False)


def _check_all(got, ref, dtype, factor=1.0):
    for name, a, b in zip(("y", "dx", "dw"), got, ref):
        if b is None:
            assert a is None, f"{name} should be None"
            continue
        assert a.dtype == dtype, f"{name} dtype {a.dtype}"
        assert_close(a, b, dtype, name, factor)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_matches_float64(device, dtype, shape, flavour):
    x, w, dy = _inputs(shape, dtype, device)
    got = _run(x, w, dy, flavour, triton=True)
    _check_all(got, _oracle(x, w, dy, flavour), dtype)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
def test_reference_path_agrees_with_triton(dtype, flavour):
    rows = 4097 if (dtype == torch.float32 and flavour == "llama") else 33  # one case with 4097 rows
    x, w, dy = _inputs((rows, 123), dtype, "cpu", seed=1)
    ref_path = _run(x, w, dy, flavour, triton=False)
    _check_all(ref_path, _oracle(x, w, dy, flavour), dtype)
    _check_all(_run(x, w, dy, flavour, triton=True), ref_path, dtype)


def _hf_norm(flavour: str, width: int):
    """Hugging Face's norm module of each flavour, eps 1e-6: Llama's, Gemma 3's (weight ``w``, scale ``1 + w``),
    gpt-oss's (weight kept in fp32)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return {"llama": LlamaRMSNorm, "gemma": Gemma3RMSNorm, "gpt_oss": GptOssRMSNorm}[flavour](width, eps=1e-6)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_reference_is_hugging_faces_module(flavour, weight_dtype):
    """The reference (the CPU path, and the oracle above) computes each flavour as Hugging Face's module does,
    bit for bit, for a bf16 input with a bf16 or an fp32 weight (gpt-oss keeps its norm weights in fp32)."""
    x, w, _ = _inputs((4, 3, 96), torch.bfloat16, "cpu", seed=9)
    module = _hf_norm(flavour, 96).to(weight_dtype)
    with torch.no_grad():
        module.weight.copy_(w)
    with use_triton(False):
        got = rms_norm(x, module.weight.detach(), 1e-6, flavour)
    want = module(x).detach()
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_launchers_overwrite_poisoned_buffers(device, dtype):
    x, w, dy = _inputs((37, 123), dtype, device, seed=2)
    with use_triton(True):
        y, rstd = rms_norm_forward(x, w, out=poisoned(x.shape, dtype, device), rstd=poisoned((37,), torch.float32, device))
        dx, dw = rms_norm_backward(dy, x, w, rstd, dx_out=poisoned(x.shape, dtype, device))
    y64, dx64, dw64 = _oracle(x, w, dy, "llama")
    assert torch.isfinite(rstd).all()
    _check_all((y, dx, dw), (y64, dx64, dw64), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_backward_writes_dx_into_dy(device):
    dtype = torch.float16
    x, w, dy = _inputs((5, 7, 96), dtype, device, seed=3)
    with use_triton(True):
        y, rstd = rms_norm_forward(x, w, flavour="gemma")
        dx, _ = rms_norm_backward(dy.clone(), x, w, rstd, flavour="gemma", compute_dw=False, dx_out=None)
        buf = dy.clone()
        dx_inplace, _ = rms_norm_backward(buf, x, w, rstd, flavour="gemma", compute_dw=False, dx_out=buf)
    assert dx_inplace.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(dx_inplace, dx, rtol=0, atol=0)
    # through autograd: the same gradients with and without the flag
    plain = _run(x, w, dy, "llama", triton=True)
    inplace = _run(x, w, dy, "llama", triton=True, inplace_backward=True)
    for a, b in zip(plain, inplace):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("need_dx, need_dw", [(True, False), (False, True)])
def test_only_requested_gradients(device, need_dx, need_dw):
    dtype = torch.bfloat16
    x, w, dy = _inputs((9, 123), dtype, device, seed=4)
    got = _run(x, w, dy, "llama", triton=True, need_dx=need_dx, need_dw=need_dw)
    ref = _run(x.double(), w.double(), dy.double(), "llama", triton=False, need_dx=need_dx, need_dw=need_dw)
    _check_all(got, ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_input_and_qk_norm_shape(device):
    dtype = torch.float16
    # per-head q/k norm: [B, T, H, head_dim] taken as a transposed (non-contiguous) view
    base, w, _ = _inputs((2, 3, 5, 64), dtype, device, seed=5)
    x = base.transpose(1, 2)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(dtype).to(device)
    got = _run(x, w, dy, "llama", triton=True)
    assert got[0].shape == x.shape and got[1].shape == x.shape
    _check_all(got, _oracle(x, w, dy, "llama"), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_weight_dtype_follows_hf_promotion(device):
    """An fp32 weight next to a bf16 input (gpt-oss keeps its norm weights in fp32): Llama's ``w * cast(n)``
    returns fp32, as in HF; the other flavours cast once at the end, to bf16. Forward and backward."""
    x, _, dy = _inputs((6, 40), torch.bfloat16, device, seed=7)
    w = torch.linspace(0.5, 1.5, 40, device=device)
    for flavour in FLAVOURS:
        got = _run(x, w, dy.to(torch.float32 if flavour == "llama" else torch.bfloat16), flavour, triton=True)
        assert got[0].dtype == (torch.float32 if flavour == "llama" else torch.bfloat16), flavour
        assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.float32, flavour
        want = _oracle(x, w, dy, flavour)
        for name, a, b in zip(("y", "dx", "dw"), got, want):
            assert_close(a, b, torch.bfloat16, f"{name} {flavour}")


def test_unknown_flavour_is_explained():
    with pytest.raises(ValueError, match="unknown flavour"):
        rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6, "mistral")


def test_bad_weight_shape_is_explained():
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(torch.randn(3, 8), torch.ones(9))


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
@settings(max_examples=8, deadline=None, database=None)
@given(
    lead=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    cols=st.integers(8, 300),  # 1-wide rows have dx == 0 up to eps: no relative error
    dtype=st.sampled_from(DTYPES),
    flavour=st.sampled_from(FLAVOURS),
    seed=st.integers(0, 2**16),
)
def test_property_shapes_and_dtypes(lead, cols, dtype, flavour, seed):
    shape = (*lead, cols)
    x, w, dy = _inputs(shape, dtype, "cpu", seed=seed)
    # tiny random shapes: allow twice the bound
    _check_all(_run(x, w, dy, flavour, triton=True), _oracle(x, w, dy, flavour), dtype, factor=2.0)


# ------------------------------------------------------------------------------------------------
# GPU only: large shapes and int64 offsets
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_shape_cuda(dtype, flavour):
    x, w, dy = _inputs((8192, 4096), dtype, "cuda", seed=8)
    got = _run(x, w, dy, flavour, triton=True)
    _check_all(got, _oracle(x, w, dy, flavour), dtype)


@pytest.mark.gpu
@pytest.mark.large_memory
def test_int64_offsets_cuda():
    dtype = torch.bfloat16
    rows, cols = 2**31 // 4096 + 3, 4096  # x.numel() > 2**31
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    w = torch.rand(cols, device="cuda", dtype=dtype) + 0.5
    y, rstd = rms_norm_forward(x, w)
    dy = torch.randn_like(x)
    tail = slice(rows - 7, rows)
    x_t, dy_t = x[tail].clone(), dy[tail].clone()
    dx, _ = rms_norm_backward(dy, x, w, rstd, compute_dw=False, dx_out=dy)  # in place, saves 4 GiB
    y64, dx64, _ = _run(x_t.double(), w.double(), dy_t.double(), "llama", triton=False)
    assert_close(y[tail], y64, dtype, "y tail")
    assert_close(dx[tail], dx64, dtype, "dx tail")
