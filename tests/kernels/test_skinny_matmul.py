"""``x @ a^T`` for a few rows and a short matrix (``notebookkit.kernels.skinny_matmul``): the kernel under the
interpreter (CPU) and on CUDA against float64, held to the rounding bound of an fp32 sum of K exact products
rounded once: ``|u - ref| <= unit * |ref| + g * sum_k |x a|`` with ``g = K 2^-24 / (1 - K 2^-24)``."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.skinny_matmul import MAX_OUT, MAX_ROWS, skinny_matmul, skinny_matmul_supported

needs_interpreter = pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _operands(m, r, k, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + 5, generator=g).to(dtype).to(device)[:, 3:3 + k]  # rows k + 5 apart
    a = (torch.randn(r, k, generator=g) * 0.05).to(dtype).to(device)
    return x, a


def assert_within_rounding(u, x, a):
    ref = x.double() @ a.double().t()
    size = x.double().abs() @ a.double().abs().t()
    k = x.shape[1]
    g = k * 2.0**-24 / (1 - k * 2.0**-24)
    bound = UNIT[x.dtype] * ref.abs() + (1 + UNIT[x.dtype]) * g * size + torch.finfo(x.dtype).tiny
    assert u.dtype == x.dtype and u.shape == ref.shape
    excess = (u.double() - ref).abs() - bound
    assert (excess <= 0).all(), f"{int((excess > 0).sum())} elements beyond the rounding bound"


CASES = [(1, 48, 4096, torch.bfloat16), (1, 7, 320, torch.float32), (3, 16, 1000, torch.float16),
         (16, 33, 200, torch.float16), (8, 1, 64, torch.float32)]


@needs_interpreter
@pytest.mark.parametrize("m,r,k,dtype", CASES, ids=[f"M{m}-R{r}-K{k}-{str(d)[6:]}" for m, r, k, d in CASES])
def test_kernel_matches_float64(m, r, k, dtype):
    x, a = _operands(m, r, k, dtype)
    with use_triton(True):
        assert skinny_matmul_supported(x, a)
        u = skinny_matmul(x, a)
    assert_within_rounding(u, x, a)
    # the bound is tight enough to see one wrong product: drop a column of a
    wrong = a.clone()
    wrong[:, k // 2] = 0
    with pytest.raises(AssertionError, match="beyond the rounding bound"):
        assert_within_rounding(x @ wrong.t() if dtype == torch.float32 else (x.float() @ wrong.float().t()).to(dtype),
                               x, a)


def test_other_shapes_take_the_matmul():
    x, a = _operands(2, 8, 64, torch.float32)
    assert not skinny_matmul_supported(x, a)  # a CPU tensor, Triton not forced: the matmul
    assert torch.equal(skinny_matmul(x, a), x @ a.t())
    if interpreter_on():
        with use_triton(True):
            big_x, _ = _operands(MAX_ROWS + 1, 8, 64, torch.float32)
            assert not skinny_matmul_supported(big_x, a)
            _, long_a = _operands(2, MAX_OUT + 1, 64, torch.float32)
            assert not skinny_matmul_supported(x, long_a)
            assert not skinny_matmul_supported(x, a.half())
            assert torch.allclose(skinny_matmul(x, long_a), x @ long_a.t())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,r,k", [(1, 48, 4096), (8, 32, 14336), (16, 16, 4096), (1, 64, 2880)])
def test_gpu(m, r, k, dtype):
    x, a = _operands(m, r, k, dtype, device="cuda")
    assert skinny_matmul_supported(x, a)
    assert_within_rounding(skinny_matmul(x, a), x, a)
