"""``cached_forward`` against Hugging Face's full forward on the same weights (CPU, fp32).

The prompt (prefill, an int start slot) and then single tokens (a device-tensor slot over a cache
bucket, as the captured step runs) give the logits Hugging Face computes at those positions for the
whole left-padded sequence. Bound: 1e-5 relative (the project's fp32 kernel tolerance); measured
2e-7 .. 5e-7 for every family and step on an AVX-512 CPU, the order of fp32 rounding of the logits.

Also here: the pieces a parity test alone could pass without (the embedding scale is the one the
backbone applies, proved by equality with layer 0's input; the sliding window acts; slots past the
current one, holding stale values, are hidden), the RoPE tables, and the slot mask's rule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from notebookkit.kernels.testing import rel_err
from notebookkit.models.generation import StaticKVCache, cached_forward
from notebookkit.models.generation.cache_attention import slot_mask
from notebookkit.models.generation.cached_forward import _embed
from notebookkit.models.generation.state import decoder_plan

from ..helpers import FAMILIES
from .common import PAD_LENGTHS, PROMPT, fast_copy, left_padded_prompts, lora_model

FP32_BOUND = 1e-5
STEPS = 6


def _sequence():
    ids, mask = left_padded_prompts()
    extra = torch.randint(0, 256, (ids.shape[0], STEPS), generator=torch.Generator().manual_seed(5))
    return ids, torch.cat([ids, extra], 1), torch.cat([mask, torch.ones_like(extra)], 1)


def _cache(model, capacity=64, batch=3):
    plan = decoder_plan(model)
    return StaticKVCache(len(plan.layers), batch, plan.kv_heads, plan.head_dim, capacity, torch.float32, "cpu")


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_steps_give_hugging_faces_logits(family):
    stock = lora_model(family)
    fast = fast_copy(stock)
    prompt, full, full_mask = _sequence()
    pad = torch.tensor(PAD_LENGTHS)
    cache = _cache(fast)
    with torch.no_grad():
        cache.keys[0].normal_()  # stale values in slots no query may see must not matter
        want = stock(input_ids=full, attention_mask=full_mask).logits
        got = cached_forward(fast, prompt, cache, 0, pad)
        assert got.shape == (3, want.shape[-1])
        assert rel_err(got, want[:, PROMPT - 1]) < FP32_BOUND
        for step in range(STEPS):
            slot = PROMPT + step
            token = full[:, slot:slot + 1]
            got = cached_forward(fast, token, cache, torch.tensor([slot]), pad, kv_length=32)
            assert rel_err(got, want[:, slot]) < FP32_BOUND, (family, step)


def test_the_sliding_window_acts():
    """Negative control: the same forward with the window switched off is clearly wrong (prompt 11 > window 8)."""
    stock = lora_model("mistral")
    fast = fast_copy(stock)
    prompt, _, _ = _sequence()
    mask = torch.ones_like(prompt)
    with torch.no_grad():
        want = stock(input_ids=prompt, attention_mask=mask).logits[:, -1]
        pad = torch.zeros(3, dtype=torch.long)
        assert rel_err(cached_forward(fast, prompt, _cache(fast), 0, pad), want) < FP32_BOUND
        plan = decoder_plan(fast)
        assert {lp.window for lp in plan.layers} == {8}
        for lp in plan.layers:
            lp.window = None
        plan.windows = (None,)
        assert rel_err(cached_forward(fast, prompt, _cache(fast), 0, pad), want) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_embedding_scale_is_the_backbones(family):
    """Layer 0 of Hugging Face's forward receives exactly what the cached forward starts from; for the
    Gemma family that is not the raw embedding row (the sqrt(hidden) scale is applied, once)."""
    stock = lora_model(family)
    seen = {}

    def grab(module, args, kwargs):
        seen["hidden"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

    layer0 = stock.get_base_model().model.layers[0]
    handle = layer0.register_forward_pre_hook(grab, with_kwargs=True)
    ids, _ = left_padded_prompts()
    with torch.no_grad():
        stock(input_ids=ids)
        handle.remove()
        ours = _embed(decoder_plan(stock), ids)
    assert torch.equal(ours, seen["hidden"])
    raw = F.embedding(ids, stock.get_input_embeddings().weight)
    scaled = family.startswith("gemma")
    assert torch.equal(raw, ours) != scaled


def test_rope_tables_are_the_models_rotary_embedding():
    """Gemma 3: one table per layer type (local base on sliding layers), rows equal to the module's output."""
    fast = fast_copy(lora_model("gemma3"))
    plan = decoder_plan(fast)
    assert {lp.rope_key for lp in plan.layers} == {"sliding_attention", "full_attention"}
    plan.rope.ensure(40, torch.float32, torch.device("cpu"))
    positions = torch.tensor([[0, 3, 39, 17], [5, 5, 6, 1]])
    rotary = fast.get_base_model().model.rotary_emb
    probe = torch.empty(1, dtype=torch.float32)
    tables = {}
    for kind in ("sliding_attention", "full_attention"):
        cos, sin = plan.rope.lookup(kind, positions)
        ref_cos, ref_sin = rotary(probe, positions, kind)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
        tables[kind] = cos
    assert not torch.equal(tables["sliding_attention"], tables["full_attention"])  # two bases


def test_slot_mask_rule():
    """pad <= s <= q, s > q - window, and every query sees its own slot."""
    pad = torch.tensor([0, 2])
    mask = slot_mask(torch.tensor([1, 4]), 6, pad, window=3)
    assert mask.shape == (2, 1, 2, 6)
    expect = torch.tensor([
        [[1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0]],  # row 0: q=1 sees 0..1; q=4 sees 2..4 (window 3)
        [[0, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0]],  # row 1 (pad 2): q=1 is padding, sees itself only
    ], dtype=torch.bool)
    assert torch.equal(mask[:, 0], expect)
    full = slot_mask(torch.tensor([3]), 4, pad, window=None)[:, 0, 0]
    assert full.tolist() == [[True, True, True, True], [False, False, True, True]]


def test_bad_sizes_are_named():
    fast = fast_copy(lora_model("llama"))
    prompt, _, _ = _sequence()
    with pytest.raises(ValueError, match="do not fit the cache of 2 rows"):
        cached_forward(fast, prompt, _cache(fast, batch=2), 0, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="kv_length=4"):
        cached_forward(fast, prompt, _cache(fast), 0, torch.zeros(3, dtype=torch.long), kv_length=4)
