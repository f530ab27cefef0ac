"""Bad input to the SFT trainer on the tiny default: a data set or batch setting TRL cannot train on
fails when the trainer is built, with a message naming what was found and what to write, before
TRL touches the model; the older TRL keywords of ported notebooks are accepted."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from notebookkit.models import FastLanguageModel  # noqa: E402
from notebookkit.train import SFTInputError, make_sft_trainer  # noqa: E402
from notebookkit.train.sft import FastSFTTrainer  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is faster on a shared machine (tests/conftest.py)
    model, tok = FastLanguageModel.from_pretrained(
        "notebookkit/tiny-llama", max_seq_length=64, load_in_4bit=False, show_banner=False
    )
    yield FastLanguageModel.get_peft_model(model, r=4, show_banner=False), tok
    torch.set_num_threads(threads)


def _config(tmp_path, **kw):
    from trl import SFTConfig

    base = dict(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, max_length=32, use_cpu=True,
                report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    base.update(kw)
    return SFTConfig(**base)


def _build(tiny, tmp_path, dataset, eval_dataset=None, **config):
    model, tok = tiny
    return FastSFTTrainer(model=model, args=_config(tmp_path, **config), train_dataset=dataset,
                          eval_dataset=eval_dataset, processing_class=tok, show_banner=False)


def _state(model):
    """What building a TRL trainer changes on the model (hooks, tags, the LM head's forward)."""
    base = model.get_base_model()
    return set(vars(model)), set(vars(base)), base.forward


def _refused(tiny, tmp_path, error, dataset, eval_dataset=None, **config) -> str:
    model, _ = tiny
    before = _state(model)
    with pytest.raises(error) as info:
        _build(tiny, tmp_path, dataset, eval_dataset, **config)
    assert _state(model) == before, "the check must run before TRL touches the model"
    return str(info.value)


TEXT = [{"text": "alpha beta gamma delta"}, {"text": "gamma delta epsilon zeta"}]


def test_empty_dataset_says_it_has_no_rows(tiny, tmp_path):
    msg = _refused(tiny, tmp_path, SFTInputError, Dataset.from_dict({"text": []}))
    assert msg.startswith("train_dataset has no rows, so there is nothing to train on.")
    empty_stream = Dataset.from_list(TEXT).to_iterable_dataset().filter(lambda row: False)
    assert "train_dataset has no rows" in _refused(tiny, tmp_path, SFTInputError, empty_stream)
    msg = _refused(tiny, tmp_path, SFTInputError, Dataset.from_list(TEXT), Dataset.from_dict({"text": []}))
    assert msg.startswith("eval_dataset has no rows, so there is nothing to evaluate on.")


def test_make_sft_trainer_checks_too(tiny, tmp_path):
    model, tok = tiny
    with pytest.raises(SFTInputError, match="train_dataset has no rows"):
        make_sft_trainer(model, tok, Dataset.from_dict({"text": []}), output_dir=str(tmp_path), show_banner=False)


def test_columns_no_trainer_reads_are_named_with_the_formats_and_a_mapping(tiny, tmp_path):
    rows = [{"question": "What is two and two?", "answer": "Four."}, {"question": "Sky colour?", "answer": "Blue."}]
    msg = _refused(tiny, tmp_path, SFTInputError, Dataset.from_list(rows))
    assert msg.startswith(
        "train_dataset has the columns ['question', 'answer'], none of which SFTTrainer reads. "
        "It trains on one of these layouts:"
    )
    for layout in ("'text'", "'messages'", "'conversations'", "'prompt' and 'completion'",
                   "Alpaca's 'instruction', 'input', 'output': pass formatting_func="):
        assert layout in msg
    hint = "dataset = dataset.rename_columns({'question': 'prompt', 'answer': 'completion'})"
    assert hint in msg
    dataset = Dataset.from_list(rows).rename_columns({"question": "prompt", "answer": "completion"})  # the hint
    trainer = _build(tiny, tmp_path, dataset)
    trainer.train()
    assert torch.isfinite(torch.tensor(trainer.state.log_history[-1]["train_loss"]))


def test_alpaca_columns_point_to_alpaca_to_messages(tiny, tmp_path):
    rows = [{"instruction": "Add 2 and 2.", "input": "", "output": "4"}] * 2
    msg = _refused(tiny, tmp_path, SFTInputError, Dataset.from_list(rows))
    assert "dataset = dataset.map(alpaca_to_messages, remove_columns=dataset.column_names)" in msg
    from notebookkit.data import alpaca_to_messages

    dataset = Dataset.from_list(rows)
    trainer = _build(tiny, tmp_path, dataset.map(alpaca_to_messages, remove_columns=dataset.column_names))
    assert "input_ids" in trainer.train_dataset.column_names


def test_a_missing_text_field_is_named(tiny, tmp_path):
    msg = _refused(tiny, tmp_path, SFTInputError, Dataset.from_list([{"body": "hello"}] * 2), dataset_text_field="content")
    assert "has the columns ['body']" in msg and "'content' (the column dataset_text_field names)" in msg
    assert "dataset.rename_column('body', 'text')  # or SFTConfig(dataset_text_field='body')" in msg


@pytest.mark.parametrize(
    "data,error,text",
    [
        (TEXT, TypeError, "train_dataset is a Python list of 2 rows; SFTTrainer reads a datasets.Dataset. Wrap it "
         "first: train_dataset = datasets.Dataset.from_list(rows)."),
        (["alpha beta", "gamma"], TypeError, "Wrap it first: train_dataset = datasets.Dataset.from_dict({'text': rows})."),
        ({"text": ["alpha"]}, TypeError, "train_dataset is a dict of columns ['text']"),
        ([{"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 2,
         SFTInputError, "train_dataset has 'conversations' of {'role', 'content'} turns; SFTTrainer reads such turns "
         "only from a column named 'messages'. Rename it: dataset = dataset.rename_column('conversations', 'messages')"),
        ([{"messages": [{"from": "human", "value": "hi"}]}] * 2, SFTInputError,
         "train_dataset's 'messages' turns have the keys ['from', 'value']; SFTTrainer reads turns with 'role' and "
         "'content'. Rewrite them first: dataset = standardize_sharegpt(dataset, column='messages')"),
        ([{"prompt": "hello"}] * 2, SFTInputError, "train_dataset has a 'prompt' column but no 'completion'"),
    ],
)
def test_data_of_the_wrong_shape(tiny, tmp_path, data, error, text):
    dataset = Dataset.from_list(data) if error is SFTInputError else data  # TypeError: the Python object itself
    assert text in _refused(tiny, tmp_path, error, dataset)


def test_text_beside_chat_turns_is_read_as_trl_reads_it(tiny, tmp_path):
    """The conversational notebooks keep role/content 'conversations' and add 'text': TRL reads 'text'."""
    model, tok = tiny
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rows = [{"conversations": turns, "text": tok.apply_chat_template(turns, tokenize=False)}] * 2
    trainer = _build(tiny, tmp_path, Dataset.from_list(rows), max_length=64)
    assert rows[0]["text"] in tok.decode(trainer.train_dataset[0]["input_ids"])


def test_a_split_dictionary_asks_for_one_split(tiny, tmp_path):
    splits = Dataset.from_list(TEXT * 2).train_test_split(test_size=0.5, seed=0)
    msg = _refused(tiny, tmp_path, TypeError, splits)
    assert msg.startswith("train_dataset is a DatasetDict with the splits ['train', 'test'], not one split. Pass one "
                          "of them, e.g. train_dataset=dataset['train']")


def test_chat_rows_need_a_chat_template(tiny, tmp_path):
    model, tok = tiny
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 2
    template, tok.chat_template = tok.chat_template, None
    try:
        msg = _refused(tiny, tmp_path, SFTInputError, Dataset.from_list(rows))
    finally:
        tok.chat_template = template
    assert msg.startswith("train_dataset is conversational ('messages' holds chat turns), but the tokenizer has no "
                          "chat template to render them into text.")
    assert "tokenizer = get_chat_template(tokenizer, 'chatml')" in msg
    assert "input_ids" in _build(tiny, tmp_path, Dataset.from_list(rows)).train_dataset.column_names


@pytest.mark.parametrize("field", ["per_device_train_batch_size", "gradient_accumulation_steps"])
def test_batch_settings_below_one(tiny, tmp_path, field):
    msg = _refused(tiny, tmp_path, SFTInputError, Dataset.from_list(TEXT), **{field: 0})
    assert msg.startswith(f"{field}=0 must be a whole number of at least 1: it is the number of ")


def test_older_trl_keywords_of_ported_notebooks(tiny, tmp_path):
    """tokenizer=, dataset_text_field=, max_seq_length=, packing= as the most used notebooks pass them."""
    from transformers import TrainingArguments

    model, tok = tiny
    config = _config(tmp_path)
    trainer = FastSFTTrainer(
        model=model, tokenizer=tok, train_dataset=Dataset.from_list([{"body": "alpha beta"}] * 2),
        dataset_text_field="body", max_seq_length=16, packing=False, args=config, show_banner=False,
    )
    assert trainer.processing_class is tok
    assert (trainer.args.max_length, trainer.args.dataset_text_field, trainer.args.packing) == (16, "body", False)
    assert (config.max_length, config.dataset_text_field) == (32, "text"), "the caller's config is not changed"
    plain = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=3)
    trainer = FastSFTTrainer(model, plain, tokenizer=tok, train_dataset=Dataset.from_list(TEXT), max_seq_length=24,
                             show_banner=False)
    assert (trainer.args.max_length, trainer.args.per_device_train_batch_size) == (24, 3)
    with pytest.raises(TypeError, match="got both tokenizer= and processing_class=; they are the same argument"):
        FastSFTTrainer(model=model, tokenizer=tok, processing_class=tok, train_dataset=Dataset.from_list(TEXT),
                       args=config, show_banner=False)
