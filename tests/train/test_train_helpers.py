"""SFT preset and held-out evaluation helpers (CPU, small)."""

from __future__ import annotations

import math

import pytest

from notebookkit.data.chat_templates import get_chat_template
from tests.data.chat_tokenizer import make_tokenizer


@pytest.fixture(scope="module")
def tiny():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = get_chat_template(make_tokenizer(), "chatml")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg)
    get_chat_template(tok, "chatml", model=model)
    return model, tok


def test_sft_config_preset(tmp_path):
    from notebookkit.train.sft import sft_config

    cfg = sft_config(str(tmp_path), max_steps=3, learning_rate=1e-3, eval_steps=2, packing=True)
    assert cfg.max_steps == 3 and cfg.learning_rate == 1e-3 and cfg.packing
    assert cfg.report_to == [] or cfg.report_to == "none" or cfg.report_to == ["none"]
    assert getattr(cfg.save_strategy, "value", cfg.save_strategy) == "no"
    assert getattr(cfg.eval_strategy, "value", cfg.eval_strategy) == "steps" and cfg.eval_steps == 2
    with pytest.warns(UserWarning, match="no_such_field"):
        sft_config(str(tmp_path), no_such_field=1)


def test_answer_loss_matches_a_manual_computation(tiny):
    import torch
    import torch.nn.functional as F

    from notebookkit.train.evaluation import QAItem, answer_loss

    model, tok = tiny
    item = QAItem([{"role": "user", "content": "hello world"}], "good morning")
    got = answer_loss(model, tok, [item])
    prompt = tok.apply_chat_template(item.messages, add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"]
    full = tok.apply_chat_template(item.messages + [{"role": "assistant", "content": item.reference}],
                                   tokenize=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([full])).logits[0]
    want = F.cross_entropy(logits[len(prompt) - 1 : -1], torch.tensor(full[len(prompt):])).item()
    assert math.isclose(got, want, rel_tol=1e-5)


def test_exact_match_and_generate_reply(tiny):
    from notebookkit.train.evaluation import QAItem, exact_match, generate_reply, normalize_answer, qa_items

    model, tok = tiny
    items = qa_items([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Yes."}]}])
    assert items[0].question == "hi" and items[0].reference == "Yes."
    reply = generate_reply(model, tok, "hello", max_new_tokens=5)
    assert isinstance(reply, str)
    res = exact_match(model, tok, items, max_new_tokens=4)
    assert len(res.rows) == 1 and res.score in (0.0, 1.0)
    assert "<table>" in res._repr_html_()
    assert normalize_answer("  Snow is WHITE. ") == "snow is white"
    assert isinstance(QAItem([], "x").question, str)


def test_exact_match_counts_whole_answers_only(monkeypatch):
    """A reply matches when it equals the reference up to case, surrounding whitespace, runs of spaces and
    trailing punctuation; a reply that contains the reference, or is a part of it, does not."""
    from notebookkit.train import evaluation

    cases = {  # question: (the model's reply, the reference, a match?)
        "q1": ("Paris", "Paris", True),
        "q2": ("  PARIS!  ", "paris", True),
        "q3": ("new   York.", "New York", True),
        "q4": ("Paris is the capital", "Paris", False),
        "q5": ("The capital is Paris.", "Paris", False),
        "q6": ("Par", "Paris", False),
        "q7": ("", "Paris", False),
        "q8": ("Lyon", "Paris", False),
    }
    monkeypatch.setattr(evaluation, "generate_reply", lambda model, tok, messages, **kw: cases[messages[-1]["content"]][0])
    items = [evaluation.QAItem([{"role": "user", "content": q}], ref) for q, (_, ref, _) in cases.items()]
    result = evaluation.exact_match(None, None, items)
    assert [r["match"] for r in result.rows] == [m for _, _, m in cases.values()], str(result)
    assert result.score == 3 / 8


def test_split_heldout_is_deterministic():
    from datasets import Dataset

    from notebookkit.train.evaluation import split_heldout

    ds = Dataset.from_list([{"i": i} for i in range(50)])
    a_train, a_eval = split_heldout(ds, n_eval=5, seed=1)
    b_train, b_eval = split_heldout(ds, n_eval=5, seed=1)
    assert a_eval["i"] == b_eval["i"] and len(a_eval) == 5 and len(a_train) == 45
    assert not set(a_eval["i"]) & set(a_train["i"])
