"""NF4 dequantisation: bit-exact against bitsandbytes (CPU in CI: reference path and the Triton kernel
under the interpreter; CUDA on the GPU machine), NaN poison, blocksizes, inputs and errors."""

from __future__ import annotations

import copy

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bnbF  # noqa: E402

from notebookkit.kernels.nf4 import NF4_LEVELS, dequantize_nf4, dequantize_nf4_reference  # noqa: E402
from notebookkit.kernels.runtime import interpreter_on, use_triton  # noqa: E402
from notebookkit.kernels.testing import poisoned  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PATHS = [
    "reference",
    pytest.param("triton", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")),
]


def _quantize(shape, dtype, nested, blocksize=64, seed=0):
    """Quantise a random weight with bitsandbytes on the CPU: (packed uint8, QuantState)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    return bnbF.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")


def _run(path, packed, qs, **kw):
    if path == "reference":
        return dequantize_nf4_reference(packed, qs, **kw)
    with use_triton(True):
        return dequantize_nf4(packed, qs, **kw)


def _assert_bits_equal(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "NaN/Inf in output: some elements were not written"
    diff = (out != ref).sum().item()
    assert torch.equal(out, ref), f"{diff} of {ref.numel()} elements differ from bitsandbytes"


def test_levels_match_bitsandbytes():
    assert torch.equal(torch.tensor(NF4_LEVELS, dtype=torch.float32), bnbF.get_4bit_type("nf4", device="cpu"))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(123, 77), (256, 512)], ids=["123x77", "256x512"])
def test_bit_exact_vs_bitsandbytes(shape, dtype, nested, path):
    packed, qs = _quantize(shape, dtype, nested)
    assert packed.shape == ((shape[0] * shape[1] + 1) // 2, 1)
    ref = bnbF.dequantize_4bit(packed, qs, quant_type="nf4")
    out = _run(path, packed, qs, out=poisoned(shape, dtype, "cpu"))
    _assert_bits_equal(out, ref)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("blocksize", [128, 256, 4096])
def test_other_blocksizes(blocksize, path):
    packed, qs = _quantize((97, 131), torch.bfloat16, nested=True, blocksize=blocksize, seed=1)
    ref = bnbF.dequantize_4bit(packed, qs, quant_type="nf4")
    _assert_bits_equal(_run(path, packed, qs), ref)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_out_dtype_override(out_dtype, path):
    """Dequantising to another dtype than the one quantised from equals bnb with that dtype."""
    packed, qs = _quantize((64, 90), torch.float32, nested=True, seed=2)
    qs2 = copy.copy(qs)
    qs2.dtype = out_dtype
    ref = bnbF.dequantize_4bit(packed, qs2, quant_type="nf4")
    _assert_bits_equal(_run(path, packed, qs, out_dtype=out_dtype), ref)


def test_params4bit_and_storage_dtype():
    """A Params4bit carries its QuantState; a non-uint8 quant_storage is read as bytes."""
    p = bnb.nn.Params4bit(torch.randn(48, 80) * 0.1, requires_grad=False, quant_type="nf4")
    p = p._quantize("cpu")
    ref = bnbF.dequantize_4bit(p.data, p.quant_state, quant_type="nf4")
    _assert_bits_equal(dequantize_nf4(p), ref)
    with use_triton(interpreter_on()):
        _assert_bits_equal(dequantize_nf4(p.data.reshape(-1).view(torch.int16), p.quant_state), ref)


def test_reference_and_triton_agree_bf16_odd():
    packed, qs = _quantize((33, 45), torch.bfloat16, nested=False, seed=3)
    if not interpreter_on():
        pytest.skip("needs TRITON_INTERPRET=1")
    with use_triton(True):
        a = dequantize_nf4(packed, qs)
    _assert_bits_equal(a, dequantize_nf4_reference(packed, qs))


def test_errors_speak_to_the_user():
    packed, qs = _quantize((16, 64), torch.float16, nested=False)
    with pytest.raises(ValueError, match="QuantState"):
        dequantize_nf4(packed, None)
    fp4 = copy.copy(qs)
    fp4.quant_type = "fp4"
    with pytest.raises(ValueError, match="nf4"):
        dequantize_nf4(packed, fp4)
    other_packed, _ = _quantize((16, 32), torch.float16, nested=False)
    with pytest.raises(ValueError, match="does not belong|needs"):
        dequantize_nf4(other_packed, qs)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        dequantize_nf4(packed, qs, out_dtype=torch.int8)


# --------------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------------


def _bnb_cuda_works() -> bool:
    try:
        x = torch.randn(64, 64, device="cuda", dtype=torch.float16)
        q, s = bnbF.quantize_4bit(x, quant_type="nf4")
        bnbF.dequantize_4bit(q, s, quant_type="nf4")
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(8192, 4096), (123, 77)], ids=["8192x4096", "123x77"])
def test_gpu_bit_exact(shape, dtype, nested):
    if _bnb_cuda_works():
        g = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(shape, generator=g, device="cuda") * 0.05).to(dtype)
        packed, qs = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")
        ref = bnbF.dequantize_4bit(packed, qs, quant_type="nf4")
    else:  # quantise on the CPU, compare against the (bit-exact on CPU) reference
        packed, qs = _quantize(shape, dtype, nested)
        packed = packed.cuda()
        qs.to("cuda")  # in place
        ref = dequantize_nf4_reference(packed, qs)
    out = dequantize_nf4(packed, qs, out=poisoned(shape, dtype, "cuda"))
    _assert_bits_equal(out, ref)
    _assert_bits_equal(out, dequantize_nf4_reference(packed, qs))
