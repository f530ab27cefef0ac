"""A batch-1 decode step computes each shared ``U_cat = x A_cat^T`` with the norm before its projections
(``kernels.add_rms_norm_low_rank``) and the projections read it instead of computing it again: under the
interpreter (``use_triton(True)``), one decode step of a Llama LoRA model (fp32, 16-bit path) launches the fused
kernel for every norm whose readers share an ``A_cat`` (each layer's pre-MLP norm, every input norm but layer 0's),
runs no thin product for q/k/v and gate/up (o and down keep theirs), and gives the logits and cache of the step
without it (``NOTEBOOKKIT_DISABLE_KERNELS=add_rms_norm_low_rank``) up to the order of fp32 additions."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels import add_rms_norm_low_rank as low_rank_module
from notebookkit.kernels import skinny_matmul as skinny_module
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import rel_err
from notebookkit.models.generation import StaticKVCache, cached_forward
from notebookkit.models.generation.state import decoder_plan
from tests.kernel_launches import spy_launches

from .common import PROMPT, fast_copy, lora_model


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
def test_a_batch_one_step_computes_the_shared_rank_products_with_its_norms(monkeypatch, one_thread):
    model = fast_copy(lora_model("llama"))
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

    fused_seen = spy_launches(monkeypatch, low_rank_module, "_add_rms_norm_low_rank_kernel")
    skinny_seen = spy_launches(monkeypatch, skinny_module, "_skinny_matmul_kernel")
    logits, cache = step()
    fused, skinny = len(fused_seen), len(skinny_seen)
    fused_seen.clear()
    skinny_seen.clear()
    monkeypatch.setenv("NOTEBOOKKIT_DISABLE_KERNELS", "add_rms_norm_low_rank")
    plain_logits, plain_cache = step()

    assert fused == 2 * n_layers - 1 and not fused_seen
    # with it: o and down's products, and layer 0's q/k/v; without it: four a layer
    assert skinny == 2 * n_layers + 1 and len(skinny_seen) == 4 * n_layers
    assert torch.isfinite(logits).all()
    assert rel_err(logits, plain_logits) <= 1e-5
    for layer in range(n_layers):
        assert rel_err(cache.keys[layer], plain_cache.keys[layer]) <= 1e-5, layer
