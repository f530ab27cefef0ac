"""The LoRA projection kernels (``lora_qkv``'s shared-input path, ``lora_mlp``) on 2-bit and ternary base
weights, against float64 on the decoded weight: fp32 and fp16 (the T4's dtype) through the Triton
dequantise-in-the-GEMM kernels under the interpreter, and the CPU references.

Oracle: ``x W^T + s (x A^T) B^T`` and its gradients by float64 autograd, ``W`` the format's decoded weight
(``dequantize_q2`` / ``dequantize_ternary`` in fp32, exact: the decoded values are fp16-exact for
ternary and rounded once for 2-bit). Bounds: 1e-5 fp32, 2e-3 fp16 (one fp16 rounding of the inputs, the
decoded tile and the output; the fp32 accumulation is the kernels').
"""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.lora_mlp import lora_mlp
from notebookkit.kernels.lora_projection import LoRAProjection, shared_input_lora
from notebookkit.kernels.q2 import dequantize_q2_reference, quantize_q2
from notebookkit.kernels.runtime import use_triton
from notebookkit.kernels.testing import rel_err
from notebookkit.kernels.ternary import dequantize_ternary_reference, quantize_ternary

HIDDEN, INTER, TOKENS, RANK = 128, 192, 37, 8
BOUND = {torch.float32: 1e-5, torch.float16: 2e-3}


def _base(base_format, out_f, in_f, gen):
    w = torch.randn(out_f, in_f, generator=gen) * 0.05
    if base_format == "2bit":
        q = quantize_q2(w)
        return q, dequantize_q2_reference(q, torch.float32).double()
    t = quantize_ternary(w)
    return t, dequantize_ternary_reference(t, torch.float32).double()


def _projection(base_format, out_f, in_f, gen, dtype):
    packed, dense64 = _base(base_format, out_f, in_f, gen)
    codes = packed.codes if base_format == "2bit" else packed.packed
    A = (torch.randn(RANK, in_f, generator=gen) * 0.1).to(dtype).requires_grad_(True)
    B = (torch.randn(out_f, RANK, generator=gen) * 0.1).to(dtype).requires_grad_(True)
    return LoRAProjection(codes, packed, A, B, 2.0), dense64


def _reference(x, proj, dense64):
    A, B = proj.lora_A.detach().double().requires_grad_(True), proj.lora_B.detach().double().requires_grad_(True)
    return x @ dense64.t() + proj.scaling * (x @ A.t()) @ B.t(), A, B


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
def test_shared_input_projections_on_low_bit_bases(base_format, dtype, triton):
    gen = torch.Generator().manual_seed(0)
    pairs = [_projection(base_format, out_f, HIDDEN, gen, dtype) for out_f in (HIDDEN, 64, 64)]
    assert all(p.low_bit and p.quantized for p, _ in pairs)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype).requires_grad_(True)
    with use_triton(triton):
        ys = shared_input_lora(x, [p for p, _ in pairs])
        grads = [torch.randn(y.shape, generator=gen).to(dtype) for y in ys]
        torch.autograd.backward(ys, grads)
    x64 = x.detach().double().requires_grad_(True)
    refs = [_reference(x64, p, d) for p, d in pairs]
    torch.autograd.backward([r[0] for r in refs], [g.double() for g in grads])
    bound = BOUND[dtype]
    for y, (p, _), (y64, A64, B64) in zip(ys, pairs, refs):
        assert rel_err(y, y64) < bound
        assert rel_err(p.lora_A.grad, A64.grad) < bound and rel_err(p.lora_B.grad, B64.grad) < bound
    assert rel_err(x.grad, x64.grad) < bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
def test_lora_mlp_on_low_bit_bases_through_triton(base_format, dtype):
    gen = torch.Generator().manual_seed(1)
    gate, g64 = _projection(base_format, INTER, HIDDEN, gen, dtype)
    up, u64 = _projection(base_format, INTER, HIDDEN, gen, dtype)
    down, d64 = _projection(base_format, HIDDEN, INTER, gen, dtype)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype).requires_grad_(True)
    with use_triton(True):
        y = lora_mlp(x, gate, up, down, activation="swiglu")
        dy = torch.randn(y.shape, generator=gen).to(dtype)
        y.backward(dy)
    x64 = x.detach().double().requires_grad_(True)
    g, gA, gB = _reference(x64, gate, g64)
    u, uA, uB = _reference(x64, up, u64)
    h = torch.nn.functional.silu(g) * u
    y64, dA, dB = _reference(h, down, d64)
    y64.backward(dy.double())
    bound = BOUND[dtype]
    assert rel_err(y, y64) < bound and rel_err(x.grad, x64.grad) < bound
    for proj, A64, B64 in ((gate, gA, gB), (up, uA, uB), (down, dA, dB)):
        assert rel_err(proj.lora_A.grad, A64.grad) < bound and rel_err(proj.lora_B.grad, B64.grad) < bound
