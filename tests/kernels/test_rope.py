"""RoPE (rotate-half, Q and K in one launch): Triton kernel (interpreter on CPU, CUDA on the GPU
machine) against a float64 reference and the PyTorch path; strided q/k, GQA, per-token positions of
packed sequences, NaN-poisoned outputs, in-place backward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from notebookkit.kernels.rope import apply_rope, rope_launch, rope_reference
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_close, poisoned

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
# (B, Hq, Hkv, T, D, table): the odd one has head_dim 10 (half 5), one shared [T, D] table
SHAPES = [(2, 4, 2, 7, 16, "BTD"), (1, 3, 1, 5, 10, "TD")]


def _tables(position_ids: torch.Tensor, head_dim: int, dtype, base: float = 10000.0):
    """HF-style cos/sin ``[B, T, D]`` from position ids ``[B, T]``, cast to the model dtype."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=position_ids.device) / head_dim)
    freqs = position_ids.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _inputs(b, hq, hkv, t, d, dtype, device, table="BTD", seed=0, packed=True):
    g = torch.Generator().manual_seed(seed)
    # [B, T, H, D] projections viewed as [B, H, T, D]: strided, as in HF attention
    q = torch.randn(b, t, hq, d, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(b, t, hkv, d, generator=g).to(dtype).transpose(1, 2)
    if packed:  # two packed sequences per row: positions restart at 0
        cut = max(1, t // 2)
        pos = torch.cat([torch.arange(cut), torch.arange(t - cut)]).repeat(b, 1) + torch.arange(b)[:, None]
    else:
        pos = torch.arange(t).repeat(b, 1)
    cos, sin = _tables(pos, d, dtype)
    if table == "TD":
        cos, sin = cos[0], sin[0]
    dq = torch.randn(b, hq, t, d, generator=g).to(dtype)
    dk = torch.randn(b, hkv, t, d, generator=g).to(dtype)
    to = lambda x: x.to(device)  # noqa: E731
    return to(q), to(k), to(cos), to(sin), to(dq), to(dk)


def _run(q, k, cos, sin, dq, dk, triton, inplace_backward=False):
    ql = q.detach().clone().requires_grad_()
    kl = k.detach().clone().requires_grad_()
    with use_triton(triton):
        if triton:
            q_rot, k_rot = apply_rope(ql, kl, cos, sin, inplace_backward=inplace_backward)
        else:
            q_rot, k_rot = apply_rope(ql, kl, cos, sin)
    torch.autograd.backward((q_rot, k_rot), (dq.clone(), dk.clone()))
    return q_rot.detach(), k_rot.detach(), ql.grad, kl.grad


def _oracle(q, k, cos, sin, dq, dk):
    d = lambda x: x.double()  # noqa: E731
    return _run(d(q), d(k), d(cos), d(sin), d(dq), d(dk), triton=False)


def _check_all(got, ref, dtype, factor=1.0):
    for name, a, b in zip(("q_rot", "k_rot", "dq", "dk"), got, ref):
        assert a.dtype == dtype and a.shape == b.shape, f"{name}: {a.dtype} {tuple(a.shape)}"
        assert_close(a, b, dtype, name, factor)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_matches_float64(device, dtype, shape):
    *dims, table = shape
    args = _inputs(*dims, dtype, device, table=table)
    got = _run(*args, triton=True)
    _check_all(got, _oracle(*args), dtype)
    assert got[0].stride() == args[0].stride(), "outputs keep the input layout"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
def test_reference_path_agrees_with_triton(dtype):
    args = _inputs(2, 6, 2, 9, 24, dtype, "cpu", seed=1)
    ref_path = _run(*args, triton=False)
    _check_all(ref_path, _oracle(*args), dtype)
    _check_all(_run(*args, triton=True), ref_path, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_launcher_overwrites_poisoned_buffers(device, dtype):
    q, k, cos, sin, dq, dk = _inputs(2, 5, 3, 6, 12, dtype, device, seed=2)
    cos3, sin3 = cos.contiguous(), sin.contiguous()
    q_out, k_out = poisoned(q.shape, dtype, device), poisoned(k.shape, dtype, device)
    dq_out, dk_out = poisoned(q.shape, dtype, device), poisoned(k.shape, dtype, device)
    with use_triton(True):
        rope_launch(q, k, cos3, sin3, q_out, k_out, backward=False)
        rope_launch(dq, dk, cos3, sin3, dq_out, dk_out, backward=True)
    _check_all((q_out, k_out, dq_out, dk_out), _oracle(q, k, cos, sin, dq, dk), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_backward(device):
    dtype = torch.float16
    args = _inputs(2, 4, 2, 5, 16, dtype, device, seed=3)
    plain = _run(*args, triton=True)
    inplace = _run(*args, triton=True, inplace_backward=True)
    for a, b in zip(plain, inplace):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    q, k, cos, sin, dq, dk = args
    buf_q, buf_k = dq.clone(), dk.clone()
    with use_triton(True):
        rope_launch(buf_q, buf_k, cos, sin, buf_q, buf_k, backward=True)  # outputs alias inputs
    torch.testing.assert_close(buf_q, plain[2], rtol=0, atol=0)
    torch.testing.assert_close(buf_k, plain[3], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_backward_with_broadcast_gradients(device):
    """Gradients that arrive expanded (stride 0, e.g. from a sum over heads) are never written in place."""
    q, k, cos, sin, _, _ = _inputs(2, 4, 2, 5, 16, torch.float32, device, seed=7)
    got = []
    for triton in (True, False):
        ql, kl = q.clone().requires_grad_(), k.clone().requires_grad_()
        with use_triton(triton):
            q_rot, k_rot = apply_rope(ql, kl, cos, sin, inplace_backward=True) if triton else apply_rope(ql, kl, cos, sin)
        (q_rot.sum(1).pow(2).sum() + k_rot.sum()).backward()
        got.append((ql.grad, kl.grad))
    assert_close(got[0][0], got[1][0], torch.float32, "dq")
    assert_close(got[0][1], got[1][1], torch.float32, "dk")


@pytest.mark.parametrize("device", DEVICES)
def test_packed_positions_restart_at_zero(device):
    q, k, cos, sin, _, _ = _inputs(1, 2, 1, 8, 16, torch.float32, device, seed=4)
    with use_triton(True):
        q_rot, k_rot = apply_rope(q, k, cos, sin)
    # token 4 starts the second packed sequence: position 0 means no rotation
    torch.testing.assert_close(q_rot[:, :, 4], q[:, :, 4])
    torch.testing.assert_close(k_rot[:, :, 4], k[:, :, 4])
    # and token 5 (position 1) is rotated exactly like token 1 of the first sequence would be
    q_same = q.clone()
    q_same[:, :, 1] = q[:, :, 5]
    with use_triton(True):
        q_rot_same, _ = apply_rope(q_same, k, cos, sin)
    torch.testing.assert_close(q_rot_same[:, :, 1], q_rot[:, :, 5])


@pytest.mark.parametrize("device", DEVICES)
def test_unused_output_gets_no_gradient(device):
    q, k, cos, sin, dq, _ = _inputs(1, 2, 1, 3, 8, torch.float32, device, seed=5)
    ql, kl = q.clone().requires_grad_(), k.clone().requires_grad_()
    with use_triton(True):
        q_rot, _ = apply_rope(ql, kl, cos, sin)
    q_rot.backward(dq)
    assert kl.grad is None
    ref = _oracle(q, k, cos, sin, dq, torch.zeros_like(k))
    assert_close(ql.grad, ref[2], torch.float32, "dq")


def test_shape_errors_are_explained():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    with pytest.raises(ValueError, match="cos has shape"):
        apply_rope(q, k, torch.randn(4, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="must share batch"):
        apply_rope(q, torch.randn(1, 1, 4, 8), torch.randn(3, 8), torch.randn(3, 8))
    with pytest.raises(ValueError, match="even"):
        apply_rope(torch.randn(1, 1, 3, 7), torch.randn(1, 1, 3, 7), torch.randn(3, 7), torch.randn(3, 7))


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
@settings(max_examples=8, deadline=None, database=None)
@given(
    b=st.integers(1, 2),
    hq=st.integers(1, 6),
    hkv_div=st.integers(1, 3),
    t=st.integers(1, 6),
    half=st.integers(1, 20),
    dtype=st.sampled_from(DTYPES),
    table=st.sampled_from(["BTD", "TD"]),
    seed=st.integers(0, 2**16),
)
def test_property_shapes_and_dtypes(b, hq, hkv_div, t, half, dtype, table, seed):
    hkv = max(1, hq // hkv_div)
    args = _inputs(b, hq, hkv, t, 2 * half, dtype, "cpu", table=table, seed=seed)
    _check_all(_run(*args, triton=True), _oracle(*args), dtype, factor=2.0)


# ------------------------------------------------------------------------------------------------
# GPU only: Llama-3.1-8B attention shape and int64 offsets
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_shape_cuda(dtype):
    args = _inputs(2, 32, 8, 4096, 128, dtype, "cuda", seed=6)
    _check_all(_run(*args, triton=True), _oracle(*args), dtype)


@pytest.mark.gpu
@pytest.mark.large_memory
def test_int64_offsets_cuda():
    dtype = torch.bfloat16
    hq, d = 32, 128
    t = 2**31 // (hq * d) + 5  # q.numel() > 2**31
    q = torch.randn(1, hq, t, d, device="cuda", dtype=dtype)
    k = torch.randn(1, 1, t, d, device="cuda", dtype=dtype)
    cos, sin = _tables(torch.arange(t, device="cuda")[None] % 4096, d, dtype)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    rope_launch(q, k, cos, sin, q_out, k_out)
    tail = slice(t - 9, t)
    ref_q, ref_k = rope_reference(
        q[:, :, tail].double(), k[:, :, tail].double(), cos[:, tail].double(), sin[:, tail].double()
    )
    assert_close(q_out[:, :, tail], ref_q, dtype, "q tail")
    assert_close(k_out[:, :, tail], ref_k, dtype, "k tail")
