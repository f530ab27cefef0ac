"""The decode path's NF4 projections with their LoRA terms inside the matvec (``projections.project``).

On a GPU, ``project`` runs each NF4 projection as one launch of ``nf4_matvec`` that adds its bias and its
adapter's ``s U B^T`` (``U = X A^T``, one GEMM per group over the ``A_cat`` kept in ``AdapterCasts``); for one
row of x the projections of a group share one launch (``nf4_matvec_group``). Here the
kernel runs under the interpreter (``use_triton(True)``) and is held against the same function computed the
other way, the CPU path (NF4 decoded, then the shared-input products of the training path), on the tiny
default loaded in 4-bit with PEFT adapters: q/k/v (a group, one rank), o and down (alone), gate/up; ranks that
differ inside a group; a projection's bias (Qwen2); an adapter changed in place (GRPO's optimizer step) and
the kept concatenation following it after ``refresh``.
"""

from __future__ import annotations

import pytest
import torch

from notebookkit import FastLanguageModel
from notebookkit.kernels import nf4_matvec as nf4_matvec_module
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import rel_err
from notebookkit.models.generation import projections
from notebookkit.models.generation.projections import AdapterCasts, project
from tests.kernel_launches import spy_launches

pytest.importorskip("bitsandbytes")
needs_interpreter = pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")


def _layer(family: str, **lora):
    model, _ = FastLanguageModel.from_pretrained(f"notebookkit/tiny-{family}", max_seq_length=64,
                                                 load_in_4bit=True, show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, show_banner=False, **lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or name.endswith("bias"):  # Qwen2's q/k/v biases are zeros in the tiny default
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model, model.base_model.model.model.layers[0]


def _groups(layer):
    attn, mlp = layer.self_attn, layer.mlp
    return {"qkv": (attn.q_proj, attn.k_proj, attn.v_proj), "o": (attn.o_proj,),
            "gate_up": (mlp.gate_proj, mlp.up_proj), "down": (mlp.down_proj,)}


def _fused_and_reference(modules, x2d, casts):
    with use_triton(True):
        fused = project(x2d, modules, casts)
    with use_triton(False):
        reference = project(x2d, modules, casts)
    return fused, reference


KERNELS = ("_nf4_matvec_row_kernel", "_nf4_matvec_rows_group_kernel", "_nf4_matvec_dot_kernel")


@needs_interpreter
@pytest.mark.parametrize("family,rows", [("llama", 1), ("qwen2", 1), ("qwen2", 3)],
                         ids=["llama-M1", "qwen2-bias-M1", "qwen2-bias-M3"])
def test_each_group_is_one_launch_with_its_lora_terms(family, rows, monkeypatch):
    """One row of x (batch-1 decode): a group (q/k/v, gate/up) is one launch of the grouped row kernel, a
    projection alone (o, down) one of the row kernel; more rows: one ``tl.dot`` launch a projection. Every
    launch adds its adapters' terms; the outputs are the CPU path's."""
    model, layer = _layer(family)
    seen = spy_launches(monkeypatch, nf4_matvec_module, *KERNELS)
    casts = AdapterCasts()
    x2d = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    assert (layer.self_attn.q_proj.base_layer.bias is not None) == (family == "qwen2")
    for name, modules in _groups(layer).items():
        width = modules[0].in_features
        x = x2d if width == x2d.shape[1] else torch.randn(rows, width, generator=torch.Generator().manual_seed(4))
        seen.clear()
        fused, reference = _fused_and_reference(modules, x, casts)
        if rows > 1:
            expected = ["_nf4_matvec_dot_kernel"] * len(modules)
        else:
            expected = ["_nf4_matvec_rows_group_kernel" if len(modules) > 1 else "_nf4_matvec_row_kernel"]
        assert [kernel for kernel, _, _ in seen] == expected, name
        assert all(kwargs["HAS_LORA"] for _, _, kwargs in seen), name
        for got, want, module in zip(fused, reference, modules):
            assert got.shape == want.shape
            assert rel_err(got, want) <= 1e-5, f"{family} {name}: {rel_err(got, want):.2e}"


@needs_interpreter
def test_ranks_that_differ_in_a_group_and_an_updated_adapter(monkeypatch):
    model, layer = _layer("llama", rank_pattern={"k_proj": 2})
    qkv = _groups(layer)["qkv"]
    assert [m.lora_A["default"].weight.shape[0] for m in qkv] == [4, 2, 4]
    casts = AdapterCasts()
    x2d = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    fused, reference = _fused_and_reference(qkv, x2d, casts)
    assert max(rel_err(a, b) for a, b in zip(fused, reference)) <= 1e-5

    # one group of one rank: A_cat is kept in the casts and follows an in-place update after refresh()
    gate_up = _groups(layer)["gate_up"]
    x = torch.randn(2, gate_up[0].in_features, generator=torch.Generator().manual_seed(6))
    before, _ = _fused_and_reference(gate_up, x, casts)
    with torch.no_grad():
        gate_up[1].lora_A["default"].weight.add_(0.5)  # an optimizer step's in-place update
    assert casts.refresh() >= 1
    after, reference = _fused_and_reference(gate_up, x, casts)
    assert rel_err(after[1], before[1]) > 1e-3  # the update reached the kernel
    assert max(rel_err(a, b) for a, b in zip(after, reference)) <= 1e-5
