"""NF4 dequantisation: bit-exact against the NF4 format decoded from its definition
(``tests/nf4_format.py``: numpy fp32, element by element), on the reference path and the Triton kernel
under the interpreter (CPU) and on CUDA; NaN poison, blocksizes, inputs and errors.

bitsandbytes' CPU ``dequantize_4bit`` is never an oracle here: bitsandbytes 0.50.2 decodes some
shapes wrongly on AVX-512 CPUs (48 x 80 below: rows that are not whole 64-element blocks). Weights
are still *packed* by bitsandbytes' CPU quantiser, and ``test_bitsandbytes_cpu_packing_is_valid_nf4``
proves those bytes are a correct NF4 encoding of the weight. bitsandbytes' own decode is compared
only on CUDA (``gpu`` tests), where it is known good.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bnbF  # noqa: E402

from notebookkit.kernels.nf4 import NF4_LEVELS, dequantize_nf4, dequantize_nf4_reference  # noqa: E402
from notebookkit.kernels.runtime import interpreter_on, use_triton  # noqa: E402
from notebookkit.kernels.testing import poisoned  # noqa: E402
from tests.nf4_format import (  # noqa: E402
    NF4_TABLE,
    assert_packing_is_nearest_level,
    decode_nf4_by_definition,
    nf4_levels_from_quantiles,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PATHS = [
    "reference",
    pytest.param("triton", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")),
]
# 48 x 80 and 128 x 32: rows that are not whole 64-element blocks, which bitsandbytes 0.50.2's AVX-512
# CPU decode gets wrong; 123 x 77: odd rows (bitsandbytes takes its generic path there); 256 x 512: whole blocks.
SHAPES = [(123, 77), (256, 512), (48, 80), (128, 32)]
SHAPE_IDS = ["123x77", "256x512", "48x80", "128x32"]


def _weight(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.05).to(dtype)


def _quantize(shape, dtype, nested, blocksize=64, seed=0):
    """Pack a random weight with bitsandbytes' CPU quantiser: (packed uint8, QuantState)."""
    w = _weight(shape, dtype, seed)
    return bnbF.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")


def _run(path, packed, qs, **kw):
    if path == "reference":
        return dequantize_nf4_reference(packed, qs, **kw)
    with use_triton(True):
        return dequantize_nf4(packed, qs, **kw)


def _assert_bits_equal(out, ref, what="the NF4 definition"):
    out = out.cpu()
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "NaN/Inf in output: some elements were not written"
    diff = (out != ref).sum().item()
    assert torch.equal(out, ref), f"{diff} of {ref.numel()} elements differ from {what}"


def test_nf4_table_is_the_format():
    """The 16 levels follow from their definition (normal quantiles), and notebookkit and bitsandbytes
    carry those levels. The published fp32 table was computed from fp32 probabilities
    (``torch.linspace``), which moves a level by at most 1.9e-7 from the float64 derivation; 3e-7
    allows that and nothing else (neighbouring levels are >= 0.08 apart)."""
    derived = np.array(nf4_levels_from_quantiles())
    assert np.abs(derived - np.array(NF4_TABLE)).max() <= 3e-7
    table = torch.tensor(NF4_TABLE, dtype=torch.float32)
    assert torch.equal(torch.tensor(NF4_LEVELS, dtype=torch.float32), table)
    assert torch.equal(bnbF.get_4bit_type("nf4", device="cpu"), table)  # a constant table, not a decode


