"""Low-bit products through dense chunks (``notebookkit.kernels.chunked_dequant_matmul``): the forward
``x W^T`` and input gradient ``dy W`` of 2-bit and ternary (per-row and grouped) weights against the
fp64 product of the reference-dequantised weight, fp32 and fp16, odd shapes, chunks small enough that the
rows (forward) and columns (backward, on code-byte and group boundaries) are split in several; the
dispatch by rows; the autograd function. On the GPU the same in bf16 through cuBLAS."""

from __future__ import annotations

import pytest
import torch

from notebookkit.base_formats import DEQUANT_CHUNK_MIN_ROWS
from notebookkit.kernels import chunked_dequant_matmul as cdm
from notebookkit.kernels.q2 import dequantize_q2_reference, quantize_q2
from notebookkit.kernels.ternary import dequantize_ternary_reference, quantize_ternary
from notebookkit.kernels.testing import assert_close

# (format, N, K, group); K = 322 is not a multiple of 4 (ternary's last code byte is partial)
CASES = [("2bit", 77, 192, 64), ("2bit", 50, 256, 128), ("ternary", 61, 322, "row"), ("ternary", 45, 320, 64)]
# dense bytes per chunk: all at once, a few rows / columns per chunk
CHUNKS = [2**30, 3000]


def _weight(fmt, n, k, group, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    if fmt == "2bit":
        q = quantize_q2(w, group)
        return q, lambda dt: dequantize_q2_reference(q, dt)
    q = quantize_ternary(w, group_size=group)
    return q, lambda dt: dequantize_ternary_reference(q, dt)


def _exact(a, w):
    return (a.double() @ w.double()).to(a.dtype)


@pytest.mark.parametrize("chunk", CHUNKS, ids=["whole", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("fmt,n,k,group", CASES, ids=[f"{f}-{n}x{k}-g{g}" for f, n, k, g in CASES])
def test_chunks_match_the_dequantised_product(fmt, n, k, group, dtype, chunk):
    q, deq = _weight(fmt, n, k, group)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 19, k, generator=g).to(dtype)
    dy = torch.randn(2, 19, n, generator=g).to(dtype)
    w = deq(dtype)
    y = cdm.chunked_dequant_matmul(x, q, chunk_bytes=chunk, align=4)
    dx = cdm.chunked_dequant_matmul_backward_input(dy, q, chunk_bytes=chunk, align=4)
    assert y.shape == (2, 19, n) and dx.shape == (2, 19, k) and y.dtype == dx.dtype == dtype
    assert_close(y, _exact(x, w.t()), dtype)
    assert_close(dx, _exact(dy, w), dtype)


def test_a_chunk_is_bounded_and_starts_on_a_group():
    q, _ = _weight("ternary", 45, 320, 64)
    assert cdm._column_step(q, 4) == 64 and cdm._column_step(q, cdm.ALIGN) == cdm.ALIGN == 128
    assert cdm._chunk(320, 45, 128, 2, 3000) == 128  # at least one step, even past the bound
    assert cdm._chunk(320, 45, 128, 2, 45 * 2 * 300) == 256  # the most whole steps that fit
    rows = cdm._chunk(1000, 320, 4, 2, 3000)
    assert rows % 4 == 0 and rows * 320 * 2 <= 3000 < (rows + 4) * 320 * 2


def test_many_rows_on_cpu_stay_in_the_tile_kernels_and_the_gradient_reaches_x():
    q, deq = _weight("2bit", 40, 128, 64)
    x = torch.randn(DEQUANT_CHUNK_MIN_ROWS + 3, 128, requires_grad=True)
    assert not cdm._dense_chunks(x)  # CUDA only
    y = cdm.low_bit_product(x, q)
    y.square().sum().backward()
    w = deq(torch.float32).double()
    assert_close(y, (x.detach().double() @ w.t()).float(), torch.float32)
    assert_close(x.grad, (2 * (x.detach().double() @ w.t()) @ w).float(), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt,n,k,group", CASES[:1] + CASES[2:3], ids=["2bit", "ternary"])
def test_gpu_dispatch_by_rows_bf16(fmt, n, k, group):
    q, deq = _weight(fmt, n * 13, k * 8 if fmt == "2bit" else k, group)
    q = q.to("cuda") if fmt == "2bit" else type(q)(q.packed.cuda(), q.scales.cuda(), q.in_features, q.group_size)
    w = deq(torch.bfloat16).cuda()
    for rows in (DEQUANT_CHUNK_MIN_ROWS - 1, DEQUANT_CHUNK_MIN_ROWS + 7):
        x = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(rows, w.shape[0], device="cuda", dtype=torch.bfloat16)
        assert cdm._dense_chunks(x) == (rows >= DEQUANT_CHUNK_MIN_ROWS)
        assert_close(cdm.low_bit_matmul(x, q), _exact(x, w.t()), torch.bfloat16)
        assert_close(cdm.low_bit_matmul_backward_input(dy, q), _exact(dy, w), torch.bfloat16)
        assert_close(cdm.chunked_dequant_matmul_backward_input(dy, q, chunk_bytes=5000), _exact(dy, w), torch.bfloat16)
        assert_close(cdm.chunked_dequant_matmul(x, q, chunk_bytes=5000), _exact(x, w.t()), torch.bfloat16)
