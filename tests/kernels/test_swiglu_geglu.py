"""SwiGLU and GeGLU (exact erf and tanh): Triton kernels (interpreter on CPU, CUDA on the GPU machine)
against a float64 reference and the PyTorch path, NaN-poisoned outputs, the in-place backward helpers
used by the LoRA MLP and the in-place autograd backward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from notebookkit.kernels.geglu import geglu, geglu_backward_, geglu_backward_launch, geglu_forward, geglu_reference
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.swiglu import (
    swiglu,
    swiglu_backward_,
    swiglu_backward_launch,
    swiglu_forward,
    swiglu_reference,
)
from notebookkit.kernels.testing import assert_close, poisoned

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
SHAPES = [(3, 5, 64), (37, 123)]
OPS = ["swiglu", "geglu", "geglu_tanh"]


def _approx(op: str) -> str:
    return "tanh" if op == "geglu_tanh" else "none"


def _apply(op, e, g, inplace_backward=False):
    if op == "swiglu":
        return swiglu(e, g, inplace_backward=inplace_backward)
    return geglu(e, g, _approx(op), inplace_backward=inplace_backward)


def _reference(op, e, g):
    return swiglu_reference(e, g) if op == "swiglu" else geglu_reference(e, g, _approx(op))


def _backward_(op, dh, e, g):
    return swiglu_backward_(dh, e, g) if op == "swiglu" else geglu_backward_(dh, e, g, _approx(op))


def _forward_launch(op, e, g, out):
    return swiglu_forward(e, g, out=out) if op == "swiglu" else geglu_forward(e, g, _approx(op), out=out)


def _backward_launch(op, dh, e, g, h_out, de_out, dg_out):
    if op == "swiglu":
        swiglu_backward_launch(dh, e, g, h_out, de_out, dg_out)
    else:
        geglu_backward_launch(dh, e, g, h_out, de_out, dg_out, _approx(op))


def _inputs(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    e = (torch.randn(shape, generator=gen) * 2.5).to(dtype).to(device)  # reaches both tails
    g = torch.randn(shape, generator=gen).to(dtype).to(device)
    dh = torch.randn(shape, generator=gen).to(dtype).to(device)
    return e, g, dh


def _run(op, e, g, dh, triton, inplace_backward=False):
    el = e.detach().clone().requires_grad_()
    gl = g.detach().clone().requires_grad_()
    with use_triton(triton):
        h = _apply(op, el, gl, inplace_backward)
    h.backward(dh.clone())
    return h.detach(), el.grad, gl.grad


def _oracle(op, e, g, dh):
    return _run(op, e.double(), g.double(), dh.double(), triton=False)


def _check_all(got, ref, dtype, factor=1.0, names=("h", "de", "dg")):
    for name, a, b in zip(names, got, ref):
        assert a.dtype == dtype and a.shape == b.shape, f"{name}: {a.dtype} {tuple(a.shape)}"
        assert_close(a, b, dtype, name, factor)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_triton_matches_float64(device, op, dtype, shape):
    e, g, dh = _inputs(shape, dtype, device)
    _check_all(_run(op, e, g, dh, triton=True), _oracle(op, e, g, dh), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
def test_reference_path_agrees_with_triton(op, dtype):
    rows = 4097 if (dtype == torch.float32 and op == "swiglu") else 33  # one case with 4097 rows
    e, g, dh = _inputs((rows, 123), dtype, "cpu", seed=1)
    ref_path = _run(op, e, g, dh, triton=False)
    _check_all(ref_path, _oracle(op, e, g, dh), dtype)
    _check_all(_run(op, e, g, dh, triton=True), ref_path, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_launchers_overwrite_poisoned_buffers(device, op, dtype):
    e, g, dh = _inputs((37, 123), dtype, device, seed=2)
    h_ref, de_ref, dg_ref = _oracle(op, e, g, dh)
    with use_triton(True):
        h = _forward_launch(op, e, g, poisoned(e.shape, dtype, device))
        outs = [poisoned(e.shape, dtype, device) for _ in range(3)]
        _backward_launch(op, dh, e, g, *outs)
    _check_all((h, *outs), (h_ref, h_ref, de_ref, dg_ref), dtype, names=("h", "h (backward)", "de", "dg"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("op", OPS)
def test_inplace_backward_helper(device, op, triton):
    dtype = torch.bfloat16
    e, g, dh = _inputs((9, 123), dtype, device, seed=3)
    h_ref, de_ref, dg_ref = _oracle(op, e, g, dh)
    e_buf, g_buf, dh_buf = e.clone(), g.clone(), dh.clone()
    ptrs = (dh_buf.data_ptr(), e_buf.data_ptr(), g_buf.data_ptr())
    with use_triton(triton):
        h, de, dg = _backward_(op, dh_buf, e_buf, g_buf)
    assert (h.data_ptr(), de.data_ptr(), dg.data_ptr()) == ptrs, "h -> dh's buffer, de -> e's, dg -> g's"
    _check_all((h, de, dg), (h_ref, de_ref, dg_ref), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(37, 123), (3, 5, 64)], ids=str)
def test_column_blocks_of_one_buffer(shape, op, dtype, triton, device):
    """e and g as the column blocks [:, :I] and [:, I:2I] of one [rows, 2I + 3] buffer (the LoRA MLP's
    grouped FP8 gate/up product, here with 3 extra columns that must stay untouched): the forward
    launcher reads them in place and the in-place backward writes de, dg into those blocks, with the
    bits of the same ops on contiguous copies under the Triton interpreter; within 8 ulps of the largest
    value for compiled kernels (the GPU compiler may fuse multiply-adds differently in the strided
    variant) and for the PyTorch path (its CPU kernels take another, non-vectorised loop for strided
    inputs). A misplaced row or column would be off by whole values, far outside that."""
    if device == "cpu" and triton and not interpreter_on():
        pytest.skip("needs TRITON_INTERPRET=1")
    e, g, dh = _inputs(shape, dtype, device, seed=5)
    cols = shape[-1]
    junk = torch.full((*shape[:-1], 3), 7.0, dtype=dtype, device=device)
    buf = torch.cat([e, g, junk], dim=-1)
    e_blk, g_blk = buf[..., :cols], buf[..., cols:2 * cols]
    assert not e_blk.is_contiguous()
    with use_triton(triton):
        h_c = _forward_launch(op, e, g, None) if triton else _reference(op, e, g)
        h = _forward_launch(op, e_blk, g_blk, None) if triton else _reference(op, e_blk, g_blk)
        dh_c, e_c, g_c = dh.clone(), e.clone(), g.clone()
        _backward_(op, dh_c, e_c, g_c)
        dh_buf = dh.clone()
        h2, de, dg = _backward_(op, dh_buf, e_blk, g_blk)
    ulp = torch.finfo(dtype).eps

    def same(a, b):
        if triton and a.device.type == "cpu":
            assert torch.equal(a, b)
        else:
            assert (a.float() - b.float()).abs().max() <= 8 * ulp * b.float().abs().max()

    same(h, h_c)
    assert h.is_contiguous()
    assert de.data_ptr() == e_blk.data_ptr() and dg.data_ptr() == g_blk.data_ptr()
    same(h2, dh_c), same(de, e_c), same(dg, g_c)
    same(buf[..., :cols], e_c), same(buf[..., cols:2 * cols], g_c)
    assert torch.equal(buf[..., 2 * cols:], junk)


def test_other_layouts_are_copied_or_refused():
    """Layouts that are not row slices with one row stride: the forward launcher copies them; the
    in-place backward refuses (it could not write de, dg back)."""
    e, g, dh = _inputs((6, 8), torch.float32, "cpu", seed=6)
    e_t, g_t = e.t().contiguous().t(), g.t().contiguous().t()  # column-major
    g_wide = torch.cat([g, g], dim=1)[:, :8]  # row stride 16 while e's is 8
    with use_triton(interpreter_on()):
        if interpreter_on():
            assert torch.equal(_forward_launch("swiglu", e_t, g_t, None), _forward_launch("swiglu", e, g, None))
            assert torch.equal(_forward_launch("swiglu", e, g_wide, None), _forward_launch("swiglu", e, g, None))
        for ee, gg in ((e_t, g_t), (e, g_wide)):
            with pytest.raises(ValueError, match="contiguous"):
                swiglu_backward_(dh.clone(), ee.clone() if ee.is_contiguous() else ee, gg)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_inplace_autograd_backward(device, op):
    dtype = torch.float16
    e, g, dh = _inputs((4, 7, 33), dtype, device, seed=4)
    plain = _run(op, e, g, dh, triton=True)
    # non-leaf e/g (as projection outputs are): the flag lets backward overwrite them
    el, gl = e.clone().requires_grad_(), g.clone().requires_grad_()
    e_in, g_in = el * 1, gl * 1
    with use_triton(True):
        h = _apply(op, e_in, g_in, inplace_backward=True)
    h.backward(dh.clone())
    torch.testing.assert_close(h.detach(), plain[0], rtol=0, atol=0)
    torch.testing.assert_close(el.grad, plain[1], rtol=0, atol=0)
    torch.testing.assert_close(gl.grad, plain[2], rtol=0, atol=0)
    torch.testing.assert_close(e_in.detach(), plain[1], rtol=0, atol=0)  # e's buffer now holds de
    # the overwrite is visible to autograd: a second backward through the graph refuses to run
    with use_triton(True):
        h = _apply(op, el * 1, gl * 1, inplace_backward=True)
    h.backward(dh.clone(), retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.backward(dh.clone())


def test_errors_are_explained():
    with pytest.raises(ValueError, match="same shape"):
        swiglu(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match="approximate"):
        geglu(torch.randn(3, 4), torch.randn(3, 4), approximate="fast")
    t = torch.randn(4, 6)
    with pytest.raises(ValueError, match="contiguous"):
        swiglu_backward_(t.clone().t(), t.clone().t(), t.clone().t())


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
@settings(max_examples=10, deadline=None, database=None)
@given(
    shape=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(OPS),
    seed=st.integers(0, 2**16),
)
def test_property_shapes_and_dtypes(shape, dtype, op, seed):
    e, g, dh = _inputs(tuple(shape), dtype, "cpu", seed=seed)
    _check_all(_run(op, e, g, dh, triton=True), _oracle(op, e, g, dh), dtype, factor=2.0)


# ------------------------------------------------------------------------------------------------
# GPU only: large shapes and int64 offsets
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_large_shape_cuda(op, dtype):
    e, g, dh = _inputs((8192, 4096), dtype, "cuda", seed=5)
    _check_all(_run(op, e, g, dh, triton=True), _oracle(op, e, g, dh), dtype)


@pytest.mark.gpu
@pytest.mark.large_memory
@pytest.mark.parametrize("op", ["swiglu", "geglu_tanh"])
def test_int64_offsets_cuda(op):
    dtype = torch.bfloat16
    n = 2**31 + 4099  # more elements than int32 can index
    e = torch.randn(n, device="cuda", dtype=dtype)
    g = torch.randn(n, device="cuda", dtype=dtype)
    dh = torch.randn(n, device="cuda", dtype=dtype)
    tail = slice(n - 5000, n)
    e_t, g_t, dh_t = e[tail].clone(), g[tail].clone(), dh[tail].clone()
    h = _forward_launch(op, e, g, None)
    h_ref, de_ref, dg_ref = _oracle(op, e_t, g_t, dh_t)
    assert_close(h[tail], h_ref, dtype, "h tail")
    del h
    h2, de, dg = _backward_(op, dh, e, g)  # in place: no new 4 GiB buffers
    assert_close(h2[tail], h_ref, dtype, "h (backward) tail")
    assert_close(de[tail], de_ref, dtype, "de tail")
    assert_close(dg[tail], dg_ref, dtype, "dg tail")