@pytest.mark.parametrize("blocksize", [64, 32, 256, 4096])
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_bitsandbytes_cpu_packing_is_valid_nf4(shape, dtype, nested, blocksize):
    """The CPU quantiser's bytes (which every CPU test packs with) are a correct NF4 encoding: the
    right absmax per block, each code a nearest level, and the decode within the NF4 rounding bound
    of the original weight (``tests/nf4_format.assert_packing_is_nearest_level``)."""
    w = _weight(shape, dtype, seed=blocksize)
    packed, qs = bnbF.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")
    assert packed.shape == ((shape[0] * shape[1] + 1) // 2, 1)
    assert_packing_is_nearest_level(w, packed, qs)


def test_packing_check_catches_a_wrong_encoding():
    """The packing check can fail: one nibble moved to a neighbouring level, or one block's absmax off."""
    w = _weight((48, 80), torch.float32)
    packed, qs = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=False, quant_type="nf4")
    bad = packed.clone()
    bad[7, 0] = (bad[7, 0] & 0x0F) | ((((bad[7, 0] >> 4) + 1) % 16) << 4)
    with pytest.raises(AssertionError, match="not a nearest NF4 level"):
        assert_packing_is_nearest_level(w, bad, qs)
    qs_bad = copy.copy(qs)
    qs_bad.absmax = qs.absmax.clone()
    qs_bad.absmax[3] *= 1.01
    with pytest.raises(AssertionError, match="absmax"):
        assert_packing_is_nearest_level(w, packed, qs_bad)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("nested", [True, False], ids=["nested", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_bit_exact_vs_the_definition(shape, dtype, nested, path):
    packed, qs = _quantize(shape, dtype, nested)
    out = _run(path, packed, qs, out=poisoned(shape, dtype, "cpu"))
    _assert_bits_equal(out, decode_nf4_by_definition(packed, qs))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("blocksize", [32, 128, 256, 4096])
def test_other_blocksizes(blocksize, path):
    packed, qs = _quantize((97, 131), torch.bfloat16, nested=True, blocksize=blocksize, seed=1)
    _assert_bits_equal(_run(path, packed, qs), decode_nf4_by_definition(packed, qs))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_out_dtype_override(out_dtype, path):
    """Dequantising to another dtype than the one quantised from: fp32 value, one rounding to out_dtype."""
    packed, qs = _quantize((64, 90), torch.float32, nested=True, seed=2)
    ref = decode_nf4_by_definition(packed, qs, out_dtype=out_dtype)
    _assert_bits_equal(_run(path, packed, qs, out_dtype=out_dtype), ref)


def test_params4bit_and_storage_dtype():
    """A Params4bit carries its QuantState; a non-uint8 quant_storage is read as bytes."""
    p = bnb.nn.Params4bit(torch.randn(48, 80) * 0.1, requires_grad=False, quant_type="nf4")
    p = p._quantize("cpu")
    assert p.quant_state.nested  # Params4bit compresses its statistics by default
    ref = decode_nf4_by_definition(p)
    _assert_bits_equal(dequantize_nf4(p), ref)
    with use_triton(interpreter_on()):
        _assert_bits_equal(dequantize_nf4(p.data.reshape(-1).view(torch.int16), p.quant_state), ref)


def test_reference_and_triton_agree_bf16_odd():
    packed, qs = _quantize((33, 45), torch.bfloat16, nested=False, seed=3)
    if not interpreter_on():
        pytest.skip("needs TRITON_INTERPRET=1")
    with use_triton(True):
        a = dequantize_nf4(packed, qs)
    _assert_bits_equal(a, dequantize_nf4_reference(packed, qs), "the reference path")


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


def test_a_weight_repacked_by_bitsandbytes_cpu_inference_is_refused():
    """bitsandbytes' eval-mode CPU forward (on CPUs with AVX512-BF16) repacks a weight in place: codes
    reordered, scales rounded to bf16. Read as NF4 it would decode to other values without a word."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    packed, qs = _quantize((64, 128), torch.float32, nested=False)
    repacked, qs_repacked = _convert_weight_packed_for_cpu(packed.clone(), copy.deepcopy(qs))
    with pytest.raises(ValueError, match="repacked it in place.*Reload the model"):
        dequantize_nf4(repacked, qs_repacked)


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
@pytest.mark.parametrize("shape", [(8192, 4096), (123, 77), (48, 80)], ids=["8192x4096", "123x77", "48x80"])
def test_gpu_bit_exact(shape, dtype, nested):
    """The CUDA kernel against the definition, and against bitsandbytes' CUDA decode (known good)."""
    if _bnb_cuda_works():
        g = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(shape, generator=g, device="cuda") * 0.05).to(dtype)
        packed, qs = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")
        bnb_cuda = bnbF.dequantize_4bit(packed, qs, quant_type="nf4")
    else:  # quantise on the CPU (a valid encoding: test_bitsandbytes_cpu_packing_is_valid_nf4)
        packed, qs = _quantize(shape, dtype, nested)
        packed = packed.cuda()
        qs.to("cuda")  # in place
        bnb_cuda = None
    out = dequantize_nf4(packed, qs, out=poisoned(shape, dtype, "cuda"))
    _assert_bits_equal(out, decode_nf4_by_definition(packed, qs))
    if bnb_cuda is not None:
        _assert_bits_equal(out, bnb_cuda.cpu(), "bitsandbytes' CUDA decode")
