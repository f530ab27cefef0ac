"""The decode matvec of 2-bit and ternary bases (``notebookkit.kernels.low_bit_matvec``) under the interpreter
against the float64 product of the weight decoded in fp32 by each format's reference: fp32, fp16 and bf16 (no
``tl.dot``, so bf16 runs here too), odd N, steps of one block and of several, blocks of 64 down to 8 weights,
one scale a row, several launch configurations, ``x`` not 8-byte aligned, the hand-over above ``MAX_ROWS``
and for weights the kernel cannot take (a ternary K that is not a multiple of 4), and bad input."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.low_bit_matvec import MAX_ROWS, block_bytes, low_bit_matvec, low_bit_matvec_reference
from notebookkit.kernels.q2 import dequantize_q2_reference, quantize_q2
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_close
from notebookkit.kernels.ternary import dequantize_ternary_reference, quantize_ternary

pytestmark = pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (format, N, K, group, config = (BLOCK_N, blocks a step, warps)): steps of several blocks and of one block
CASES = [
    ("2bit", 45, 192, 64, None),           # the library's CONFIG (one step past K)
    ("2bit", 45, 192, 64, (8, 2, 4)),      # steps of two blocks of 64, the last partly past K
    ("2bit", 9, 192, 64, (4, 1, 2)),       # a step of one block (few rows: the interpreter runs a program at a time)
    ("2bit", 7, 256, 16, (2, 4, 1)),       # groups of 16: blocks of 16 weights
    ("ternary", 45, 176, "row", (8, 4, 4)),  # one scale a row, K = 11 blocks of 16
    ("ternary", 5, 120, 40, (1, 2, 2)),    # groups of 40: blocks of 8 weights
]


def _weight(fmt, n, k, group, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    if fmt == "2bit":
        q = quantize_q2(w, group)
        return q, lambda dtype: dequantize_q2_reference(q, dtype)
    t = quantize_ternary(w, group)
    return t, lambda dtype: dequantize_ternary_reference(t, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("fmt,n,k,group,config", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}g{c[3]}-{'.'.join(map(str, c[4] or ['library']))}" for c in CASES])
def test_matvec_matches_the_dense_product(fmt, n, k, group, config, dtype):
    w, dense = _weight(fmt, n, k, group, seed=n + k)
    w64 = dense(torch.float32).double()
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    for rows in (1, 3):
        xs = torch.cat([x.new_zeros(1), x[:rows].flatten()])[1:].reshape(rows, 1, k)  # starts 1 element in
        with use_triton(True):
            y = low_bit_matvec(xs, w, config)
        assert y.shape == (rows, 1, n) and y.dtype == dtype
        assert_close(y.reshape(rows, n), x[:rows].double() @ w64.t(), dtype, f"{fmt} matvec {rows} rows")
    assert_close(low_bit_matvec_reference(x, w), x.double() @ w64.t(), dtype, f"{fmt} reference")


@pytest.mark.parametrize("fmt,rows,k,group", [("2bit", MAX_ROWS + 2, 128, 64), ("ternary", 1, 190, "row")],
                         ids=["2bit-more-rows", "ternary-K-not-a-multiple-of-4"])
def test_hand_over_to_the_gemm(fmt, rows, k, group):
    w, dense = _weight(fmt, 21, k, group, seed=3)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2))
    with use_triton(True):
        y = low_bit_matvec(x, w)
    assert_close(y, x.double() @ dense(torch.float32).double().t(), torch.float32, f"{fmt} {rows} rows")


@pytest.mark.parametrize("triton", [False, True], ids=["reference", "triton"])
def test_bad_input_messages(triton):
    q, _ = _weight("2bit", 16, 64, 32, seed=0)
    t, _ = _weight("ternary", 16, 64, "row", seed=0)
    x = torch.randn(1, 63)
    with use_triton(triton):
        with pytest.raises(ValueError, match="x has 63 features, the Q2 weight \\(16, 64\\) needs 64"):
            low_bit_matvec(x, q)
        with pytest.raises(ValueError, match="x has last dimension 63, the ternary weight of shape \\(16, 64\\) needs 64"):
            low_bit_matvec(x, t)
        with pytest.raises(TypeError, match="takes a Q2Weight or a TernaryWeight, got Tensor"):
            low_bit_matvec(x, torch.zeros(16, 63))


def test_block_bytes():
    """The kernel's block: 64 weights where the groups allow, fewer for small groups, none for a ragged K."""
    q, _ = _weight("2bit", 3, 256, 16, seed=0)
    t, _ = _weight("ternary", 3, 120, 40, seed=0)
    r, _ = _weight("ternary", 3, 190, "row", seed=0)
    q64, _ = _weight("2bit", 3, 256, 64, seed=0)
    assert block_bytes(q64.codes, 256, 64, 4) == 16
    assert block_bytes(q.codes, 256, 16, 16) == 4
    assert block_bytes(t.packed, 120, 40, 3) == 2
    assert block_bytes(r.packed, 190, 190, 1) == 0
