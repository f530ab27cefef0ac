"""LoRA-gradient parity of the fused path on 2-bit and ternary bases, every family.

Oracle: the same PEFT model on stock code with each low-bit base replaced by a dense fp32
``nn.Linear`` of the weight its codes decode to (:func:`.common.dense_twin`). Both sides are fp32 on
the CPU; the fused side runs the projections through :mod:`notebookkit.kernels.lora_projection` with
the base products of :mod:`notebookkit.kernels.q2_matmul` / :mod:`notebookkit.kernels.ternary_matmul`
(their references on the CPU; the Triton kernels under the interpreter in the last test), so they
differ only in the order of float sums. ``BOUND = 1e-4`` as for NF4 (tests/models/test_nf4_cpu.py).
"""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels import runtime
from notebookkit.kernels.testing import rel_err
from notebookkit.base_layers.low_bit_linear import Q2Linear, TernaryLinear

from ..helpers import FAMILIES
from .common import batch, checkpoint, dense_twin, load, with_lora

BOUND = 1e-4
LAYER = {"2bit": Q2Linear, "ternary": TernaryLinear}


def _step_errors(model):
    twin = dense_twin(model)
    model.train()
    twin.train()
    b = batch()
    out, ref = model(**b), twin(**b)
    out.loss.backward()
    ref.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in twin.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 7 * 2
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    loss_err = abs(out.loss.item() - ref.loss.item()) / abs(ref.loss.item())
    return loss_err, max(rel_err(grads[n], ref_grads[n]) for n in grads)


@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_lora_step_equals_the_dense_decode(family, base_format):
    model, _ = load(checkpoint(family), base_format)
    assert sum(isinstance(m, LAYER[base_format]) for m in model.modules()) == 2 * 7
    model = with_lora(model)
    assert model.notebookkit_banner.is_on("LoRA fast path"), str(model.notebookkit_banner)
    loss_err, worst = _step_errors(model)
    print(f"\n[{family} {base_format}] loss rel. error {loss_err:.1e}, worst LoRA grad rel. error {worst:.1e}")
    assert loss_err <= BOUND and worst <= BOUND


@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
def test_fused_lora_step_through_the_triton_kernels(base_format):
    """The same parity with the dequantise-in-the-GEMM kernels themselves (interpreter, fp32)."""
    model, _ = load(checkpoint("llama"), base_format)
    model = with_lora(model)
    with runtime.use_triton(True):
        loss_err, worst = _step_errors(model)
    print(f"\n[triton {base_format}] loss rel. error {loss_err:.1e}, worst LoRA grad rel. error {worst:.1e}")
    assert loss_err <= BOUND and worst <= BOUND
