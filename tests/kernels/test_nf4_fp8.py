"""NF4 -> FP8 rowwise in one pass: bit-exact against the two-step route (dequantise to the compute
dtype, then quantise rowwise), per compute dtype, nested and plain absmax, odd row counts, rows that
are not a power of two of blocks, and the fallbacks. CPU: the kernel under the interpreter; GPU: CUDA."""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bnbF  # noqa: E402

from notebookkit.kernels import fp8_matmul, nf4_fp8  # noqa: E402
from notebookkit.kernels.nf4 import dequantize_nf4_reference  # noqa: E402
from notebookkit.kernels.nf4_fp8 import quantize_nf4_rowwise_fp8, quantize_nf4_rowwise_fp8_reference  # noqa: E402
from notebookkit.kernels.runtime import interpreter_on, use_triton  # noqa: E402
from tests.kernel_launches import spy_launches  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
# (rows, cols): 3 blocks per row (not a power of two), 1 block, 7 blocks with an odd row count
SHAPES = [(37, 192), (5, 64), (19, 448)]


def _quantized(shape, dtype, nested, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    w[1] *= 40.0  # a row with a much larger range than the others
    packed, qs = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")
    if device != "cpu":
        packed = packed.to(device)
        qs.to(device)  # in place
    return packed, qs


def _assert_same(got, want):
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    assert torch.equal(s, s_ref), f"{(s != s_ref).sum().item()} scales differ"
    diff = (q.view(torch.uint8) != q_ref.view(torch.uint8)).sum().item()
    assert diff == 0, f"{diff} of {q.numel()} FP8 codes differ"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_one_pass_equals_dequantise_then_quantise(shape, dtype, nested, device):
    packed, qs = _quantized(shape, dtype, nested, device)
    with use_triton(True):
        got = quantize_nf4_rowwise_fp8(packed, qs, dtype)
        two_step = quantize_nf4_rowwise_fp8_reference(packed, qs, dtype)
    with use_triton(False):
        torch_only = fp8_matmul.quantize_rowwise_fp8(dequantize_nf4_reference(packed, qs, out_dtype=dtype))
    _assert_same(got, two_step)
    _assert_same(got, torch_only)
    # and it stands for the weight: q * s is the dequantised weight within e4m3's rounding
    dense = dequantize_nf4_reference(packed, qs, out_dtype=dtype).float()
    q, s = got
    err = ((q.float() * s - dense).abs() - dense.abs() * 2.0**-4).max().item()
    assert err <= 2.0**-10 * s.max().item()


@pytest.mark.parametrize("device", DEVICES)
def test_compute_dtype_differs_from_the_quantised_dtype(device):
    """A bf16-quantised weight used in an fp16 forward rounds to fp16 first, as dequantize_nf4 does."""
    packed, qs = _quantized((9, 128), torch.bfloat16, True, device, seed=3)
    with use_triton(True):
        _assert_same(quantize_nf4_rowwise_fp8(packed, qs, torch.float16),
                     quantize_nf4_rowwise_fp8_reference(packed, qs, torch.float16))


@pytest.mark.parametrize(
    "dtype, triton_path",
    [(torch.float32, True), (torch.float16, True), (torch.float32, False), (torch.bfloat16, False)],
    ids=["fp32-triton", "fp16-triton", "fp32-torch", "bf16-torch"],
)
@pytest.mark.parametrize("cols", [192, 96], ids=["whole-blocks", "fallback"])
def test_quantize_into_row_slices_of_one_buffer(cols, dtype, triton_path):
    """``out=``: NF4 weights quantised into consecutive row blocks of one FP8 buffer give the bits of
    quantising each alone, on the one-pass kernel (rows of whole blocks under the interpreter), on the
    two-step fallback (96 = 1.5 blocks per row) and on plain PyTorch."""
    if triton_path and not interpreter_on():
        pytest.skip("needs TRITON_INTERPRET=1")
    weights = [_quantized((rows, cols), dtype, nested, "cpu", seed=rows)
               for rows, nested in ((37, True), (16, False), (5, True))]
    total = 37 + 16 + 5
    gen = torch.Generator().manual_seed(0)
    q_cat = torch.randint(0, 120, (total, cols), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s_cat = torch.full((total, 1), -3.0)
    start = 0
    with use_triton(triton_path):
        for packed, qs in weights:
            rows = qs.shape[0]
            out = (q_cat[start:start + rows], s_cat[start:start + rows])
            got = quantize_nf4_rowwise_fp8(packed, qs, dtype, out=out)
            assert got[0] is out[0] and got[1] is out[1]
            start += rows
        alone = [quantize_nf4_rowwise_fp8(packed, qs, dtype) for packed, qs in weights]
    _assert_same((q_cat, s_cat), (torch.cat([a[0] for a in alone]), torch.cat([a[1] for a in alone])))
    with pytest.raises(ValueError, match="out must be"):
        packed, qs = weights[0]
        quantize_nf4_rowwise_fp8(packed, qs, dtype, out=(q_cat[:5], s_cat[:5]))


def test_fallbacks_give_the_same_result(monkeypatch):
    """Rows that are not whole blocks, rows longer than one program, and plain CPU use the two-step route."""
    calls = spy_launches(monkeypatch, nf4_fp8, "_nf4_to_fp8_rowwise_kernel")
    packed, qs = _quantized((6, 96), torch.float32, False, "cpu")  # 96 = 1.5 blocks per row
    with use_triton(True):
        _assert_same(quantize_nf4_rowwise_fp8(packed, qs, torch.float32),
                     quantize_nf4_rowwise_fp8_reference(packed, qs, torch.float32))
    packed, qs = _quantized((4, 256), torch.float32, False, "cpu")
    with use_triton(False):  # CPU without Triton
        _assert_same(quantize_nf4_rowwise_fp8(packed, qs, torch.float32),
                     quantize_nf4_rowwise_fp8_reference(packed, qs, torch.float32))
    monkeypatch.setattr(fp8_matmul, "ONE_PASS_MAX_K", 128)  # a 256-long row no longer fits one program
    with use_triton(True):
        _assert_same(quantize_nf4_rowwise_fp8(packed, qs, torch.float32),
                     quantize_nf4_rowwise_fp8_reference(packed, qs, torch.float32))
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(14336, 4096), (4096, 14336)], ids=["up-8b", "down-8b"])
def test_gpu_real_shapes(shape):
    packed, qs = _quantized(shape, torch.bfloat16, True, "cuda")
    _assert_same(quantize_nf4_rowwise_fp8(packed, qs, torch.bfloat16),
                 quantize_nf4_rowwise_fp8_reference(packed, qs, torch.bfloat16))
