"""Greedy generation on the fast path gives Hugging Face's tokens, token for token (CPU, fp32).

Every family, LoRA adapters attached and non-zero, a batch of prompts of different lengths padded on
the left, and stop ids: a row that produces one of the EOS ids stops (then ``pad_token_id``), the
others go on. The reference is Hugging Face's own ``generate`` on the same weights (the stock model,
or ``FastLanguageModel.unpatch`` on a copy of a notebookkit model).

* random models (tests/models/helpers.py): 8-token sliding windows, so prompt + new tokens run past
  the window; soft-caps small enough to act; Llama 3.1 RoPE scaling over a 64-token window;
* the tiny default of each family through ``FastLanguageModel`` as a notebook loads it (4-bit NF4 on
  the CPU, chat-template prompts, the generation config's list of EOS ids: the turn end).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from notebookkit.models import FastLanguageModel

from ..helpers import FAMILIES
from .common import PAD, PROMPT, fast_copy, left_padded_prompts, lora_model

NEW = 24


def _first_index(row: list[int], token: int) -> int:
    return row.index(token) if token in row else len(row)


def stop_ids(free: torch.Tensor) -> tuple[int, int]:
    """Two EOS ids for the rows of a greedy run without stops (``free``: new tokens ``[3, NEW]``): row 0
    meets the first at step >= 2, row 2 the second at step >= 6, and row 1 meets neither."""
    rows = free.tolist()
    first = next(t for t in rows[0] if _first_index(rows[0], t) >= 2 and t not in rows[1] + rows[2])
    second = next(t for t in rows[2] if _first_index(rows[2], t) >= 6 and t not in rows[0] + rows[1])
    return first, second


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_hugging_face_with_left_padding_and_stops(family):
    stock = lora_model(family)
    fast = fast_copy(stock)
    ids, mask = left_padded_prompts()
    base = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    free = stock.generate(input_ids=ids, **base)
    assert torch.equal(fast.generate(input_ids=ids, **base), free)

    eos_a, eos_b = stop_ids(free[:, PROMPT:])
    want = stock.generate(input_ids=ids, eos_token_id=[eos_a, eos_b], **base)
    got = fast.generate(input_ids=ids, eos_token_id=[eos_a, eos_b], **base)
    assert torch.equal(got, want), f"\nfast {got[:, PROMPT:].tolist()}\nhf   {want[:, PROMPT:].tolist()}"
    # What the stop ids did: rows 0 and 2 stopped at them and were padded after, row 1 ran to the end.
    new = got[:, PROMPT:].tolist()
    stop_a, stop_b = new[0].index(eos_a), new[2].index(eos_b)
    assert set(new[0][stop_a + 1:]) <= {PAD} and set(new[2][stop_b + 1:]) <= {PAD}
    assert len(new[1]) == NEW and eos_a not in new[1] and eos_b not in new[1]
    assert new[1] == free[1, PROMPT:].tolist()


def test_a_batch_where_every_row_stops_returns_hugging_faces_length():
    stock = lora_model("qwen3")
    fast = fast_copy(stock)
    ids, mask = left_padded_prompts(seed=3)
    base = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    free = stock.generate(input_ids=ids, **base)[:, PROMPT:]
    eos = sorted({int(free[row, 3 + row]) for row in range(3)})  # every row meets one within 6 steps
    want = stock.generate(input_ids=ids, eos_token_id=eos, **base)
    got = fast.generate(input_ids=ids, eos_token_id=eos, **base)
    assert want.shape[1] < PROMPT + NEW  # Hugging Face stopped early: the fast path must stop there too
    assert torch.equal(got, want)


@pytest.mark.parametrize("limit", [dict(min_new_tokens=9), dict(min_length=PROMPT + 7)], ids=["min_new", "min_length"])
def test_min_new_tokens_and_min_length_hold_eos_back_as_hugging_face(limit):
    """EOS ids are -inf until the row has that many new tokens (benchmarks pass min_new_tokens =
    max_new_tokens so no row stops early); Hugging Face's MinNewTokensLength / MinLength processors."""
    stock = lora_model("llama")
    fast = fast_copy(stock)
    ids, mask = left_padded_prompts(seed=3)
    base = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    free = stock.generate(input_ids=ids, **base)[:, PROMPT:]
    eos = sorted({int(free[row, 1 + row]) for row in range(3)})  # every row meets one within 4 steps
    early = stock.generate(input_ids=ids, eos_token_id=eos, **base)
    want = stock.generate(input_ids=ids, eos_token_id=eos, **base, **limit)
    assert early.shape[1] <= PROMPT + 4 < want.shape[1]  # the limit changed Hugging Face's tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fall-back to Hugging Face's generate
        got = fast.generate(input_ids=ids, eos_token_id=eos, **base, **limit)
    assert torch.equal(got, want), f"\nfast {got[:, PROMPT:].tolist()}\nhf   {want[:, PROMPT:].tolist()}"


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_with_repetition_penalty_equals_hugging_face(family):
    """The penalty counts the prompt without its left padding and every token generated so far (pad ids
    of stopped rows included), as Hugging Face's processor does."""
    stock = lora_model(family)
    fast = fast_copy(stock)
    ids, mask = left_padded_prompts(seed=2)
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, repetition_penalty=1.8)
    want = stock.generate(input_ids=ids, **kw)
    plain = stock.generate(input_ids=ids, **{**kw, "repetition_penalty": 1.0})
    assert not torch.equal(want, plain)  # the penalty changes these tokens
    assert torch.equal(fast.generate(input_ids=ids, **kw), want)


def _chat_batch(tokenizer):
    tokenizer.padding_side = "left"
    questions = ["Where does the baker live?", "Hi", "Tell me about the river, the mill and the old bridge."]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in questions]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_default_4bit_chat_batch_equals_hugging_face(family):
    model, tokenizer = FastLanguageModel.from_pretrained(f"notebookkit/tiny-{family}", max_seq_length=128,
                                                         load_in_4bit=True, show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, show_banner=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    reference = copy.deepcopy(model)
    FastLanguageModel.unpatch(reference)  # Hugging Face's code (NF4 decoded by notebookkit on the CPU)
    reference.eval()
    FastLanguageModel.for_inference(model)
    assert model.notebookkit_banner.is_on("fast generation"), str(model.notebookkit_banner)
    batch = _chat_batch(tokenizer)
    want = reference.generate(**batch, max_new_tokens=20, do_sample=False)
    got = model.generate(**batch, max_new_tokens=20, do_sample=False)
    assert torch.equal(got, want)
