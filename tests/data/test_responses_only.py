"""Response-only labels: kept exactly on assistant turns, clear errors, works inside TRL's SFTTrainer."""

from __future__ import annotations

import numpy as np
import pytest

from notebookkit.data.chat_templates import CHAT_TEMPLATES, get_chat_template, list_chat_templates
from notebookkit.data.responses_only import (
    MarkerNotFoundError,
    ResponseOnlyCollator,
    marker_token_candidates,
    response_only_labels,
    train_on_responses_only,
)
from tests.data.chat_tokenizer import CONVO, make_tokenizer


def _kept_text(tok, ids, labels):
    runs, cur = [], []
    for i, lab in zip(ids, labels):
        if lab != -100:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


@pytest.mark.parametrize("name", list_chat_templates())
def test_only_assistant_turns_and_their_end_token_are_kept(name):
    tok = get_chat_template(make_tokenizer(), name)
    spec = CHAT_TEMPLATES[name]
    ids = tok.apply_chat_template(CONVO, tokenize=True, return_dict=True)["input_ids"]
    labels = response_only_labels(
        ids, marker_token_candidates(tok, spec.response_part), marker_token_candidates(tok, spec.instruction_part)
    )
    runs = [r.strip() for r in _kept_text(tok, ids, labels)]
    eos = tok.eos_token
    assert runs == [f"Five.{eos}", f"Paris.{eos}"], runs


def test_packed_rows_restart_masking_at_each_sequence():
    tok = get_chat_template(make_tokenizer(), "chatml")
    spec = CHAT_TEMPLATES["chatml"]
    a = tok.apply_chat_template(CONVO[1:3], tokenize=True, return_dict=True)["input_ids"]
    # second sequence is cut before its assistant turn: nothing may leak from the first one
    b = tok.apply_chat_template(CONVO[3:4], tokenize=True, return_dict=True)["input_ids"] + a[-6:]
    resp = marker_token_candidates(tok, spec.response_part)
    instr = marker_token_candidates(tok, "no such marker")
    labels = response_only_labels(a + b, resp, instr, seq_lengths=[len(a), len(b)])
    assert all(lab == -100 for lab in labels[len(a):])
    assert [r.strip() for r in _kept_text(tok, a, labels[: len(a)])] == ["Five.<|im_end|>"]


def _tiny_llama(vocab_size: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    return LlamaForCausalLM(cfg)


def _trainer(tmp_path, tok, rows, **cfg):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to="none",
                     logging_steps=1, save_strategy="no", use_cpu=True, max_length=128, dataset_num_proc=None, **cfg)
    return SFTTrainer(model=_tiny_llama(len(tok)), processing_class=tok, args=args,
                      train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows[:2]))


@pytest.mark.parametrize("packing", [False, True])
def test_sft_trainer_integration(tmp_path, capsys, packing):
    from notebookkit.data.masking import check_masking

    tok = get_chat_template(make_tokenizer(), "chatml")
    rows = [{"messages": CONVO}, {"messages": CONVO[1:3]}, {"messages": CONVO[3:]}] * 2
    trainer = _trainer(tmp_path, tok, rows, packing=packing)
    train_on_responses_only(trainer)
    out = capsys.readouterr().out
    assert "train_on_responses_only:" in out and "%" in out
    stats = trainer.responses_only_stats
    assert 0.05 < stats.kept_fraction < 0.6 and stats.dropped_examples == 0
    labels = trainer.train_dataset[0]["labels"]
    assert labels.count(-100) > 0
    assert any(lab != -100 for lab in trainer.eval_dataset[0]["labels"])
    report = check_masking(trainer, n_examples=2)
    trained = " ".join(report.trained_text)
    assert "Five." in trained or "Paris." in trained
    assert "What is two plus three?" not in trained and "Be brief." not in trained
    assert "<span" in report._repr_html_()
    trainer.train()  # one step runs on the masked labels


def test_wrong_marker_names_both_strings_and_shows_an_example(tmp_path):
    tok = get_chat_template(make_tokenizer(), "chatml")
    trainer = _trainer(tmp_path, tok, [{"messages": CONVO}] * 2)
    with pytest.raises(MarkerNotFoundError) as err:
        train_on_responses_only(trainer, instruction_part="<|im_start|>user\n", response_part="### Answer:")
    msg = str(err.value)
    assert "'### Answer:'" in msg and "'<|im_start|>user\\n'" in msg
    assert "What is two plus three?" in msg  # the decoded example
    with pytest.raises(MarkerNotFoundError, match="instruction marker"):
        train_on_responses_only(trainer, instruction_part="USER:", response_part="<|im_start|>assistant\n")


def test_template_without_markers_needs_explicit_parts(tmp_path):
    tok = make_tokenizer()  # no chat template
    rows = [{"text": "### Instruction:\nName a colour.\n\n### Response:\nBlue."}] * 2
    trainer = _trainer(tmp_path, tok, rows)
    with pytest.raises(MarkerNotFoundError, match="no chat template"):
        train_on_responses_only(trainer)
    train_on_responses_only(trainer, instruction_part="### Instruction:\n", response_part="### Response:\n")
    ds = trainer.train_dataset
    runs = _kept_text(tok, ds[0]["input_ids"], ds[0]["labels"])
    assert [r.strip() for r in runs] == ["Blue.</s>"]


def test_collator_that_ignores_labels_is_wrapped(tmp_path):
    import torch

    tok = get_chat_template(make_tokenizer(), "chatml")
    trainer = _trainer(tmp_path, tok, [{"messages": CONVO}] * 2)

    def old_style_collator(examples):  # rebuilds labels from input_ids, like older TRL releases
        ids = torch.tensor([e["input_ids"] for e in examples])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    trainer.data_collator = old_style_collator
    train_on_responses_only(trainer, verbose=False)
    assert isinstance(trainer.data_collator, ResponseOnlyCollator)
    batch = trainer.data_collator([trainer.train_dataset[0]])
    assert np.array_equal(batch["labels"][0].numpy(), np.asarray(trainer.train_dataset[0]["labels"]))
