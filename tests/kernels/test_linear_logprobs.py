"""Chunked per-token log-probabilities (linear_logprobs) against materialised logits (log_softmax +
gather): forward, entropy and the gradients of hidden, weight and bias, on the CPU torch fold and the
Triton fold (interpreter on CPU, CUDA on the GPU machine); 16-bit against a measured noise floor;
the largest allocation (never a [N, V] tensor); a 128K-vocabulary peak-memory check on the GPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from notebookkit.kernels.linear_logprobs import linear_logprobs, linear_logprobs_reference
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import rel_err

IGNORE = -100
FOLDS = [
    pytest.param("cpu", False, id="cpu-torch"),
    pytest.param("cpu", True, id="cpu-triton", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", True, id="cuda-triton", marks=pytest.mark.gpu),
]
# (B, T, H, V, chunk): odd vocabularies, token counts that the chunk does not divide.
SHAPES = [(3, 13, 45, 1001, 10), (2, 17, 32, 517, 7)]
OPTIONS = {
    "plain": {},
    "softcap": {"softcap": 3.0},
    "temperature": {"temperature": 0.7},
    "softcap_temperature_scale": {"softcap": 5.0, "temperature": 1.3, "logit_scale": 0.8},
}


def _inputs(b, t, h, v, dtype=torch.float32, device="cpu", seed=0, bias=True, ignore_every=4):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g)
    weight = torch.randn(v, h, generator=g) * h**-0.5 * 3
    bias_t = torch.randn(v, generator=g) * 0.2 if bias else None
    labels = torch.randint(0, v, (b, t), generator=g)
    labels.view(-1)[::ignore_every] = IGNORE
    labels[0, :3] = IGNORE  # a masked prompt-like run as well
    upstream = torch.randn(b, t, generator=g)  # dL/dlogp per token (DPO/GRPO weigh tokens unequally)
    cast = lambda x: None if x is None else x.to(dtype).to(device)  # noqa: E731
    return cast(hidden), cast(weight), cast(bias_t), labels.to(device), upstream.to(device)


def _run(fn, hidden, weight, bias, labels, upstream, cast=None, **opts):
    """logp and the gradients of sum(upstream * logp) w.r.t. (hidden, weight, bias)."""
    leaves = [None if x is None else x.detach().clone() for x in (hidden, weight, bias)]
    if cast is not None:
        leaves = [None if x is None else x.to(cast) for x in leaves]
    for x in leaves:
        if x is not None:
            x.requires_grad_()
    logp = fn(leaves[0], leaves[1], labels, leaves[2], **opts)
    (logp * upstream.to(logp.dtype)).sum().backward()
    return logp.detach(), [None if x is None else x.grad for x in leaves]


def _ours(use_triton_fold, chunk_size=None):
    def fn(h, w, y, b, **opts):
        with use_triton(use_triton_fold):
            return linear_logprobs(h, w, y, b, chunk_size=chunk_size, **opts)
    return fn


@pytest.mark.parametrize("device,triton_fold", FOLDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_fp32_matches_materialised_logits(device, triton_fold, shape, option, with_bias):
    b, t, h, v, chunk = shape
    opts = OPTIONS[option]
    hidden, weight, bias, labels, up = _inputs(b, t, h, v, device=device, bias=with_bias)
    logp, grads = _run(_ours(triton_fold, chunk), hidden, weight, bias, labels, up, **opts)
    logp64, grads64 = _run(linear_logprobs_reference, hidden, weight, bias, labels, up, cast=torch.float64, **opts)

    assert logp.dtype == torch.float32 and logp.shape == labels.shape
    assert rel_err(logp, logp64) < 1e-5, f"logp: {rel_err(logp, logp64):.2e}"
    for name, g, g64 in zip(("d hidden", "d weight", "d bias"), grads, grads64):
        if g64 is None:
            assert g is None
            continue
        assert g.dtype == torch.float32 and g.shape == g64.shape, name
        assert rel_err(g, g64) < 1e-5, f"{name}: {rel_err(g, g64):.2e}"
    masked = labels == IGNORE
    assert (logp[masked] == 0).all(), "masked positions must give logp 0"
    assert (grads[0][masked] == 0).all(), "masked positions must get no gradient"


@pytest.mark.parametrize("device,triton_fold", FOLDS)
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_entropy_matches_materialised_logits(device, triton_fold, softcap):
    hidden, weight, bias, labels, _ = _inputs(3, 13, 45, 1001, device=device, seed=1)
    with use_triton(triton_fold):
        logp, entropy = linear_logprobs(hidden, weight, labels, bias, softcap=softcap, temperature=0.9,
                                        chunk_size=6, return_entropy=True)
    ref_logp, ref_entropy = linear_logprobs_reference(
        hidden.double(), weight.double(), labels, bias.double(), softcap=softcap, temperature=0.9, return_entropy=True
    )
    assert rel_err(logp, ref_logp) < 1e-5
    assert rel_err(entropy, ref_entropy) < 1e-5
    assert not entropy.requires_grad
    assert (entropy[labels == IGNORE] == 0).all()


def test_negative_control_a_wrong_temperature_order_fails():
    """Temperature divides the soft-capped logits (TRL's order): soft-capping z / T instead is caught."""
    hidden, weight, bias, labels, up = _inputs(3, 13, 45, 1001, seed=2)
    logp = linear_logprobs(hidden, weight, labels, bias, softcap=3.0, temperature=0.5, chunk_size=10)
    wrong = linear_logprobs(hidden, weight, labels, bias, softcap=3.0 * 0.5, logit_scale=1 / 0.5, chunk_size=10)
    right = linear_logprobs_reference(hidden.double(), weight.double(), labels, bias.double(), softcap=3.0, temperature=0.5)
    assert rel_err(logp, right) < 1e-5
    assert rel_err(wrong, right) > 1e-2


# ------------------------------------------------------------------------------------------------
# 16-bit: against float64, within a multiple of the noise floor of plain PyTorch in the same dtype
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device,triton_fold", FOLDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("grad_scale", [1.0, 65536.0], ids=["scale1", "scale65536"])
def test_16bit_within_the_plain_pytorch_noise_floor(device, triton_fold, dtype, grad_scale):
    """The noise floor is the error of plain PyTorch in ``dtype`` (16-bit logits, then an fp32
    log-softmax; what autocast gives), against float64 on the same 16-bit inputs. Ours must be within
    2x that floor (same roundings, in another order), for logp and every gradient; with the fp16 loss
    scaler's initial factor 65536 on a token-mean loss as well (everything finite)."""
    hidden, weight, bias, labels, up = _inputs(3, 13, 45, 1001, dtype=dtype, device=device, seed=3)
    up = up * grad_scale / labels.numel()
    opts = {"softcap": 4.0, "temperature": 0.8}
    logp, grads = _run(_ours(triton_fold, 10), hidden, weight, bias, labels, up, **opts)
    logp64, grads64 = _run(linear_logprobs_reference, hidden, weight, bias, labels, up, cast=torch.float64, **opts)
    plain, plain_grads = _run(linear_logprobs_reference, hidden, weight, bias, labels, up,
                              compute_dtype=dtype, **opts)
    for name, ours, ref, floor_of in zip(("logp", "d hidden", "d weight", "d bias"),
                                         (logp, *grads), (logp64, *grads64), (plain, *plain_grads)):
        assert ours.dtype == (torch.float32 if name == "logp" else dtype), name
        floor = rel_err(floor_of, ref)
        assert 0 < floor < 0.05, f"{name}: implausible noise floor {floor:.2e}"
        err = rel_err(ours, ref)  # inf when anything is NaN or inf
        assert err <= 2 * floor, f"{name}: error {err:.2e} > 2 x noise floor {floor:.2e} ({dtype})"


# ------------------------------------------------------------------------------------------------
# Memory: no [N, V] tensor, ever
# ------------------------------------------------------------------------------------------------


class AllocationWatch(TorchDispatchMode):
    """Records every tensor an aten op creates (not views, not ``out=`` buffers): the largest in bytes,
    and the most rows of any ``[..., V]`` (logits-shaped) one."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.largest_bytes = 0
        self.largest_op = ""
        self.logit_rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {x.untyped_storage().data_ptr() for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
        out = func(*args, **kwargs)
        for x in tree_flatten(out)[0]:
            if not isinstance(x, torch.Tensor) or x.untyped_storage().data_ptr() in inputs:
                continue
            size = x.untyped_storage().nbytes()
            if size > self.largest_bytes:
                self.largest_bytes, self.largest_op = size, f"{func} -> {tuple(x.shape)}"
            if x.dim() >= 1 and x.shape[-1] == self.vocab:
                self.logit_rows = max(self.logit_rows, x.numel() // self.vocab)
        return out


@pytest.mark.parametrize("triton_fold", [False, pytest.param(True, marks=pytest.mark.skipif(
    not interpreter_on(), reason="needs TRITON_INTERPRET=1"))], ids=["torch", "triton"])
def test_never_allocates_the_full_logits(triton_fold):
    b, t, h, v, chunk = 4, 50, 24, 1001, 16  # N * V = 200K elements; C * V = 16K; V * H = 24K
    hidden, weight, bias, labels, up = _inputs(b, t, h, v, seed=4)
    n = b * t
    watches = {}
    for name, fn in (("ours", _ours(triton_fold, chunk)), ("materialised", linear_logprobs_reference)):
        watch = AllocationWatch(v)
        with watch:
            _run(fn, hidden, weight, bias, labels, up, softcap=3.0)
        watches[name] = watch
    ours, materialised = watches["ours"], watches["materialised"]
    # The negative control: the materialised path trips both checks.
    assert materialised.logit_rows == n and materialised.largest_bytes >= n * v * 4
    assert ours.logit_rows <= chunk, f"a logits block of {ours.logit_rows} rows (chunk {chunk})"
    assert ours.largest_bytes <= max(chunk * v, v * h, n * h) * 4, ours.largest_op
    assert ours.largest_bytes < n * v * 4 / 2


def test_no_grad_and_all_masked():
    hidden, weight, bias, labels, _ = _inputs(2, 9, 16, 301, seed=5)
    with torch.no_grad():
        logp = linear_logprobs(hidden, weight, labels, bias, chunk_size=4)
    assert rel_err(logp, linear_logprobs_reference(hidden.double(), weight.double(), labels, bias.double())) < 1e-5
    labels[:] = IGNORE
    logp, grads = _run(_ours(False, 4), hidden, weight, bias, labels, torch.ones(2, 9), softcap=2.0)
    assert (logp == 0).all()
    for g in grads:
        assert torch.isfinite(g).all() and (g == 0).all()


def test_bad_inputs_explain_what_to_change():
    h, w = torch.randn(6, 8), torch.randn(10, 8)
    y = torch.zeros(6, dtype=torch.long)
    with pytest.raises(ValueError, match="transpose"):
        linear_logprobs(h, w.t(), y)
    with pytest.raises(ValueError, match="shift"):
        linear_logprobs(h, w, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs(h, w, y, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_logprobs(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="softcap"):
        linear_logprobs(h, w, y, softcap=-1.0)
    with pytest.raises(TypeError, match="linear_logprobs_reference"):
        linear_logprobs(h.double(), w.double(), y)


# ------------------------------------------------------------------------------------------------
# GPU: a Llama-3 vocabulary, peak memory against the materialised path in the same run
# ------------------------------------------------------------------------------------------------


def _peak_extra(fn) -> tuple[int, object]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, result


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_large_vocab_cuda_peak_memory_and_accuracy(softcap):
    n, h_dim, vocab, dtype = 8192, 2048, 128256, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(n, h_dim, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(vocab, h_dim, device="cuda", generator=g) * h_dim**-0.5).to(dtype)  # frozen (LoRA)
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    labels[::7] = IGNORE
    up = torch.randn(n, device="cuda", generator=g)
    opts = {"softcap": softcap, "temperature": 0.9}

    def step(fn):
        h = hidden.clone().requires_grad_()
        logp = fn(h, weight, labels, **opts)
        (logp * up).sum().backward()
        return logp.detach(), h.grad

    ours_peak, (logp, grad_h) = _peak_extra(lambda: step(linear_logprobs))
    ref_peak, _ = _peak_extra(lambda: step(lambda h, w, y, **o: linear_logprobs_reference(h, w, y, compute_dtype=dtype, **o)))
    fp32_logits = n * vocab * 4
    print(f"\npeak extra: linear_logprobs {ours_peak / 2**20:.0f} MiB, materialised {ref_peak / 2**20:.0f} MiB "
          f"(fp32 logits {fp32_logits / 2**20:.0f} MiB)")
    assert ours_peak < 0.10 * fp32_logits, f"{ours_peak / 2**20:.0f} MiB"
    assert ours_peak < 0.10 * ref_peak, f"{ours_peak / 2**20:.0f} MiB vs materialised {ref_peak / 2**20:.0f} MiB"

    # Accuracy against an fp32 reference built 1024 rows at a time (bounded memory), and the noise
    # floor of plain bf16 PyTorch on the same rows.
    ref_logp, ref_grad, plain_logp, plain_grad = [], [], [], []
    for start in range(0, n, 1024):
        rows = slice(start, start + 1024)
        for cd, logps, grads in ((torch.float32, ref_logp, ref_grad), (dtype, plain_logp, plain_grad)):
            h = hidden[rows].detach().clone().requires_grad_()
            lp = linear_logprobs_reference(h, weight, labels[rows], compute_dtype=cd, **opts)
            (lp * up[rows]).sum().backward()
            logps.append(lp.detach())
            grads.append(h.grad)
    for name, ours, ref, plain in (("logp", logp, torch.cat(ref_logp), torch.cat(plain_logp)),
                                   ("d hidden", grad_h, torch.cat(ref_grad), torch.cat(plain_grad))):
        floor = rel_err(plain, ref)
        assert rel_err(ours, ref) <= 2 * max(floor, 1e-4), f"{name}: {rel_err(ours, ref):.2e} vs floor {floor:.2e}"


@pytest.mark.gpu
def test_trainable_weight_cuda():
    """Weight and bias gradients over many chunks (fp32 accumulation), bf16, 2048 tokens, V = 128256."""
    hidden, weight, bias, labels, up = _inputs(2, 1024, 1024, 128256, dtype=torch.bfloat16, device="cuda", seed=8)
    logp, grads = _run(_ours(True, 256), hidden, weight, bias, labels, up, softcap=30.0)
    logp32, grads32 = _run(linear_logprobs_reference, hidden, weight, bias, labels, up, cast=torch.float32, softcap=30.0)
    plain, plain_grads = _run(linear_logprobs_reference, hidden, weight, bias, labels, up,
                              compute_dtype=torch.bfloat16, softcap=30.0)
    for name, ours, ref, floor_of in zip(("logp", "d hidden", "d weight", "d bias"),
                                         (logp, *grads), (logp32, *grads32), (plain, *plain_grads)):
        floor = rel_err(floor_of, ref)
        assert rel_err(ours, ref) <= 2 * max(floor, 1e-4), f"{name}: {rel_err(ours, ref):.2e} vs floor {floor:.2e}"
