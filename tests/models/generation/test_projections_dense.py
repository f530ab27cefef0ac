"""The decode path's 16-bit projections at batch 1: a group (q/k/v, gate/up) and a lone projection (o, down) are
each one launch of ``dense_matvec_group`` with their biases and LoRA terms inside (``projections.project``). The
kernel runs under the interpreter (``use_triton(True)``) and is held against the training path's products
(``use_triton(False)``) on the tiny default in 16 bits with PEFT adapters: Llama, and Qwen2 with its q/k/v biases;
two rows of x (a prefill or a batch) stay on the training path."""

from __future__ import annotations

import pytest
import torch

from notebookkit import FastLanguageModel
from notebookkit.kernels import dense_matvec as dense_matvec_module
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import rel_err
from notebookkit.models.generation.projections import AdapterCasts, project
from tests.kernel_launches import spy_launches

needs_interpreter = pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")


def _layer(family: str):
    model, _ = FastLanguageModel.from_pretrained(f"notebookkit/tiny-{family}", max_seq_length=64, dtype=torch.float32,
                                                 load_in_4bit=False, show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, show_banner=False,
                                             rank_pattern={"k_proj": 2})  # ranks that differ inside q/k/v
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or name.endswith("bias"):  # Qwen2's q/k/v biases are zeros in the tiny default
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    layer = model.base_model.model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    groups = {"qkv": (attn.q_proj, attn.k_proj, attn.v_proj), "o": (attn.o_proj,),
              "gate_up": (mlp.gate_proj, mlp.up_proj), "down": (mlp.down_proj,)}
    return model, groups


@needs_interpreter
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_each_group_is_one_launch_with_its_biases_and_lora_terms(family, monkeypatch):
    model, groups = _layer(family)
    seen = spy_launches(monkeypatch, dense_matvec_module, "_dense_matvec_group_kernel")
    casts = AdapterCasts()
    for name, modules in groups.items():
        x = torch.randn(1, modules[0].in_features, generator=torch.Generator().manual_seed(len(name)))
        seen.clear()
        with use_triton(True):
            fused = project(x, modules, casts)
        with use_triton(False):
            reference = project(x, modules, casts)
        assert len(seen) == 1 and seen[0][2]["SEGMENTS"] == len(modules), name
        assert seen[0][2]["HAS_LORA"] and seen[0][2]["HAS_BIAS"] == (family == "qwen2" and name == "qkv"), name
        for got, want in zip(fused, reference):
            assert got.shape == want.shape
            assert rel_err(got, want) <= 1e-5, f"{family} {name}: {rel_err(got, want):.2e}"


@needs_interpreter
def test_two_rows_and_a_switched_off_kernel_keep_the_training_path(monkeypatch):
    model, groups = _layer("llama")
    seen = spy_launches(monkeypatch, dense_matvec_module, "_dense_matvec_group_kernel")
    x = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with use_triton(True):
        project(x, groups["qkv"], AdapterCasts())
        monkeypatch.setenv("NOTEBOOKKIT_DISABLE_KERNELS", "dense_matvec")
        project(x[:1], groups["qkv"], AdapterCasts())
    assert seen == []
