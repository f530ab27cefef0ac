"""A batch-1 decode step computes the adapters' rank-space inputs ``U = x A^T`` with the op before their projections
and the projections read them instead of computing them again: q/k/v's and gate/up's ``U_cat`` with the norm
(``kernels.add_rms_norm_low_rank``), down's ``U`` with the gated activation (``kernels.gated_low_rank``). Under the
interpreter (``use_triton(True)``) one decode step of a Llama and of a Gemma LoRA model (fp32, 16-bit path) launches the first for
every norm whose readers have adapters (each layer's pre-MLP norm, every input norm but layer 0's) and the second
once a layer, runs a thin product only for layer 0's q/k/v and each layer's o, and gives the logits and cache of
the step without them (``NOTEBOOKKIT_DISABLE_KERNELS=add_rms_norm_low_rank,gated_low_rank``) up to the order of
fp32 additions."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels import add_rms_norm_low_rank as low_rank_module
from notebookkit.kernels import gated_low_rank as gated_module
from notebookkit.kernels import skinny_matmul as skinny_module
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import rel_err
from notebookkit.models.generation import StaticKVCache, cached_forward
from notebookkit.models.generation.state import decoder_plan
from tests.kernel_launches import spy_launches

from .common import PROMPT, fast_copy, lora_model


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("family", ["llama", "gemma"])  # SwiGLU and Llama's norm; GeGLU (tanh) and Gemma's 1 + w
def test_a_batch_one_step_computes_the_rank_products_with_the_ops_before_them(family, monkeypatch, one_thread):
    model = fast_copy(lora_model(family))
    n_layers = len(decoder_plan(model).layers)
    plan = decoder_plan(model)
    prompt = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    token = torch.randint(0, 256, (1, 1), generator=torch.Generator().manual_seed(1))

    def step():
        cache = StaticKVCache(n_layers, 1, plan.kv_heads, plan.head_dim, 32, torch.float32, "cpu")
        with torch.no_grad():
            cached_forward(model, prompt, cache, 0, torch.zeros(1, dtype=torch.long))
            with use_triton(True):
                logits = cached_forward(model, token, cache, torch.tensor([PROMPT]), torch.zeros(1, dtype=torch.long),
                                        kv_length=32)
        return logits, cache

    norm_seen = spy_launches(monkeypatch, low_rank_module, "_add_rms_norm_low_rank_kernel")
    gated_seen = spy_launches(monkeypatch, gated_module, "_gated_low_rank_kernel")
    skinny_seen = spy_launches(monkeypatch, skinny_module, "_skinny_matmul_kernel")
    logits, cache = step()
    counts = len(norm_seen), len(gated_seen), len(skinny_seen)
    for seen in (norm_seen, gated_seen, skinny_seen):
        seen.clear()
    monkeypatch.setenv("NOTEBOOKKIT_DISABLE_KERNELS", "add_rms_norm_low_rank,gated_low_rank")
    plain_logits, plain_cache = step()

    # with them: layer 0's q/k/v and each o keep a thin product; without them: four a layer
    assert counts == (2 * n_layers - 1, n_layers, n_layers + 1)
    assert not norm_seen and not gated_seen and len(skinny_seen) == 4 * n_layers
    assert torch.isfinite(logits).all()
    assert rel_err(logits, plain_logits) <= 1e-5
    for layer in range(n_layers):
        assert rel_err(cache.keys[layer], plain_cache.keys[layer]) <= 1e-5, layer
