"""Fused ternary GEMMs (notebookkit.kernels.ternary_matmul): forward ``x @ W^T`` and input gradient
``dy @ W`` against float64 on the dequantised weight, reference path and Triton under the interpreter,
fp32 and fp16 (bf16 ``tl.dot`` is wrong under the interpreter: GPU only). Fresh inputs, odd shapes."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_close
from notebookkit.kernels.ternary import dequantize_ternary_reference, quantize_ternary
from notebookkit.kernels.ternary_matmul import (
    ternary_input_grad,
    ternary_input_grad_reference,
    ternary_linear,
    ternary_matmul,
    ternary_matmul_reference,
)

PATHS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1"))]
DTYPES = [torch.float32, torch.float16]
# (lead dims of x, out N, in K, group): M = 1, 21 (< 16 and > 16 row tiles), K not a multiple of 4 or 64
CASES = [((1,), 67, 203, "row"), ((3, 7), 45, 130, 16), ((2, 35), 70, 97, 64)]


def _setup(lead, n, k, group, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = quantize_ternary(torch.randn(n, k, generator=g) * 0.1, group)
    w64 = dequantize_ternary_reference(q, torch.float32).double()
    x = torch.randn(*lead, k, generator=g).to(dtype)
    dy = torch.randn(*lead, n, generator=g).to(dtype)
    return q, w64, x, dy


def _run(path, fn, ref, *args):
    if path == "reference":
        return ref(*args)
    with use_triton(True):
        return fn(*args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_forward_and_input_grad(case, path, dtype):
    lead, n, k, group = CASES[case]
    q, w64, x, dy = _setup(lead, n, k, group, dtype, seed=10 + case)
    y = _run(path, ternary_matmul, ternary_matmul_reference, x, q)
    dx = _run(path, ternary_input_grad, ternary_input_grad_reference, dy, q)
    assert y.shape == (*lead, n) and y.dtype == dtype
    assert dx.shape == (*lead, k) and dx.dtype == dtype
    assert_close(y, x.double() @ w64.t(), dtype, "forward")
    assert_close(dx, dy.double() @ w64, dtype, "input grad")


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
def test_autograd_through_frozen_base():
    q, w64, x, dy = _setup((5,), 40, 52, "row", torch.float32, seed=20)
    x = x[:, :].clone().requires_grad_(True)
    with use_triton(True):
        y = ternary_linear(x, q)
        y.backward(dy)
    assert_close(y, x.detach().double() @ w64.t(), torch.float32, "forward")
    assert_close(x.grad, dy.double() @ w64, torch.float32, "x.grad")


def test_bad_inputs():
    q = quantize_ternary(torch.randn(8, 12))
    with pytest.raises(ValueError, match="last dimension 11"):
        ternary_matmul(torch.randn(2, 11), q)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        ternary_matmul(torch.ones(2, 12, dtype=torch.int32), q)
    with pytest.raises(ValueError, match="needs 8"):
        ternary_input_grad(torch.randn(2, 12), q)
    with pytest.raises(TypeError, match="takes a TernaryWeight"):
        ternary_matmul(torch.randn(2, 12), torch.randn(8, 12))
