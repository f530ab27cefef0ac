"""Q2 fused dequant-in-the-GEMM (``notebookkit.kernels.q2_matmul``): forward ``x W^T`` and input gradient
``dy W`` of the Triton kernels under the interpreter (CPU) against the float64 product of the weight
decoded by the reference, fp32 and fp16 (bf16 ``tl.dot`` is garbage under triton 3.9's interpreter: bf16
runs on the GPU only), odd shapes, strided rows, the autograd function, and bad input."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.q2 import dequantize_q2_reference, quantize_q2
from notebookkit.kernels.q2_matmul import (
    q2_linear,
    q2_matmul,
    q2_matmul_backward_input,
    q2_matmul_backward_input_reference,
    q2_matmul_reference,
)
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_close

pytestmark = pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")

# (M, N, K, group): rows/cols not multiples of the 64 tiles; K from 3 groups of 64 to 2 groups of 128
CASES = [(37, 77, 192, 64), (3, 50, 256, 128), (70, 19, 96, 32)]
DTYPES = [torch.float32, torch.float16]


def _setup(m, n, k, gs, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = quantize_q2(torch.randn(n, k, generator=g) * 0.02, gs)
    x = torch.randn(m, k, generator=g).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    w64 = dequantize_q2_reference(q, dtype).double()
    return q, x, dy, w64


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("m,n,k,gs", CASES, ids=[f"{m}x{n}x{k}g{g}" for m, n, k, g in CASES])
def test_forward_and_input_grad_match_reference(m, n, k, gs, dtype):
    q, x, dy, w64 = _setup(m, n, k, gs, dtype, seed=m)
    with use_triton(True):
        y = q2_matmul(x, q)
        dx = q2_matmul_backward_input(dy, q)
    assert y.dtype == dtype and y.shape == (m, n) and dx.dtype == dtype and dx.shape == (m, k)
    assert_close(y, x.double() @ w64.t(), dtype, "forward")
    assert_close(dx, dy.double() @ w64, dtype, "input grad")
    # the CPU references compute the same function
    assert_close(q2_matmul_reference(x, q), x.double() @ w64.t(), dtype, "forward reference")
    assert_close(q2_matmul_backward_input_reference(dy, q), dy.double() @ w64, dtype, "input grad reference")


def test_strided_rows_and_leading_dims():
    q, x, dy, w64 = _setup(10, 33, 128, 64, torch.float32)
    wide = torch.randn(2, 5, 200)
    xs = wide[..., 10:138]  # row stride 200, unit column stride
    with use_triton(True):
        y = q2_matmul(xs, q)
    assert y.shape == (2, 5, 33)
    assert_close(y, xs.double() @ w64.t(), torch.float32, "strided forward")
    xc = torch.randn(2, 5, 256)[..., ::2]  # column stride 2: the launchers copy it to unit stride (as_rows)
    with use_triton(True):
        assert_close(q2_matmul(xc, q), xc.double() @ w64.t(), torch.float32, "column-strided forward")
        assert_close(q2_matmul_backward_input(xc[..., :33], q), xc[..., :33].double() @ w64, torch.float32,
                     "column-strided input grad")


def test_autograd_input_gradient_only():
    q, x, dy, w64 = _setup(9, 40, 128, 64, torch.float32, seed=5)
    x = x.requires_grad_()
    with use_triton(True):
        y = q2_linear(x, q)
        y.backward(dy)
    assert_close(y, x.detach().double() @ w64.t(), torch.float32, "q2_linear forward")
    assert_close(x.grad, dy.double() @ w64, torch.float32, "q2_linear dx")
    assert not q.scale.requires_grad and q.scale.grad is None


@pytest.mark.parametrize("triton", [False, True], ids=["reference", "triton"])
def test_bad_input_messages(triton):
    q, x, dy, _ = _setup(4, 16, 64, 32, torch.float32)
    with use_triton(triton):
        with pytest.raises(ValueError, match="x has 63 features, the Q2 weight \\(16, 64\\) needs 64"):
            q2_matmul(x[:, :63], q)
        with pytest.raises(ValueError, match="dy must be float16, bfloat16 or float32"):
            q2_matmul_backward_input(dy.double(), q)
