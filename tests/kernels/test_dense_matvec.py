"""One row times up to three 16-bit weights with their biases and LoRA terms in one launch
(``notebookkit.kernels.dense_matvec``): the kernel under the interpreter (CPU) and on CUDA against float64, held to
the rounding bound of one fp32 sum rounded once, ``|y - ref| <= unit |ref| + g sum |terms|`` with
``g = n 2^-24 / (1 - n 2^-24)`` for the ``n`` products summed; bf16 under the interpreter gets two units (its final
cast truncates, the GPU's rounds to nearest)."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.dense_matvec import MAX_GROUP, dense_matvec_group, dense_matvec_supported
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_within_one_rounding

needs_interpreter = pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")


def _weights(k, outs, dtype, device="cpu", seed=0, bias=False, ranks=None, pad=3):
    """x [1, K] (a view into a longer row), weights [N_i, K] with rows K + pad apart, biases, LoRA terms (rank 0:
    none; U a column slice of a wider row, as a group's U_cat gives it)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k + 7, generator=g).to(dtype).to(device)[:, 5:5 + k]
    weights = [(torch.randn(n, k + pad, generator=g) * 0.05).to(dtype).to(device)[:, :k] for n in outs]
    biases = [(torch.randn(n, generator=g) * 0.1).to(dtype).to(device) if bias else None for n in outs]
    loras = []
    for n, r in zip(outs, ranks or [0] * len(outs)):
        if r == 0:
            loras.append(None)
            continue
        u_cat = torch.randn(1, 3 * r, generator=g).to(dtype).to(device)
        loras.append((u_cat[:, r:2 * r], (torch.randn(n, r, generator=g) * 0.05).to(dtype).to(device), 1.75))
    return x, weights, biases, loras


def assert_within_rounding(y, x, w, bias, lora):
    terms = [x.double() * w.double()]  # [N, K] products
    ref = terms[0].sum(1)
    size = terms[0].abs().sum(1)
    count = x.shape[1]
    if bias is not None:
        ref, size, count = ref + bias.double(), size + bias.double().abs(), count + 1
    if lora is not None:
        u, b, s = lora
        products = s * b.double() * u.double()
        ref, size, count = ref + products.sum(1), size + products.abs().sum(1), count + 2 * b.shape[1]
    assert y.dtype == x.dtype and y.shape == (1, w.shape[0])
    assert_within_one_rounding(y[0], ref, size, count)


CASES = [  # (K, outputs, dtype, bias, ranks): odd K (the masked steps), a group of three of different widths and
    # ranks with one weight without an adapter, a lone weight with a bias, one output row
    (80, [37], torch.float32, False, [0]),
    (300, [5, 17, 33], torch.float16, False, [4, 0, 3]),
    (1024, [48, 16, 16], torch.bfloat16, False, [8, 8, 8]),
    (257, [64, 96], torch.float16, True, [2, 5]),
    (64, [1], torch.bfloat16, True, [1]),
]


@needs_interpreter
@pytest.mark.parametrize("k,outs,dtype,bias,ranks", CASES,
                         ids=[f"K{k}-N{'+'.join(map(str, o))}-{str(d)[6:]}{'-bias' if b else ''}"
                              for k, o, d, b, _ in CASES])
def test_group_within_rounding_of_the_exact_sums(k, outs, dtype, bias, ranks):
    x, weights, biases, loras = _weights(k, outs, dtype, bias=bias, ranks=ranks)
    with use_triton(True):
        assert dense_matvec_supported(x, weights)
        ys = dense_matvec_group(x, weights, biases, loras)
    for y, w, b, lora in zip(ys, weights, biases, loras):
        assert_within_rounding(y, x, w, b, lora)


@needs_interpreter
def test_a_swapped_adapter_or_a_dropped_bias_is_caught():
    """The bound is tight enough to see the adapter's term on the wrong rows and a bias left out (the planted
    bugs the group's segment selection could make)."""
    x, weights, biases, loras = _weights(128, [24, 24], torch.float32, bias=True, ranks=[4, 4])
    with use_triton(True):
        ys = dense_matvec_group(x, weights, biases, loras)
        swapped = dense_matvec_group(x, weights, biases, loras[::-1])
        unbiased = dense_matvec_group(x, weights, [None, None], loras)
    assert_within_rounding(ys[0], x, weights[0], biases[0], loras[0])
    with pytest.raises(AssertionError):
        assert_within_rounding(swapped[0], x, weights[0], biases[0], loras[0])
    with pytest.raises(AssertionError):
        assert_within_rounding(unbiased[1], x, weights[1], biases[1], loras[1])


def test_what_the_kernel_does_not_take():
    x, weights, biases, loras = _weights(64, [8, 8], torch.float16)
    with use_triton(False):
        assert not dense_matvec_supported(x, weights)  # CPU tensors without Triton forced
    if interpreter_on():
        with use_triton(True):
            assert dense_matvec_supported(x, weights)
            assert not dense_matvec_supported(torch.cat([x, x]), weights)  # two rows
            assert not dense_matvec_supported(x, [w.float() for w in weights])  # another dtype
            assert not dense_matvec_supported(x, [weights[0].t().contiguous().t()])  # strided columns
            assert not dense_matvec_supported(x, weights * 2)  # more than MAX_GROUP
            assert len(weights * 2) > MAX_GROUP
            with pytest.raises(ValueError, match="bias"):
                dense_matvec_group(x, weights, [None, torch.zeros(8, dtype=torch.float16)], loras)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_the_1b_decode_groups_on_the_gpu(dtype):
    """Llama-3.2-1B's groups at batch 1 (q/k/v 2048 + 512 + 512, gate/up 2 x 8192, down at K = 8192) with rank-16
    adapters, and the LM head's shape (128,256 rows, no adapter)."""
    for k, outs, ranks in ((2048, [2048, 512, 512], [16, 16, 16]), (2048, [8192, 8192], [16, 16]),
                           (8192, [2048], [16]), (2048, [128256], [0])):
        x, weights, biases, loras = _weights(k, outs, dtype, device="cuda", ranks=ranks, pad=0)
        ys = dense_matvec_group(x, weights, biases, loras)
        for y, w, b, lora in zip(ys, weights, biases, loras):
            assert_within_rounding(y, x, w, b, lora)
