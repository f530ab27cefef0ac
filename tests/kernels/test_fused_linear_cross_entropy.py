"""Fused linear cross-entropy: chunked lm_head + Triton CE (interpreter on CPU, CUDA on the GPU
machine) against a float64 reference, the reference path, NaN poison, gradient accumulation,
large vocabularies and the memory budget."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels import cross_entropy as ce_mod
from notebookkit.kernels import fused_linear_cross_entropy as flce_mod
from notebookkit.kernels.fused_linear_cross_entropy import (
    choose_chunk_size,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_close, poisoned, rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
# (N, H, V, chunk_size): both shapes run several chunks, the odd one with a ragged last chunk.
SHAPES = [(37, 45, 1001, 10), (64, 96, 4096, 16)]
OPTIONS = {
    # bias, trainable weight
    "plain": ({}, True, True),
    # frozen weight, no bias
    "softcap_scale": ({"softcap": 4.0, "logit_scale": 0.6}, False, False),
    "zloss_nitems": ({"z_loss": 1e-3, "n_items": 101}, True, True),
}
IGNORE = -100


def _inputs(n, h, v, dtype, device, seed=0, ignore_every=5, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).to(device)
    weight = (torch.randn(v, h, generator=g) * h**-0.5 * 2).to(dtype).to(device)
    b = (torch.randn(v, generator=g) * 0.1).to(dtype).to(device) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::ignore_every] = IGNORE
    return hidden, weight, b, labels.to(device)


def _run(fn, hidden, weight, bias, labels, grad_scale, train_weight, cast=None, **opts):
    """Loss and the gradients of (hidden, weight or None, bias or None)."""
    leaves = [hidden, weight, bias]
    leaves = [None if t is None else t.detach().clone() for t in leaves]
    if cast is not None:
        leaves = [None if t is None else t.to(cast) for t in leaves]
    leaves[0].requires_grad_()
    if train_weight:
        leaves[1].requires_grad_()
        if leaves[2] is not None:
            leaves[2].requires_grad_()
    loss = fn(leaves[0], leaves[1], labels, leaves[2], IGNORE, **opts)
    (loss * grad_scale).backward()
    grads = [None if t is None else t.grad for t in leaves]
    return loss.detach(), grads


def _triton(*args, chunk_size=None, **kw):
    with use_triton(True):
        return fused_linear_cross_entropy(*args, chunk_size=chunk_size, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_matches_float64_and_reference_path(device, shape, dtype, option):
    n, h, v, chunk = shape
    opts, with_bias, train_weight = OPTIONS[option]
    hidden, weight, bias, labels = _inputs(n, h, v, dtype, device, bias=with_bias)

    loss, grads = _run(_triton, hidden, weight, bias, labels, 2.5, train_weight, chunk_size=chunk, **opts)
    loss64, grads64 = _run(
        fused_linear_cross_entropy_reference, hidden, weight, bias, labels, 2.5, train_weight,
        cast=torch.float64, **opts,
    )
    with use_triton(False):
        loss_ref, grads_ref = _run(
            fused_linear_cross_entropy, hidden, weight, bias, labels, 2.5, train_weight, **opts
        )
    assert loss.dtype == torch.float32
    assert_close(loss, loss64, dtype, "loss vs float64")
    assert_close(loss, loss_ref, dtype, "loss triton vs reference path")
    for name, g, g64, gref in zip(("dhidden", "dweight", "dbias"), grads, grads64, grads_ref):
        if g64 is None:
            assert g is None, name
            continue
        assert g.dtype == dtype, name
        assert_close(g, g64, dtype, f"{name} vs float64")
        assert_close(g, gref, dtype, f"{name} triton vs reference path", factor=2.0)


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_accumulation_equals_big_batch(device):
    hidden, weight, bias, labels = _inputs(48, 40, 555, torch.float32, device, seed=1, ignore_every=3)
    labels[40:] = IGNORE
    n_items = int((labels != IGNORE).sum())
    big_loss, big_grads = _run(_triton, hidden, weight, bias, labels, 1.0, True, chunk_size=5)

    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_()
    total = torch.zeros((), device=device)
    for part in range(4):
        rows = slice(12 * part, 12 * (part + 1))
        loss = _triton(h[rows], w, labels[rows], b, IGNORE, n_items=n_items, chunk_size=5)
        loss.backward()
        total += loss.detach()
    assert rel_err(total, big_loss) < 1e-5
    for name, got, want in zip(("dhidden", "dweight", "dbias"), (h.grad, w.grad, b.grad), big_grads):
        assert rel_err(got, want) < 1e-5, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_outputs_poisoned_with_nan_are_overwritten(device, dtype, monkeypatch):
    monkeypatch.setattr(ce_mod, "new_buffer", lambda shape, dt, dev: poisoned(shape, dt, dev))
    hidden, weight, bias, labels = _inputs(37, 45, 1001, dtype, device, seed=2)
    loss, grads = _run(_triton, hidden, weight, bias, labels, 1.0, True, chunk_size=10, softcap=5.0)
    loss64, grads64 = _run(
        fused_linear_cross_entropy_reference, hidden, weight, bias, labels, 1.0, True,
        cast=torch.float64, softcap=5.0,
    )
    assert_close(loss, loss64, dtype, "loss")
    for name, g, g64 in zip(("dhidden", "dweight", "dbias"), grads, grads64):
        assert_close(g, g64, dtype, name)
    assert (grads[0][labels == IGNORE] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("triton", [True, False], ids=["triton", "reference"])
@pytest.mark.parametrize("n_items", [None, 7])
def test_all_ignored_gives_zero_loss_and_zero_grads(device, triton, n_items):
    hidden, weight, bias, labels = _inputs(9, 20, 300, torch.float32, device)
    labels[:] = IGNORE
    fn = _triton if triton else fused_linear_cross_entropy_reference
    loss, grads = _run(fn, hidden, weight, bias, labels, 1.0, True, z_loss=1e-3, n_items=n_items)
    assert loss.item() == 0.0
    for g in grads:
        assert torch.isfinite(g).all() and (g == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_batched_input_no_grad_and_single_chunk(device):
    hidden, weight, _, labels = _inputs(24, 16, 200, torch.float32, device, bias=False)
    loss64, _ = _run(fused_linear_cross_entropy_reference, hidden, weight, None, labels, 1.0, True,
                     cast=torch.float64)
    # [B, T, H] hidden with [B, T] labels, default chunk size (one chunk here), trainable weight.
    loss, grads = _run(lambda h, w, y, b, i: _triton(h.view(2, 12, 16), w, y.view(2, 12), b, i),
                       hidden, weight, None, labels, 1.0, True)
    assert_close(loss, loss64, torch.float32, "batched loss")
    assert grads[0].shape == (24, 16) and grads[1].shape == (200, 16)
    with torch.no_grad():
        assert_close(_triton(hidden, weight, labels, chunk_size=7), loss64, torch.float32, "no-grad loss")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_scales_on_the_device_without_a_host_read(device, dtype, monkeypatch):
    """grad_output 1 and 2 give the reference gradients, and backward never tests grad_output == 1
    on the host (a sync that drains the GPU queue every step)."""
    hidden, weight, bias, labels = _inputs(37, 45, 1001, dtype, device, seed=3)
    refs = {s: _run(fused_linear_cross_entropy_reference, hidden, weight, bias, labels, s, True,
                    cast=torch.float64, chunk_size=10) for s in (1.0, 2.0)}

    def host_read(t):
        raise AssertionError("backward read grad_output on the host")

    monkeypatch.setattr(flce_mod, "is_exactly_one", host_read, raising=False)
    monkeypatch.setattr(ce_mod, "is_exactly_one", host_read)
    grads = {}
    for scale in (1.0, 2.0):
        loss, grads[scale] = _run(_triton, hidden, weight, bias, labels, scale, True, chunk_size=10)
        loss64, grads64 = refs[scale]
        assert_close(loss, loss64, dtype, f"loss at grad_output {scale}")
        for name, g, g64 in zip(("dhidden", "dweight", "dbias"), grads[scale], grads64):
            assert g.dtype == dtype, name
            assert_close(g, g64, dtype, f"{name} at grad_output {scale}")
    for name, g1, g2 in zip(("dhidden", "dweight", "dbias"), grads[1.0], grads[2.0]):
        assert torch.equal(g2, 2 * g1), name  # scaling by 2 is exact; by 1 it changes no bit


@pytest.mark.parametrize("device", DEVICES)
def test_backward_twice_raises(device):
    hidden, weight, _, labels = _inputs(6, 8, 50, torch.float32, device, bias=False)
    h = hidden.clone().requires_grad_()
    loss = _triton(h, weight, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_chunk_size_choice():
    cpu = torch.device("cpu")
    # Small problems: one chunk.
    assert choose_chunk_size(100, 1000, 64, torch.float32, cpu) == 100
    for n, v, h in [(8192, 128256, 4096), (8192, 262144, 3584), (4097, 32000, 2048), (37, 1001, 45)]:
        for dtype in DTYPES:
            for wg in (False, True):
                c = choose_chunk_size(n, v, h, dtype, cpu, weight_grad=wg)
                assert 1 <= c <= n
                assert c * v * dtype.itemsize <= 64 * 2**20 or c <= 8, (n, v, h, dtype, c)
    # Larger vocabularies get smaller chunks.
    assert choose_chunk_size(8192, 262144, 4096, torch.bfloat16, cpu) < choose_chunk_size(
        8192, 32000, 4096, torch.bfloat16, cpu
    )


def test_bad_inputs_explain_what_to_change():
    h, w = torch.randn(6, 8), torch.randn(10, 8)
    y = torch.zeros(6, dtype=torch.long)
    with pytest.raises(ValueError, match="transpose"):
        fused_linear_cross_entropy(h, w.t(), y)
    with pytest.raises(ValueError, match="shift"):
        fused_linear_cross_entropy(h, w, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="bias"):
        fused_linear_cross_entropy(h, w, y, bias=torch.zeros(9))
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_cross_entropy(h, w, y, chunk_size=0)


# ------------------------------------------------------------------------------------------------
# GPU: Llama-3 / Gemma vocabularies at 8192 tokens, and the memory budget
# ------------------------------------------------------------------------------------------------


def _reference_in_row_blocks(hidden, weight, labels, n_items, block=1024, **opts):
    """float32 reference loss and dL/dhidden, built 1024 rows at a time to bound its memory."""
    loss = torch.zeros((), dtype=torch.float64, device=hidden.device)
    grads = []
    for start in range(0, hidden.shape[0], block):
        h = hidden[start:start + block].detach().float().requires_grad_()
        part = fused_linear_cross_entropy_reference(h, weight.float(), labels[start:start + block],
                                                    n_items=n_items, **opts)
        part.backward()
        loss += part.detach().double()
        grads.append(h.grad)
    return loss, torch.cat(grads)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [128256, 262144])
def test_large_vocab_cuda_accuracy_and_memory(vocab):
    n, h_dim, dtype = 8192, 4096, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(6)
    hidden = torch.randn(n, h_dim, device="cuda", generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, h_dim, device="cuda", generator=g) * h_dim**-0.5).to(dtype)  # frozen
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    labels[::9] = IGNORE
    opts = {"softcap": 30.0} if vocab == 262144 else {}

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = fused_linear_cross_entropy(hidden, weight, labels, **opts)
    loss.backward()
    torch.cuda.synchronize()
    peak_extra = torch.cuda.max_memory_allocated() - before - hidden.grad.numel() * hidden.grad.element_size()
    fp32_logits = n * vocab * 4
    assert peak_extra < 0.10 * fp32_logits, (
        f"peak extra memory {peak_extra / 2**20:.0f} MiB >= 10% of fp32 logits ({fp32_logits / 2**20:.0f} MiB)"
    )

    n_items = int((labels != IGNORE).sum())
    ref_loss, ref_grad = _reference_in_row_blocks(hidden, weight, labels, n_items, **opts)
    assert_close(loss, ref_loss, dtype, f"loss V={vocab}")
    assert_close(hidden.grad, ref_grad, dtype, f"dhidden V={vocab}")


@pytest.mark.gpu
def test_trainable_weight_large_cuda():
    """Weight gradient over many chunks (fp32 accumulation) at Llama-3 vocabulary, 2048 tokens."""
    n, h_dim, vocab, dtype = 2048, 1024, 128256, torch.bfloat16
    hidden, weight, _, labels = _inputs(n, h_dim, vocab, dtype, "cuda", seed=7, bias=False)
    loss, grads = _run(_triton, hidden, weight, None, labels, 0.5, True, chunk_size=256)
    ref_loss, ref_grads = _run(fused_linear_cross_entropy_reference, hidden, weight, None, labels, 0.5, True,
                               cast=torch.float32)
    assert_close(loss, ref_loss, dtype, "loss")
    assert_close(grads[0], ref_grads[0], dtype, "dhidden")
    assert_close(grads[1], ref_grads[1], dtype, "dweight")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen", "trained"])
def test_fp16_under_the_loss_scalers_initial_scale(device, train_weight):
    """fp16 training (a T4): backward gets grad_output = 65536 from torch.amp.GradScaler.

    The gradients must stay finite and be as accurate as fp16 allows at that scale: before the fix,
    grad_output was rounded to fp16 (inf: every gradient NaN), and the stored G = p / D underflowed
    fp16 for a large vocabulary (p ~ 1 / V) and many label tokens D.
    """
    n, h, v = 96, 40, 8192
    hidden, weight, bias, labels = _inputs(n, h, v, torch.float16, device, seed=3, bias=False)
    weight = weight * 0.05  # near-uniform softmax: p_ij ~ 1 / V, the case that underflowed
    scale, d = 65536.0, 4096  # n_items of a long sequence: p / D ~ 3e-8, under fp16's smallest number
    loss, grads = _run(_triton, hidden, weight, None, labels, scale, train_weight, chunk_size=40, n_items=d)
    loss64, grads64 = _run(fused_linear_cross_entropy_reference, hidden, weight, None, labels, scale,
                           train_weight, cast=torch.float64, n_items=d)
    assert_close(loss, loss64, torch.float16, "loss")
    for name, g, g64 in zip(("dhidden", "dweight"), grads, grads64):
        if g64 is None:
            continue
        assert torch.isfinite(g).all(), f"{name}: inf/NaN at the loss scale 65536"
        assert g.dtype == torch.float16
        assert_close(g, g64, torch.float16, f"{name} vs float64 at scale 65536")


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_gradients_scale_linearly_with_grad_output(device):
    """grad_output 1 and 2**16 give the same gradients up to that factor (fp16 rounding apart)."""
    hidden, weight, bias, labels = _inputs(37, 45, 1001, torch.float16, device, seed=4)
    _, g1 = _run(_triton, hidden, weight, bias, labels, 1.0, True, chunk_size=10)
    _, g2 = _run(_triton, hidden, weight, bias, labels, 65536.0, True, chunk_size=10)
    for name, a, b in zip(("dhidden", "dweight", "dbias"), g1, g2):
        assert rel_err(b.double() / 65536.0, a.double()) < 2e-3, name
