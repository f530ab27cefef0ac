"""The decode step's fused kernels (``kernels.add_rms_norm``, ``kernels.rope_cache_write``) run inside the step and
change nothing: under the interpreter (``use_triton(True)``) one decode step of a LoRA model runs with them and
with them switched off (``NOTEBOOKKIT_DISABLE_KERNELS``, the unfused step: ``h + a``, the ``rms_norm`` kernel, the
``rope`` kernel and two ``index_copy_``), and gives the same logits and the same cache, bit for bit (fp32).

Each Triton kernel's launches are counted (the module's kernel object wrapped, as test_projections.py spies
its matvec): per decoder layer the fused step launches ``add_rms_norm`` twice (attention residual + pre-MLP
norm; MLP residual + the next layer's input norm, the last layer's: the final norm) and ``rope_cache_write``
once, in place of two ``rms_norm`` launches and one ``rope`` launch. Gemma 2's sandwich norms keep their adds
and norms unfused; its RoPE and cache write are fused all the same. Against Hugging Face's logits the fused
step is held by test_cached_forward.py and test_parity.py (every family; the CPU default runs each fused op's
reference there)."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels import add_rms_norm, rms_norm, rope, rope_cache_write
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.models.generation import StaticKVCache, cached_forward
from notebookkit.models.generation.state import decoder_plan

from .common import PAD_LENGTHS, PROMPT, fast_copy, left_padded_prompts, lora_model

UNFUSED = "add_rms_norm,rope_cache_write"
SPIED = {"add_rms_norm": (add_rms_norm, "_add_rms_norm_kernel"),
         "rope_cache_write": (rope_cache_write, "_rope_cache_write_kernel"),
         "rope": (rope, "_rope_kernel"), "rms_norm": (rms_norm, "_rms_norm_fwd_kernel")}


class _Counted:
    """A Triton kernel whose launches (``kernel[grid](...)``) are counted into ``launches[name]``."""

    def __init__(self, kernel, name: str, launches: dict):
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid):
        self.launches[self.name] = self.launches.get(self.name, 0) + 1
        return self.kernel[grid]


def _decode_step(model, cache: StaticKVCache, token: torch.Tensor, pad: torch.Tensor):
    """One decode step at slot ``PROMPT`` on a copy of ``cache``: ``(logits, keys, values)``."""
    step_cache = StaticKVCache(cache.n_layers, cache.batch, cache.kv_heads, cache.head_dim, cache.capacity,
                               cache.dtype, cache.device)
    for mine, theirs in ((step_cache.keys, cache.keys), (step_cache.values, cache.values)):
        for dst, src in zip(mine, theirs):
            dst.copy_(src)
    with torch.no_grad(), use_triton(True):
        logits = cached_forward(model, token, step_cache, torch.tensor([PROMPT]), pad, kv_length=32)
    return logits, step_cache.keys, step_cache.values


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("family", ["llama", "gemma", "qwen3", "gemma2"])
def test_fused_kernels_run_in_the_decode_step_and_give_the_unfused_step(family, monkeypatch, one_thread):
    model = fast_copy(lora_model(family))
    plan = decoder_plan(model)
    n_layers, sandwich = len(plan.layers), plan.family.sandwich_norm
    prompt, _ = left_padded_prompts()
    pad = torch.tensor(PAD_LENGTHS)
    cache = StaticKVCache(n_layers, 3, plan.kv_heads, plan.head_dim, 32, torch.float32, "cpu")
    with torch.no_grad():
        cached_forward(model, prompt, cache, 0, pad)  # the prompt, on the CPU default
    token = torch.randint(0, 256, (3, 1), generator=torch.Generator().manual_seed(1))

    launches: dict[str, int] = {}
    for name, (module, attr) in SPIED.items():
        monkeypatch.setattr(module, attr, _Counted(getattr(module, attr), name, launches))
    fused = _decode_step(model, cache, token, pad)
    fused_launches = dict(launches)
    launches.clear()
    monkeypatch.setenv("NOTEBOOKKIT_DISABLE_KERNELS", UNFUSED)
    unfused = _decode_step(model, cache, token, pad)

    assert fused_launches.get("rope_cache_write") == n_layers and "rope" not in fused_launches
    assert launches.get("rope") == n_layers and "rope_cache_write" not in launches and "add_rms_norm" not in launches
    if sandwich:  # Gemma 2: every add and norm as before
        assert "add_rms_norm" not in fused_launches and fused_launches["rms_norm"] == launches["rms_norm"]
    else:  # two per layer; of the plain norms only layer 0's input norm is left (q/k norms of Qwen3 stay)
        assert fused_launches.get("add_rms_norm") == 2 * n_layers
        assert fused_launches.get("rms_norm", 0) == launches["rms_norm"] - 2 * n_layers
    logits, keys, values = fused
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, unfused[0])
    for layer in range(n_layers):
        assert torch.equal(keys[layer], unfused[1][layer]) and torch.equal(values[layer], unfused[2][layer]), layer
        assert not torch.equal(keys[layer][:, :, PROMPT], cache.keys[layer][:, :, PROMPT]), "the step wrote its slot"


def test_which_norms_the_plan_fuses():
    """Plain RMSNorm families fuse every layer's two norms and the final one; Gemma 2/3 (sandwich norms) none."""
    for family, fused in (("mistral", True), ("gemma3", False)):
        plan = decoder_plan(fast_copy(lora_model(family)))
        norms = [n for lp in plan.layers for n in (lp.input_norm, lp.mlp_norm)] + [plan.final_fused]
        assert all((n is not None) == fused for n in norms), family
        if fused:
            assert plan.layers[0].mlp_norm.module is plan.layers[0].layer.post_attention_layernorm
            assert plan.final_fused.module is plan.final_norm and plan.final_fused.eps == 1e-6


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_a_decode_step_makes_its_additive_mask_once(family, monkeypatch):
    """SDPA turns a boolean mask into its additive form in every layer (one kernel a layer); a decode step makes
    that form once per window (slot_bias) and its SDPA layers share it, with the logits of the boolean mask.
    Gemma 2's soft-capped attention reads the boolean mask (none made)."""
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    forward_module = sys.modules["notebookkit.models.generation.cached_forward"]  # the package exports the function

    class Fills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fills = self.wheres = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.fills += name == "masked_fill_"
            self.wheres += name == "where"
            return func(*args, **(kwargs or {}))

    model = fast_copy(lora_model(family))
    plan = decoder_plan(model)
    prompt, _ = left_padded_prompts()
    pad = torch.tensor(PAD_LENGTHS)
    cache = StaticKVCache(len(plan.layers), 3, plan.kv_heads, plan.head_dim, 32, torch.float32, "cpu")
    token = torch.randint(0, 256, (3, 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cached_forward(model, prompt, cache, 0, pad)
        counter = Fills()
        with counter:
            logits = cached_forward(model, token, cache, torch.tensor([PROMPT]), pad, kv_length=32)
        monkeypatch.setattr(forward_module, "slot_bias", lambda visible, dtype, rep: visible)  # boolean, as before
        boolean = cached_forward(model, token, cache, torch.tensor([PROMPT]), pad, kv_length=32)
    windows = {lp.window for lp in plan.layers if lp.softcap is None and lp.sinks is None}
    assert counter.fills == len(windows) and (counter.wheres == 0 or not windows)
    assert len(windows) == {"llama": 1, "mistral": 1, "gemma2": 0}[family]
    assert torch.allclose(logits, boolean, rtol=1e-5, atol=1e-6)
