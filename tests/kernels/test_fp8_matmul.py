"""FP8 forward of the base GEMM: rowwise quantisation, ``fp8_linear`` (``torch._scaled_mm`` and its
emulation) against float64, and the LoRA functions with ``fp8_forward`` on (outputs within the FP8
bound; backward unchanged).

Error bound used below. e4m3 keeps 3 mantissa bits, so rounding a value in the normal range
(``|v| >= 2^-6`` after scaling) to nearest moves it by at most half an ulp, ``2^-4 |v|``; below that
(subnormals) by at most ``2^-10`` times the row scale, i.e. ``2^-10 * amax / 448`` (negligible). So
``q_x = x (1 + d_x)`` and ``q_w = w (1 + d_w)`` with ``|d| <= 2^-4``, and each product term of
``Y = X W^T`` is off by the relative factor ``d_x + d_w + d_x d_w``, at most ``2^-3 + 2^-8`` in
magnitude. In the norm, the per-term errors are independent with zero mean, so
``||Y_fp8 - Y|| / ||Y||`` is about ``sqrt(E[d_x^2] + E[d_w^2])``: with ``d`` spread over
``[-2^-4, 2^-4]`` (rms ``2^-4 / sqrt(3)`` at most) that is at most ``2^-4 * sqrt(2/3) ~ 0.051``
(measured: 0.034-0.037 on Gaussian data). The tests allow ``2^-3 = 0.125``, the worst-case
per-term bound, which no norm error can reach without adversarial cancellation and is 2.5x the
expected value. The 16-bit output rounding (``2^-9`` for bf16) and the LoRA path add far less.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from notebookkit.kernels import fp8_matmul, lora_projection
from notebookkit.kernels.fp8_matmul import (
    AMAX_FLOOR,
    FP8_DTYPE,
    FP8_MAX,
    fp8_linear,
    fp8_linear_reference,
    fp8_supported,
    quantize_rowwise_fp8,
    quantize_rowwise_fp8_reference,
    scaled_mm_applies,
)
from notebookkit.kernels.lora_mlp import lora_mlp, lora_mlp_reference
from notebookkit.kernels.lora_o import lora_o, lora_o_reference
from notebookkit.kernels.lora_qkv import lora_qkv, lora_qkv_reference
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_close, rel_err

sys.path.insert(0, str(Path(__file__).parent))
from test_lora import Pair, _x  # noqa: E402  (shared builders of the LoRA kernel tests)

FP8_TOL = 2.0**-3  # see the module docstring
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
needs_interp = pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
ODD = (37, 123, 77)  # tokens, in, out: emulation (K, O not multiples of 16)
ALIGNED = (37, 128, 96)  # torch._scaled_mm


def _operands(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    n, k, o = shape
    x = torch.randn(n, k, generator=gen)
    w = torch.randn(o, k, generator=gen) / math.sqrt(k)
    return x.to(dtype).to(device), w.to(dtype).to(device)


# --------------------------------------------------------------------------------------------------
# quantize_rowwise_fp8
# --------------------------------------------------------------------------------------------------


def _check_quantized(x, q, scale):
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (x.shape[0], 1)
    assert (scale > 0).all()
    back = q.float() * scale
    assert torch.isfinite(back).all()
    xf = x.float()
    row_norm = xf.norm(dim=1)
    row_err = (back - xf).norm(dim=1)
    nonzero = row_norm > 0
    assert (row_err[nonzero] / row_norm[nonzero] <= 2.0**-4).all(), (row_err / row_norm).max()
    assert (back[~nonzero] == 0).all()
    assert (q.float().abs() <= FP8_MAX).all()
    return (row_err[nonzero] / row_norm[nonzero]).max().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_round_trip(dtype, device):
    gen = torch.Generator().manual_seed(0)
    # rows over 11 decades of magnitude, a zero row, a row with subnormal-range entries
    x = torch.randn(12, 200, generator=gen) * torch.logspace(-4, 4, 12)[:, None]
    x[3] = 0.0
    x[5, :40] *= 1e-5
    x = x.to(dtype).to(device)
    q, scale = quantize_rowwise_fp8(x)
    _check_quantized(x, q, scale)
    assert (q[3].float() == 0).all() and scale[3].item() == pytest.approx(AMAX_FLOOR / FP8_MAX)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=needs_interp), pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("one_pass_max_k", [fp8_matmul.ONE_PASS_MAX_K, 64], ids=["one-pass", "two-pass"])
def test_quantize_triton_matches_reference(dtype, device, one_pass_max_k, monkeypatch):
    """The kernel's e4m3 rounding (explicit under the interpreter, the hardware's on a GPU) equals
    torch's cast, bit for bit (incl. subnormals, carries), in its one-pass and its two-pass form."""
    monkeypatch.setattr(fp8_matmul, "ONE_PASS_MAX_K", one_pass_max_k)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 300, generator=gen) * torch.logspace(-6, 3, 9)[:, None]
    x[2] = 0.0
    x[4, :60] *= 1e-4
    x = x.to(dtype).to(device)
    strided = torch.randn(9, 600, generator=gen).to(dtype).to(device)[:, ::2]  # a non-contiguous row stride
    for inp in (x, strided):
        with use_triton(True):
            q, s = quantize_rowwise_fp8(inp)
        with use_triton(False):
            q_ref, s_ref = quantize_rowwise_fp8(inp)
        assert torch.equal(s, s_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        _check_quantized(inp, q, s)


def test_quantize_nan_row_stays_nan():
    x = torch.randn(3, 32)
    x[1, 5] = float("nan")
    for triton_path in ([False, True] if interpreter_on() else [False]):
        with use_triton(triton_path):
            q, s = quantize_rowwise_fp8(x)
        back = q.float() * s
        assert back[1].isnan().all() and torch.isfinite(back[[0, 2]]).all()


def test_quantize_errors():
    with pytest.raises(ValueError, match=r"\[rows, cols\]"):
        quantize_rowwise_fp8(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="floating-point"):
        quantize_rowwise_fp8(torch.ones(2, 3, dtype=torch.int32))


def _fp8_buffers(rows, cols, device, seed=7):
    """A ``[rows, cols]`` FP8 buffer and ``[rows, 1]`` fp32 scales filled with junk (every slot must be
    overwritten by the quantisation written into it)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 120, (rows, cols), generator=gen, dtype=torch.uint8).view(FP8_DTYPE).to(device)
    return q, torch.full((rows, 1), -3.0, device=device)


def _assert_bits_equal(got, want):
    (q, s), (q_ref, s_ref) = got, want
    assert torch.equal(s, s_ref), f"{(s != s_ref).sum().item()} scales differ"
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), "FP8 codes differ"


@pytest.mark.parametrize(
    "dtype, triton_path",
    [(torch.float32, True), (torch.float16, True), (torch.float32, False), (torch.bfloat16, False)],
    ids=["fp32-triton", "fp16-triton", "fp32-torch", "bf16-torch"],
)
@pytest.mark.parametrize("one_pass_max_k", [fp8_matmul.ONE_PASS_MAX_K, 64], ids=["one-pass", "two-pass"])
def test_quantize_into_row_slices_of_one_buffer(dtype, triton_path, one_pass_max_k, monkeypatch):
    """``out=``: three matrices quantised into consecutive row blocks of one ``[O_total, K]`` buffer
    (+ ``[O_total, 1]`` scales) give the bits of quantising each alone, and ``out`` is returned."""
    if triton_path and not interpreter_on():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setattr(fp8_matmul, "ONE_PASS_MAX_K", one_pass_max_k)
    gen = torch.Generator().manual_seed(3)
    rows = (5, 16, 7)
    mats = [(torch.randn(r, 200, generator=gen) * 10.0 ** (i - 1)).to(dtype) for i, r in enumerate(rows)]
    mats[1][4] = 0.0
    q_cat, s_cat = _fp8_buffers(sum(rows), 200, "cpu")
    start = 0
    with use_triton(triton_path):
        for m in mats:
            out = (q_cat[start:start + m.shape[0]], s_cat[start:start + m.shape[0]])
            got = quantize_rowwise_fp8(m, out=out)
            assert got[0] is out[0] and got[1] is out[1]
            start += m.shape[0]
        alone = [quantize_rowwise_fp8(m) for m in mats]
    _assert_bits_equal((q_cat, s_cat), (torch.cat([a[0] for a in alone]), torch.cat([a[1] for a in alone])))


def test_quantize_out_errors():
    x = torch.randn(4, 32)
    q, s = _fp8_buffers(8, 32, "cpu")
    with pytest.raises(ValueError, match=r"out must be"):
        quantize_rowwise_fp8(x, out=(q, s))  # 8 rows for 4
    with pytest.raises(ValueError, match=r"out must be"):
        quantize_rowwise_fp8(x, out=(q[:4].float(), s[:4]))  # not FP8
    wide, _ = _fp8_buffers(4, 64, "cpu")
    with pytest.raises(ValueError, match=r"out must be"):
        quantize_rowwise_fp8(x, out=(wide[:, :32], s[:4]))  # a column block is not whole rows


# --------------------------------------------------------------------------------------------------
# fp8_linear
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [ODD, ALIGNED, (1, 16, 16), (64, 48, 32)], ids=str)
def test_fp8_linear_against_float64(shape, dtype, device):
    x, w = _operands(shape, dtype, device, seed=2)
    y = fp8_linear(x, w)
    assert y.dtype == dtype and y.shape == (shape[0], shape[2]) and y.device.type == device
    assert scaled_mm_applies(x, w) == (shape[1] % 16 == 0 and shape[2] % 16 == 0)
    err = rel_err(y, x.double().cpu() @ w.double().cpu().t())
    assert err <= FP8_TOL, err


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scaled_mm_and_emulation_agree(dtype, device):
    """On an aligned shape both paths compute the same quantised product (up to summation order and
    the output's rounding: on CUDA ``_scaled_mm`` writes bf16, with the tensor cores' fast
    accumulation)."""
    x, w = _operands(ALIGNED, dtype, device, seed=3)
    assert scaled_mm_applies(x, w)
    y = fp8_linear(x, w)
    y_emulated = fp8_linear_reference(x, w)
    output_dtype = torch.bfloat16 if device == "cuda" else dtype
    assert_close(y, y_emulated, output_dtype, "scaled_mm vs emulation", factor=2.0 if device == "cpu" else 0.5)


# --------------------------------------------------------------------------------------------------
# An oracle independent of torch's FP8 cast: e4m3 written out from the format's definition
# --------------------------------------------------------------------------------------------------


def _e4m3_magnitudes() -> torch.Tensor:
    """Every finite non-negative float8_e4m3fn value in code order, from the format's definition:
    exponent field ``e`` (4 bits, bias 7) and mantissa field ``m`` (3 bits) give ``m/8 * 2^-6`` for
    ``e = 0`` (subnormals) and ``(1 + m/8) * 2^(e-7)`` otherwise; ``e = 15, m = 7`` is NaN (the
    format has no infinity), so the largest value is ``1.75 * 2^8 = 448``. Ascending."""
    values = [(m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
              for e in range(16) for m in range(8) if (e, m) != (15, 7)]
    return torch.tensor(values, dtype=torch.float64)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """Round float64 to the nearest fp32 (kept in float64). One float64 operation on fp32 operands
    then this rounding equals the fp32 operation (53 >= 2 * 24 + 2 bits: double rounding is
    innocuous for + - * /)."""
    return t.to(torch.float32).to(torch.float64)


def _quantize_by_definition(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise FP8 from the module's stated definition, in float64, without torch's FP8 cast:
    ``scale = fp32(max(amax, 1e-12) * fp32(1/448))``, ``v = clamp(fp32(x * fp32(1/scale)), +-448)``,
    ``q`` = the e4m3 value nearest to ``v``, ties to the even code. Returns (q values, scales)."""
    x64 = x.detach().cpu().to(torch.float64)
    scale = _fp32(x64.abs().amax(dim=1, keepdim=True).clamp_min(AMAX_FLOOR) * _fp32(torch.tensor(1.0 / 448.0)))
    v = _fp32(x64 * _fp32(1.0 / scale)).clamp(-FP8_MAX, FP8_MAX)
    table = _e4m3_magnitudes()
    a = v.abs()
    hi = torch.searchsorted(table, a.contiguous()).clamp(max=len(table) - 1)  # first value >= |v|
    lo = (hi - 1).clamp(min=0)
    below, above = a - table[lo], table[hi] - a
    take_hi = (above < below) | ((above == below) & (hi % 2 == 0))  # code parity = mantissa parity
    return torch.copysign(torch.where(take_hi, table[hi], table[lo]), v), scale


def test_e4m3_table_is_the_format():
    table = _e4m3_magnitudes()
    assert len(table) == 127 and table[0] == 0 and table[1] == 2.0**-9 and table[-1] == 448.0
    assert (table[1:] > table[:-1]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_matches_the_format_definition(dtype, device):
    """Codes and scales of quantize_rowwise_fp8 (torch's cast on CPU, the Triton kernel on CUDA) equal
    the definition written out above, value for value, on rows over many decades (subnormals, ties)."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(10, 123, generator=gen) * torch.logspace(-5, 4, 10)[:, None]
    x[4, :50] *= 1e-4  # subnormal range after scaling
    x[7, :8] = torch.tensor([448.0, 13.0, 6.5, 0.1, -0.1, 3.25, 3.75, -13.0])  # exact ties at scale 1
    x = x.to(dtype).to(device)
    q, scale = quantize_rowwise_fp8(x)
    q_def, scale_def = _quantize_by_definition(x)
    assert torch.equal(scale.cpu().double(), scale_def)
    n_differ = int((q.cpu().double() != q_def).sum())
    assert n_differ == 0, f"{n_differ} of {q.numel()} codes differ from the e4m3 definition"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_linear_odd_shape_against_the_format_definition(dtype, device):
    """An odd shape (K, O not multiples of 16) runs the emulated product: it must equal
    ``diag(s_x) Q_x Q_w^T diag(s_w)`` built from the definition and multiplied in float64, up to the
    emulation's fp32 sum over K (~K * 2^-24) and the output's rounding to ``dtype`` (2^-9 for bf16):
    within the dtype's kernel tolerance. An unquantised product would be ~3.5% away."""
    x, w = _operands(ODD, dtype, device, seed=3)
    assert not scaled_mm_applies(x, w)
    y = fp8_linear(x, w)
    (qx, sx), (qw, sw) = _quantize_by_definition(x), _quantize_by_definition(w)
    want = (qx * sx) @ (qw * sw).t()
    assert_close(y, want, dtype, "emulated FP8 product vs the definition")
    assert rel_err(y, x.double().cpu() @ w.double().cpu().t()) >= 0.01  # it is an FP8 product, not a 16-bit one


def test_fp8_linear_edges():
    assert fp8_linear(torch.randn(0, 32), torch.randn(16, 32)).shape == (0, 16)
    with pytest.raises(ValueError, match="same K"):
        fp8_linear(torch.randn(4, 32), torch.randn(16, 31))


def test_fp8_supported(monkeypatch):
    ok, why = fp8_supported("cpu")
    assert ok and "emulated" in why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (7, 5))
    ok, why = fp8_supported("cuda")
    assert not ok and "sm_75" in why and "8.9" in why and "Tesla T4" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA H200")
    assert fp8_supported("cuda:0")[0]
    ok, why = fp8_supported("mps")
    assert not ok and "mps" in why


# --------------------------------------------------------------------------------------------------
# LoRA functions with fp8_forward
# --------------------------------------------------------------------------------------------------


def _fp8_twin(pair: Pair) -> lora_projection.LoRAProjection:
    p = pair.proj
    return lora_projection.LoRAProjection(p.weight, p.quant_state, p.lora_A, p.lora_B, p.scaling, fp8_forward=True)


def _grads_of(fn, x, pairs, dys):
    """Run ``fn(x)``, back-propagate ``dys``; return (outputs, dx, [(dA, dB) per pair]) and clear grads."""
    x = x.detach().clone().requires_grad_()
    outs = fn(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, [dy.to(o.dtype) for o, dy in zip(outs, dys)])
    grads = []
    for p in pairs:
        grads.append(None if p.A is None else (p.A.grad.clone(), p.B.grad.clone()))
        if p.A is not None:
            p.A.grad = p.B.grad = None
    return [o.detach() for o in outs], x.grad, grads


class _Counter:
    """Counts FP8 products (``fp8_matmul_quantized``) made by ``projection_forward`` (to prove the
    backward makes none)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = lora_projection.fp8_matmul_quantized

        def counted(*args):
            self.calls += 1
            return real(*args)

        monkeypatch.setattr(lora_projection, "fp8_matmul_quantized", counted)


def _dys(outs64, gen, device):
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(device) for o in outs64]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
@pytest.mark.parametrize("dims", [(123, 77), (128, 96)], ids=["odd", "aligned"])
def test_lora_o_and_qkv_fp8_forward(dims, nf4, dtype, device, monkeypatch):
    hidden, out = dims
    gen = torch.Generator().manual_seed(4)
    kw = dict(nf4=nf4, dtype=dtype, device=device, gen=gen)
    o = Pair(out, hidden, adapter=True, **kw)
    q, k, v = Pair(out, hidden, adapter=True, **kw), Pair(32, hidden, adapter=True, **kw), Pair(32, hidden, adapter=False, **kw)
    x, x64 = _x(dtype, device, gen, shape=(2, 19, hidden))
    counter = _Counter(monkeypatch)

    # lora_o
    y64 = lora_o_reference(x64, o.proj64)
    dys = _dys([y64], gen, device)
    (y8,), dx8, g8 = _grads_of(lambda t: lora_o(t, _fp8_twin(o)), x, [o], dys)
    assert counter.calls == 1  # forward only: the backward makes no FP8 product
    (y16,), dx16, g16 = _grads_of(lambda t: lora_o(t, o.proj), x, [o], dys)
    assert y8.dtype == dtype and rel_err(y8, y64) <= FP8_TOL
    assert torch.equal(dx8, dx16) and all(torch.equal(a, b) for a, b in zip(g8[0], g16[0]))

    # lora_qkv
    counter.calls = 0
    outs64 = lora_qkv_reference(x64, q.proj64, k.proj64, v.proj64)
    dys = _dys(outs64, gen, device)
    twins = [_fp8_twin(p) for p in (q, k, v)]
    outs8, dx8, g8 = _grads_of(lambda t: lora_qkv(t, *twins), x, [q, k, v], dys)
    assert counter.calls == (1 if hidden % 16 == 0 else 3)  # aligned: q, k, v in one product
    outs16, dx16, g16 = _grads_of(lambda t: lora_qkv(t, q.proj, k.proj, v.proj), x, [q, k, v], dys)
    for y8, y64 in zip(outs8, outs64):
        assert rel_err(y8, y64) <= FP8_TOL
    assert torch.equal(dx8, dx16)
    for a, b in zip(g8, g16):
        assert (a is None and b is None) or all(torch.equal(s, t) for s, t in zip(a, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
@pytest.mark.parametrize("dims", [(123, 77), (128, 96)], ids=["odd", "aligned"])
def test_lora_mlp_fp8_forward(dims, nf4, dtype, device, monkeypatch):
    """The MLP backward is the 16-bit one (no FP8 product), but it reads the e, g saved by the
    forward, which now carry the FP8 error; so its gradients match the 16-bit run's to the FP8 bound
    (and, like those, the float64 reference), not bit for bit."""
    hidden, inter = dims
    gen = torch.Generator().manual_seed(5)
    kw = dict(nf4=nf4, dtype=dtype, device=device, gen=gen)
    gate, up, down = Pair(inter, hidden, adapter=True, **kw), Pair(inter, hidden, adapter=True, **kw), Pair(
        hidden, inter, adapter=True, rslora=True, **kw
    )
    pairs = [gate, up, down]
    x, x64 = _x(dtype, device, gen, shape=(2, 19, hidden))
    y64 = lora_mlp_reference(x64, gate.proj64, up.proj64, down.proj64, "swiglu")
    dys = _dys([y64], gen, device)
    counter = _Counter(monkeypatch)
    twins = [_fp8_twin(p) for p in pairs]
    (y8,), dx8, g8 = _grads_of(lambda t: lora_mlp(t, *twins, "swiglu"), x, pairs, dys)
    aligned = hidden % 16 == 0 and inter % 16 == 0
    assert counter.calls == (2 if aligned else 3)  # gate+up (one product when aligned), down; none in backward
    (y16,), dx16, g16 = _grads_of(lambda t: lora_mlp(t, gate.proj, up.proj, down.proj, "swiglu"), x, pairs, dys)
    assert y8.dtype == dtype and rel_err(y8, y64) <= FP8_TOL
    assert rel_err(dx8, dx16) <= FP8_TOL
    for a, b in zip(g8, g16):
        for s, t in zip(a, b):
            assert s.dtype == t.dtype and rel_err(s, t) <= FP8_TOL
    # compute_output=False (the recompute pass): 2 fp8 GEMMs, zeros out, same gradients as fp8 with output
    counter.calls = 0
    (y0,), dx0, g0 = _grads_of(lambda t: lora_mlp(t, *twins, "swiglu", compute_output=False), x, pairs, dys)
    assert counter.calls == (1 if aligned else 2) and not y0.any()
    assert torch.equal(dx0, dx8) and all(torch.equal(s, t) for a, b in zip(g0, g8) for s, t in zip(a, b))


def test_projection_keeps_positional_construction():
    w = torch.randn(16, 32)
    p = lora_projection.LoRAProjection(w, None, None, None, 1.0)
    assert p.fp8_forward is False
    p8 = lora_projection.LoRAProjection(w, None, None, None, 1.0, fp8_forward=1)
    assert p8.fp8_forward is True
    x = torch.randn(5, 32)
    assert torch.equal(lora_projection.projection_forward(x, p8, None, None), fp8_linear(x, w))


# --------------------------------------------------------------------------------------------------
# Grouped FP8 base product: q/k/v and gate/up in one torch._scaled_mm
# --------------------------------------------------------------------------------------------------


class _ProductCounter:
    """Counts the FP8 products themselves: ``torch._scaled_mm`` calls and emulated products."""

    def __init__(self, monkeypatch):
        self.scaled_mm = self.emulated = 0
        real_mm, real_emulated = torch._scaled_mm, fp8_matmul._emulated_product

        def scaled_mm(*args, **kwargs):
            self.scaled_mm += 1
            return real_mm(*args, **kwargs)

        def emulated(*args, **kwargs):
            self.emulated += 1
            return real_emulated(*args, **kwargs)

        monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
        monkeypatch.setattr(fp8_matmul, "_emulated_product", emulated)

    def take(self) -> tuple[int, int]:
        counts = (self.scaled_mm, self.emulated)
        self.scaled_mm = self.emulated = 0
        return counts


def _fp8_proj(pair: Pair, fp8: bool = True) -> lora_projection.LoRAProjection:
    p = pair.proj
    return lora_projection.LoRAProjection(p.weight, p.quant_state, p.lora_A, p.lora_B, p.scaling, fp8_forward=fp8)


def _run_both(fn, x, pairs, dys, monkeypatch):
    """(grouped run, per-projection run): outputs, dx and adapter gradients of ``fn``, the second with
    the group's single FP8 product turned off (each projection quantises its weight and multiplies
    alone, the code of before)."""
    grouped = _grads_of(fn, x, pairs, dys)
    with monkeypatch.context() as m:
        m.setattr(lora_projection, "fp8_group_applies", lambda *args: False)
        alone = _grads_of(fn, x, pairs, dys)
    return grouped, alone


def _assert_same_results(grouped, alone, device):
    """CPU: bit for bit (the column blocks of one product are the products alone). CUDA: cuBLAS may
    pick another tiling of the K sum for another O, so within 2^-8 normwise (a flipped last bit of
    bf16 in some elements; the FP8 error itself is 2^-4)."""
    (outs, dx, grads), (outs_ref, dx_ref, grads_ref) = grouped, alone
    flat = [*outs, dx, *(t for g in grads if g is not None for t in g)]
    flat_ref = [*outs_ref, dx_ref, *(t for g in grads_ref if g is not None for t in g)]
    assert len(flat) == len(flat_ref)
    for a, b in zip(flat, flat_ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        if device == "cpu":
            assert torch.equal(a, b)
        else:
            assert rel_err(a, b) <= 2.0**-8


QKV_CASES = {
    # name: (hidden, (out_q, out_k, out_v), adapters on q/k/v, fp8 flags, expected (scaled_mm, emulated))
    "all-adapters": (128, (96, 32, 32), (True, True, True), (True, True, True), (1, 0)),
    "v-without-adapter": (128, (96, 32, 32), (True, True, False), (True, True, True), (1, 0)),
    "no-adapters": (64, (64, 16, 16), (False, False, False), (True, True, True), (1, 0)),
    # fallbacks: one product per projection, as before
    "v-not-fp8": (128, (96, 32, 32), (True, True, True), (True, True, False), (2, 0)),
    "odd-k-out": (128, (96, 24, 32), (True, True, True), (True, True, True), (2, 1)),
    "odd-hidden": (123, (96, 32, 32), (True, False, True), (True, True, True), (0, 3)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
@pytest.mark.parametrize("case", list(QKV_CASES))
def test_lora_qkv_one_fp8_product_for_the_group(case, nf4, dtype, device, monkeypatch):
    """q, k, v with fp8_forward: one torch._scaled_mm for the three (3 before) when K and each out are
    multiples of 16 and all three have the flag; Q, K, V are then column blocks of its output; outputs
    and gradients equal those of one product per projection. Otherwise the per-projection path."""
    hidden, outs, adapters, flags, expected = QKV_CASES[case]
    gen = torch.Generator().manual_seed(11)
    kw = dict(nf4=nf4, dtype=dtype, device=device, gen=gen)
    pairs = [Pair(o, hidden, adapter=a, **kw) for o, a in zip(outs, adapters)]
    projs = [_fp8_proj(p, f) for p, f in zip(pairs, flags)]
    x, _ = _x(dtype, device, gen, shape=(2, 19, hidden))
    dys = [torch.randn(2, 19, o, generator=gen, dtype=torch.float64).to(device) for o in outs]
    counter = _ProductCounter(monkeypatch)
    grouped, alone = _run_both(lambda t: lora_qkv(t, *projs), x, pairs, dys, monkeypatch)
    per_projection = (3, 0) if expected == (1, 0) else expected  # the run with grouping turned off
    assert counter.take() == (expected[0] + per_projection[0], expected[1] + per_projection[1])
    _grads_of(lambda t: lora_qkv(t, *projs), x, pairs, dys)  # forward + backward, grouped where it applies
    assert counter.take() == expected  # none in the backward
    q, k, v = grouped[0]
    if expected == (1, 0):  # views of one [N, out_q + out_k + out_v] product, no copies
        assert q.stride() == k.stride() == v.stride() == (19 * sum(outs), sum(outs), 1)
        assert k.data_ptr() == q.data_ptr() + outs[0] * q.element_size()
    else:
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    _assert_same_results(grouped, alone, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh"])
@pytest.mark.parametrize("gate_adapter", [True, False], ids=["gate-adapter", "gate-without-adapter"])
def test_lora_mlp_one_fp8_product_for_gate_and_up(gate_adapter, activation, nf4, dtype, device, monkeypatch):
    """gate and up with fp8_forward: one torch._scaled_mm for both (2 before), e and g are its column
    blocks (read in place by the activation, overwritten in place by its backward); with the down
    projection 2 products per forward instead of 3. Outputs and gradients equal the per-projection run."""
    hidden, inter = 128, 96
    gen = torch.Generator().manual_seed(12)
    kw = dict(nf4=nf4, dtype=dtype, device=device, gen=gen)
    pairs = [Pair(inter, hidden, adapter=gate_adapter, **kw), Pair(inter, hidden, adapter=True, **kw),
             Pair(hidden, inter, adapter=True, rslora=True, **kw)]
    projs = [_fp8_proj(p) for p in pairs]
    x, _ = _x(dtype, device, gen, shape=(2, 19, hidden))
    dys = [torch.randn(2, 19, hidden, generator=gen, dtype=torch.float64).to(device)]
    counter = _ProductCounter(monkeypatch)
    fn = lambda t: lora_mlp(t, *projs, activation)  # noqa: E731
    grouped, alone = _run_both(fn, x, pairs, dys, monkeypatch)
    assert counter.take() == (2 + 3, 0)
    _grads_of(fn, x, pairs, dys)
    assert counter.take() == (2, 0)
    _grads_of(lambda t: lora_mlp(t, *projs, activation, compute_output=False), x, pairs, dys)
    assert counter.take() == (1, 0)  # the recompute form: gate and up only
    _assert_same_results(grouped, alone, device)


@needs_interp
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_grouped_fp8_on_the_triton_path(dtype, nf4, monkeypatch):
    """The same under the interpreter: Triton quantisation into the group's row blocks (one-pass NF4
    kernel for NF4), the activation kernels on e, g as column blocks, in-place backward into them."""
    gen = torch.Generator().manual_seed(13)
    kw = dict(nf4=nf4, dtype=dtype, device="cpu", gen=gen)
    qkv = [Pair(o, 128, adapter=a, **kw) for o, a in ((64, True), (32, False), (32, True))]
    mlp = [Pair(96, 128, adapter=True, **kw), Pair(96, 128, adapter=True, **kw), Pair(128, 96, adapter=True, **kw)]
    x, _ = _x(dtype, "cpu", gen, shape=(2, 7, 128))
    counter = _ProductCounter(monkeypatch)
    with use_triton(True):
        projs = [_fp8_proj(p) for p in qkv]
        dys = [torch.randn(2, 7, p.proj.out_features, generator=gen, dtype=torch.float64) for p in qkv]
        _assert_same_results(*_run_both(lambda t: lora_qkv(t, *projs), x, qkv, dys, monkeypatch), "cpu")
        assert counter.take() == (1 + 3, 0)
        projs = [_fp8_proj(p) for p in mlp]
        dys = [torch.randn(2, 7, 128, generator=gen, dtype=torch.float64)]
        _assert_same_results(*_run_both(lambda t: lora_mlp(t, *projs, "swiglu"), x, mlp, dys, monkeypatch), "cpu")
        assert counter.take() == (2 + 3, 0)


def test_grouped_fp8_buffer_is_the_concatenated_quantisation():
    """grouped_fp8_base_forward's product is diag(s_x) Q_x [Q_W1; Q_W2]^T diag([s_W1; s_W2]): each
    weight quantised alone, one FP8 buffer; the outputs are the column blocks of the product."""
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(9, 64, generator=gen)
    ws = [torch.randn(o, 64, generator=gen) for o in (32, 16)]
    projs = tuple(lora_projection.LoRAProjection(w, fp8_forward=True) for w in ws)
    assert lora_projection.fp8_group_applies(x, projs)
    x_q = quantize_rowwise_fp8(x)
    outs = lora_projection.grouped_fp8_base_forward(x, projs, x_q)
    w_q = [quantize_rowwise_fp8(w) for w in ws]
    want = fp8_matmul.fp8_matmul_quantized(x_q, (torch.cat([q for q, _ in w_q]), torch.cat([s for _, s in w_q])),
                                           x.dtype)
    assert torch.equal(torch.cat(outs, dim=1), want)
    assert outs[1].data_ptr() == outs[0].data_ptr() + 32 * 4  # column blocks of one [9, 48] product
    # and each block is the projection's own product, up to the order of its K-sums: a separate, narrower
    # product may take another CPU (or GPU) kernel, so the bound is the summation-order one rather than
    # bit equality: two fp32 sums of K terms differ by at most 2 K u sum_k |x_k w_k| (u = 2^-24).
    for out, (q, s_w) in zip(outs, w_q):
        alone = fp8_matmul.fp8_matmul_quantized(x_q, (q, s_w), x.dtype)
        magnitude = (x_q[0].float() * x_q[1]).abs() @ (q.float() * s_w).abs().t()
        assert ((out - alone).abs() <= 2 * x.shape[1] * 2.0**-24 * magnitude).all()
    # not applicable: one projection, an odd out, a projection without the flag, no tokens
    assert not lora_projection.fp8_group_applies(x, projs[:1])
    odd = lora_projection.LoRAProjection(torch.randn(24, 64), fp8_forward=True)
    assert not lora_projection.fp8_group_applies(x, (projs[0], odd))
    assert not lora_projection.fp8_group_applies(x, (projs[0], lora_projection.LoRAProjection(ws[1])))
    assert not lora_projection.fp8_group_applies(x[:0], projs)
