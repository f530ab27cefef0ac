"""Mixture-of-experts decode (Qwen3-MoE, gpt-oss) on notebookkit's cached path, against Hugging Face + PEFT.

fp32 on the CPU, a batch of 2 prompts of different lengths padded on the left (the decode path's layout; it
refuses right padding), LoRA on the attention projections and on the experts' stacked weights (PEFT's
``target_parameters``; random ``A`` and ``B``, so every adapter matters):

* random models of each family (tests/models/helpers.py: 8 / 4 experts, top-2, gpt-oss with an 8-token
  sliding window on every other layer, attention sinks, and ``swiglu_limit=0.1`` so the clamps of its
  activation bind): the greedy tokens of ``generate`` on the fast path equal Hugging Face's ``generate`` on the
  stock PEFT model, for 20 new tokens, and the logits of the prefill and of every decode step (slot given as a
  device tensor over a cache bucket, as the captured step runs) are within 1e-4 (relative) of Hugging Face's
  full forward over the generated sequence; on the default path (the expert kernel's PyTorch reference) and on
  the Triton kernels under the interpreter (the grouped expert kernel as the GPU runs it);
* the tiny default of each family loaded with ``load_in_4bit`` (NF4 stacked experts, 4-bit attention
  projections) through ``FastLanguageModel.for_inference``: the same, against the stock-code twin whose NF4
  weights are decoded by the format's definition (tests/models/test_moe_nf4.py's oracle).

The prompt (11 columns) plus 20 new tokens runs past the 8-token window, so gpt-oss's sliding layers act.
Measured: at most about 1e-6 relative on the logits. A planted bug (the sinks left out of the softmax, or
Qwen3-MoE's top-k weights not renormalised) fails the logits test and changes tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import rel_err
from notebookkit.models import FastLanguageModel
from notebookkit.models.generation import StaticKVCache, cached_forward
from notebookkit.models.generation.decoder_plan import DecoderPlan
from notebookkit.models.generation.generate import is_bound
from notebookkit.models.generation.state import decoder_plan

from ..helpers import MOE_FAMILIES, random_model
from .common import fast_copy

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
NEW = 20
PROMPT = 11
PADS = (0, 4)
PAD = 299
BOUND = 1e-4

PATHS = ["reference",
         pytest.param("triton", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1"))]


def _stock(family: str):
    """A random ``family`` model with PEFT LoRA (random factors) on attention and the stacked experts."""
    import peft

    overrides = {"swiglu_limit": 0.1} if family == "gpt_oss" else {}
    model = random_model(family, **overrides)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION,
                                                       target_parameters=EXPERTS, init_lora_weights=False))
    model.generation_config.eos_token_id = None
    return model.eval()


def _prompts(vocab: int = 256, pad: int = PAD):
    ids = torch.randint(3, vocab, (len(PADS), PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for row, n in enumerate(PADS):
        mask[row, :n] = 0
    return ids.masked_fill(mask == 0, pad), mask


def _assert_decode_equals(fast, reference, vocab: int = 256, pad: int = PAD) -> None:
    """Greedy tokens of ``fast.generate`` == ``reference.generate``; prefill and step logits of the cached
    forward within ``BOUND`` of ``reference``'s full forward over the generated sequence."""
    ids, mask = _prompts(vocab, pad)
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=pad)
    with torch.no_grad():
        want = reference.generate(input_ids=ids, **kw)
        got = fast.generate(input_ids=ids, **kw)
    assert torch.equal(got, want), f"\nfast {got[:, PROMPT:].tolist()}\nhf   {want[:, PROMPT:].tolist()}"
    assert len(set(want[:, PROMPT:].flatten().tolist())) > 3  # not one token repeated

    plan = decoder_plan(fast)
    cache = StaticKVCache(len(plan.layers), len(PADS), plan.kv_heads, plan.head_dim, 64, torch.float32, "cpu")
    full_mask = torch.cat([mask, torch.ones(len(PADS), NEW, dtype=mask.dtype)], 1)
    pad_lengths = torch.tensor(PADS)
    with torch.no_grad():
        cache.keys[0].normal_()  # stale values in slots no query may see must not matter
        ref = reference(input_ids=want, attention_mask=full_mask).logits
        errors = [rel_err(cached_forward(fast, want[:, :PROMPT], cache, 0, pad_lengths), ref[:, PROMPT - 1])]
        for step in range(NEW - 1):
            slot = PROMPT + step
            logits = cached_forward(fast, want[:, slot:slot + 1], cache, torch.tensor([slot]), pad_lengths,
                                    kv_length=32)
            errors.append(rel_err(logits, ref[:, slot]))
    assert max(errors) <= BOUND, [f"{e:.1e}" for e in errors]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_tokens_and_step_logits_equal_hugging_face(family, path, one_thread):
    stock = _stock(family)
    fast = fast_copy(stock)
    assert is_bound(fast)
    plan = decoder_plan(fast)
    assert isinstance(plan, DecoderPlan) and all(lp.moe is not None for lp in plan.layers)
    if family == "gpt_oss":  # sinks on every layer, the 8-token window on every other one
        assert all(lp.sinks is not None for lp in plan.layers)
        assert [lp.window for lp in plan.layers] == [8, None]
    with use_triton(path == "triton"):
        _assert_decode_equals(fast, stock)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_nf4_experts_decode_equals_hugging_face_on_the_decoded_weights(family, one_thread):
    pytest.importorskip("bitsandbytes")
    from ..test_moe_nf4 import _adapted_pair

    model, twin = _adapted_pair(family)  # 4-bit model + notebookkit's adapters; stock-code twin, same factors
    FastLanguageModel.for_inference(model)
    assert model.notebookkit_banner.is_on("fast generation"), str(model.notebookkit_banner)
    twin.eval()
    twin.generation_config.eos_token_id = None
    model.generation_config.eos_token_id = None
    vocab = model.config.vocab_size
    _assert_decode_equals(model, twin, vocab=min(vocab, 256), pad=vocab - 1)
