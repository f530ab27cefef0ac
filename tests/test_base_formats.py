"""The base-format record agrees with the bytes the formats' own packers and bitsandbytes produce."""

import pytest
import torch

from notebookkit.base_formats import BASE_FORMATS, base_format
from notebookkit.kernels.q2 import quantize_q2
from notebookkit.kernels.ternary import quantize_ternary


@pytest.mark.parametrize("shape", [(40, 192), (7, 320)])
def test_two_bit_and_ternary_bytes_are_what_their_packers_hold(shape):
    w = torch.randn(*shape)
    n, k = shape
    assert quantize_q2(w).nbytes() == pytest.approx(BASE_FORMATS["2bit"].bytes_per_weight(k) * n * k)
    assert quantize_ternary(w).nbytes() == pytest.approx(BASE_FORMATS["ternary"].bytes_per_weight(k) * n * k)


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_bytes_are_what_bitsandbytes_holds(double_quant):
    functional = pytest.importorskip("bitsandbytes.functional")
    n, k = 256, 4096  # 16384 absmax: a whole number of double-quantisation blocks of 256
    packed, state = functional.quantize_4bit(torch.randn(n, k, dtype=torch.float16), blocksize=64,
                                             compress_statistics=double_quant, quant_type="nf4")
    held = packed.numel() * packed.element_size() + state.absmax.numel() * state.absmax.element_size()
    if double_quant:
        held += state.state2.absmax.numel() * state.state2.absmax.element_size()
    assert held == BASE_FORMATS["nf4"].bytes_per_weight(k, double_quant=double_quant) * n * k


def test_sixteen_bit_is_the_dtype_and_unknown_names_are_refused():
    assert BASE_FORMATS["16bit"].bytes_per_weight(4096, dtype_bytes=2) == 2
    with pytest.raises(ValueError, match="one of"):
        base_format("3bit")
