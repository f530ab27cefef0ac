"""Cross-entropy on materialised logits: Triton kernel (interpreter on CPU, CUDA on the GPU machine)
against a float64 reference, the reference path, NaN poison, gradient accumulation and edge cases."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels import cross_entropy as ce_mod
from notebookkit.kernels.cross_entropy import (
    cross_entropy,
    cross_entropy_reference,
    launch_cross_entropy,
)
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_close, poisoned, rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
# (N, V, max block): the odd shape runs the in-kernel vocabulary loop over 4 blocks with a ragged tail.
SHAPES = [(37, 1001, 256), (64, 4096, None)]
OPTIONS = {
    "plain": {},
    "softcap_scale": {"softcap": 4.0, "logit_scale": 0.6},
    "zloss_nitems": {"z_loss": 1e-3, "n_items": 101},
}
IGNORE = -100


def _inputs(n, v, dtype, device, seed=0, ignore_every=5):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype).to(device)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::ignore_every] = IGNORE
    return logits, labels.to(device)


def _float64_oracle(logits, labels, grad_scale, **opts):
    x = logits.detach().double().requires_grad_()
    loss = cross_entropy_reference(x, labels, IGNORE, **opts)
    (loss * grad_scale).backward()
    return loss.detach(), x.grad


def _run(logits, labels, grad_scale, *, triton: bool, **opts):
    """Loss and gradient, with ``logits`` as a non-leaf (so the Triton path writes in place)."""
    leaf = logits.detach().clone().requires_grad_()
    x = leaf.clone()
    with use_triton(triton):
        loss = cross_entropy(x, labels, IGNORE, **opts)
    (loss * grad_scale).backward()
    return loss.detach(), leaf.grad


@pytest.fixture
def small_block(request):
    def set_block(block):
        if block is not None:
            request.getfixturevalue("monkeypatch").setattr(ce_mod, "_MAX_BLOCK_V", block)

    return set_block


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_matches_float64_and_reference_path(device, shape, dtype, option, small_block):
    n, v, block = shape
    small_block(block)
    opts = OPTIONS[option]
    logits, labels = _inputs(n, v, dtype, device)
    loss, grad = _run(logits, labels, 2.5, triton=True, **opts)
    loss64, grad64 = _float64_oracle(logits, labels, 2.5, **opts)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert_close(loss, loss64, dtype, "loss vs float64")
    assert_close(grad, grad64, dtype, "dlogits vs float64")
    # The CPU runtime path (torch reference in the input dtype) computes the same function.
    loss_ref, grad_ref = _run(logits, labels, 2.5, triton=False, **opts)
    assert_close(loss, loss_ref, dtype, "loss triton vs reference path")
    assert_close(grad, grad_ref, dtype, "dlogits triton vs reference path", factor=2.0)


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_accumulation_equals_big_batch(device):
    logits, labels = _inputs(48, 333, torch.float32, device, seed=1, ignore_every=3)
    labels[40:] = IGNORE  # the last micro-batch has fewer label tokens
    n_items = int((labels != IGNORE).sum())
    big_loss, big_grad = _run(logits, labels, 1.0, triton=True)

    leaf = logits.clone().requires_grad_()
    total = torch.zeros((), device=device)
    with use_triton(True):
        for part in range(4):
            rows = slice(12 * part, 12 * (part + 1))
            loss = cross_entropy(leaf[rows].clone(), labels[rows], IGNORE, n_items=torch.tensor(n_items))
            loss.backward()
            total += loss.detach()
    assert rel_err(total, big_loss) < 1e-5
    assert rel_err(leaf.grad, big_grad) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_outputs_poisoned_with_nan_are_overwritten(device, dtype):
    logits, labels = _inputs(37, 1001, dtype, device, seed=2)
    denom = torch.tensor(float((labels != IGNORE).sum()), device=device)
    loss_rows = poisoned((37,), torch.float32, device)
    grad = poisoned((37, 1001), dtype, device)
    launch_cross_entropy(logits, labels, denom, loss_rows, grad, ignore_index=IGNORE, softcap=5.0,
                         z_loss=1e-4, block_size=256)
    assert torch.isfinite(loss_rows).all() and torch.isfinite(grad).all()
    assert (loss_rows[labels == IGNORE] == 0).all()
    assert (grad[labels == IGNORE] == 0).all()
    # The same, in place into a copy of the logits.
    inplace = logits.clone()
    loss_rows2 = poisoned((37,), torch.float32, device)
    launch_cross_entropy(inplace, labels, denom, loss_rows2, inplace, ignore_index=IGNORE, softcap=5.0,
                         z_loss=1e-4, block_size=256)
    assert torch.equal(loss_rows, loss_rows2) and torch.equal(grad, inplace)


@pytest.mark.parametrize("device", DEVICES)
def test_public_function_with_poisoned_allocations(device, monkeypatch):
    monkeypatch.setattr(ce_mod, "new_buffer", lambda shape, dtype, dev: poisoned(shape, dtype, dev))
    logits, labels = _inputs(37, 1001, torch.float32, device, seed=3)
    leaf = logits.clone().requires_grad_()
    with use_triton(True):
        loss = cross_entropy(leaf, labels, IGNORE, softcap=5.0)  # leaf: gradient goes to a new buffer
    loss.backward()
    loss64, grad64 = _float64_oracle(logits, labels, 1.0, softcap=5.0)
    assert_close(loss, loss64, torch.float32, "loss")
    assert_close(leaf.grad, grad64, torch.float32, "dlogits")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("triton", [True, False], ids=["triton", "reference"])
@pytest.mark.parametrize("n_items", [None, 7])
def test_all_ignored_gives_zero_loss_and_zero_grads(device, triton, n_items):
    logits, labels = _inputs(9, 300, torch.float32, device)
    labels[:] = IGNORE
    loss, grad = _run(logits, labels, 1.0, triton=triton, z_loss=1e-3, n_items=n_items)
    assert loss.item() == 0.0
    assert torch.isfinite(grad).all() and (grad == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_policy(device):
    logits, labels = _inputs(8, 130, torch.float32, device)
    with use_triton(True):
        # A leaf you created is never overwritten.
        leaf = logits.clone().requires_grad_()
        cross_entropy(leaf, labels).backward()
        assert torch.equal(leaf.detach(), logits)
        # A view of a leaf is not either.
        leaf2 = logits.clone().reshape(-1).requires_grad_()
        cross_entropy(leaf2.view(8, 130), labels).backward()
        assert torch.equal(leaf2.detach().view(8, 130), logits)
        # A non-leaf intermediate receives the gradient in its own buffer.
        base = logits.clone().requires_grad_()
        inter = base * 1.0
        cross_entropy(inter, labels).backward()
        assert torch.equal(inter.detach(), base.grad)
        # inplace_grad=False keeps the intermediate intact.
        inter2 = base * 1.0
        cross_entropy(inter2, labels, inplace_grad=False).backward()
        assert torch.equal(inter2.detach(), logits)
        # No gradient wanted: nothing is written.
        with torch.no_grad():
            plain = logits.clone()
            loss = cross_entropy(plain, labels)
        assert torch.equal(plain, logits)
    assert_close(loss, _float64_oracle(logits, labels, 1.0)[0], torch.float32, "no-grad loss")


@pytest.mark.parametrize("device", DEVICES)
def test_strided_3d_and_masked_vocab(device):
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(2, 5, 700, generator=g).to(device)
    logits = wide[..., :650]  # row stride 700, last dim contiguous
    logits[..., 600:] = float("-inf")  # masked-out vocabulary entries
    labels = torch.randint(0, 600, (2, 5), generator=g).to(device)
    labels[0, 0] = IGNORE
    for opts in ({}, {"softcap": 3.0}):
        loss, grad = _run(logits, labels, 1.0, triton=True, **opts)
        loss64, grad64 = _float64_oracle(logits, labels, 1.0, **opts)
        assert_close(loss, loss64, torch.float32, "loss")
        assert_close(grad, grad64, torch.float32, "dlogits")


@pytest.mark.parametrize("device", DEVICES)
def test_backward_twice_raises(device):
    logits, labels = _inputs(4, 50, torch.float32, device)
    base = logits.clone().requires_grad_()
    with use_triton(True):
        loss = cross_entropy(base * 1.0, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_bad_inputs_explain_what_to_change():
    logits = torch.randn(6, 10)
    with pytest.raises(ValueError, match="shift"):
        cross_entropy(logits, torch.zeros(7, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        cross_entropy(logits, torch.zeros(6))
    with pytest.raises(ValueError, match="softcap"):
        cross_entropy(logits, torch.zeros(6, dtype=torch.long), softcap=0.0)
    with pytest.raises(ValueError, match="n_items"):
        cross_entropy(logits, torch.zeros(6, dtype=torch.long), n_items=0)


# ------------------------------------------------------------------------------------------------
# GPU: large vocabularies, N * V >= 2**31 (int64 offsets)
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.large_memory
@pytest.mark.parametrize("vocab", [128256, 262144])
def test_large_vocab_cuda(vocab):
    # 8192 tokens; for V=262144 a few more, so the last rows start past element 2**31.
    n = 8192 if vocab < 262144 else 8192 + 128
    dtype = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(5)
    logits = (torch.randn(n, vocab, device="cuda", generator=g) * 2).to(dtype)
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    labels[::7] = IGNORE
    n_items = int((labels != IGNORE).sum())
    opts = {"softcap": 30.0, "z_loss": 1e-4}
    work = logits.clone().requires_grad_()
    inter = work * 1.0  # non-leaf: the gradient lands in its buffer
    loss = cross_entropy(inter, labels, IGNORE, **opts)
    loss.backward()
    del inter
    grad = work.grad
    # float64 reference row block by row block (the whole [N, V] in float64 would be 17 GB).
    ref_loss = torch.zeros((), dtype=torch.float64, device="cuda")
    num = den = 0.0
    for start in range(0, n, 1024):
        rows = slice(start, start + 1024)
        part_loss, part_grad = _float64_oracle(logits[rows], labels[rows], 1.0, n_items=n_items, **opts)
        ref_loss += part_loss
        num += (grad[rows].double() - part_grad).norm().item() ** 2
        den += part_grad.norm().item() ** 2
    assert_close(loss, ref_loss, dtype, f"loss V={vocab}")
    assert (num / den) ** 0.5 <= 1e-2, f"dlogits V={vocab}: {(num / den) ** 0.5:.3e}"


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_under_the_loss_scalers_initial_scale(device):
    """grad_output = 65536 (torch.amp.GradScaler's initial scale) on fp16 logits: finite gradients as
    accurate as fp16 allows at that scale (rounding grad_output to fp16 gave inf; storing p / D in
    fp16 flushed the softmax terms of a large vocabulary to zero)."""
    n, v = 48, 8192
    logits, labels = _inputs(n, v, torch.float16, device, seed=5)
    logits = logits * 0.02  # near-uniform softmax, p ~ 1 / V
    x = logits.detach().clone().requires_grad_()
    d = 4096  # n_items of a long sequence: p / D ~ 3e-8, under fp16's smallest subnormal
    with use_triton(True):
        loss = cross_entropy(x, labels, IGNORE, n_items=d)
    (loss * 65536.0).backward()
    x64 = logits.detach().double().requires_grad_()
    (cross_entropy_reference(x64, labels, IGNORE, n_items=d) * 65536.0).backward()
    assert torch.isfinite(x.grad).all()
    assert_close(x.grad, x64.grad, torch.float16, "dlogits at scale 65536")
