"""What an SFT trainer is given, checked when it is built: the data set's type, rows and layout, and
the batch settings. A mistake here otherwise surfaces inside TRL on the first batch (``StopIteration``
with no message, ``KeyError: 'text'``); these checks say what was found and what to change, before
TRL touches the model.

TRL's ``SFTTrainer`` reads one of these layouts, decided by the first row:

* ``input_ids``: already tokenised, used as is;
* any row, when a ``formatting_func`` is given: it returns the text to train on;
* ``text`` (or the column named by ``dataset_text_field``): the whole text of each example;
* ``messages``: a list of ``{"role", "content"}`` turns, rendered by the tokenizer's chat template;
* ``conversations`` of ShareGPT turns ``{"from", "value"}``: TRL converts them to ``messages``;
* ``prompt`` and ``completion``: strings, or lists of turns (chat template); loss on the completion.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["SFTInputError", "check_sft_dataset", "check_batch_settings"]


class SFTInputError(ValueError):
    """A data set or setting an SFT trainer cannot train on; the message says what to change."""


def dataset_type_error(name: str, dataset: Any, trainer: str = "SFTTrainer") -> Optional[TypeError]:
    """A ``TypeError`` for a data set that is not a ``datasets.Dataset`` / ``IterableDataset`` (``trainer``
    names the trainer that reads it)."""
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

    if isinstance(dataset, (Dataset, IterableDataset)):
        return None
    if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        return TypeError(
            f"{name} is a {type(dataset).__name__} with the splits {list(dataset)}, not one split. Pass one of them, "
            f"e.g. {name}=dataset['{next(iter(dataset), 'train')}'], or load a single split with "
            "load_dataset(..., split='train')."
        )
    if isinstance(dataset, (list, tuple)):
        first = dataset[0] if dataset else None
        fix = (
            "datasets.Dataset.from_dict({'text': rows})" if isinstance(first, str)
            else "datasets.Dataset.from_list(rows)"
        )
        return TypeError(
            f"{name} is a Python {type(dataset).__name__} of {len(dataset)} rows; {trainer} reads a "
            f"datasets.Dataset. Wrap it first: {name} = {fix}."
        )
    if type(dataset).__name__ == "DataFrame":
        return TypeError(
            f"{name} is a pandas DataFrame; {trainer} reads a datasets.Dataset. Convert it first: "
            f"{name} = datasets.Dataset.from_pandas(df, preserve_index=False)."
        )
    if isinstance(dataset, dict):
        return TypeError(
            f"{name} is a dict of columns {sorted(dataset)}; {trainer} reads a datasets.Dataset. Convert it "
            f"first: {name} = datasets.Dataset.from_dict(columns)."
        )
    return TypeError(
        f"{name} is a {type(dataset).__name__}; {trainer} reads a datasets.Dataset or IterableDataset "
        "(datasets.load_dataset, Dataset.from_list, Dataset.from_pandas)."
    )


def first_dataset_row(name: str, dataset: Any) -> dict[str, Any]:
    """The first row of ``dataset`` (named ``name`` in messages); ``SFTInputError`` when it has none."""
    from datasets import Dataset

    if isinstance(dataset, Dataset) and len(dataset) > 0:
        return dataset[0]
    if not isinstance(dataset, Dataset):
        for row in dataset:  # an IterableDataset: its first row, if any
            return row
    purpose = "train" if name.startswith("train") else "evaluate"
    raise SFTInputError(
        f"{name} has no rows, so there is nothing to {purpose} on. Check the step that built it: the split or file "
        "it was loaded from, or a .filter() / .select() that removed every row."
    )


def _is_turns(value: Any, keys: tuple[str, str]) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, dict) and set(keys) <= set(t) for t in value)


def _mapping_hint(columns: list[str], row: dict[str, Any]) -> str:
    """One line of code that maps ``columns`` onto a layout SFTTrainer reads."""
    if {"instruction", "output"} <= set(columns):
        return (
            "from notebookkit.data import alpaca_to_messages\n"
            "  dataset = dataset.map(alpaca_to_messages, remove_columns=dataset.column_names)"
        )
    strings = [c for c in columns if isinstance(row.get(c), str)]
    if len(strings) >= 2:
        return f"dataset = dataset.rename_columns({{{strings[0]!r}: 'prompt', {strings[1]!r}: 'completion'}})"
    if len(strings) == 1:
        return f"dataset = dataset.rename_column({strings[0]!r}, 'text')  # or SFTConfig(dataset_text_field={strings[0]!r})"
    return "dataset = dataset.map(lambda row: {'text': ...})  # build the training text from your columns"


def _layout_error(name: str, columns: list[str], row: dict[str, Any], text_field: str) -> SFTInputError:
    text = (
        f"'{text_field}' (the column dataset_text_field names): the whole text of each example"
        if text_field != "text" else "'text': the whole text of each example (dataset_text_field= names another column)"
    )
    return SFTInputError(
        f"{name} has the columns {columns}, none of which SFTTrainer reads. It trains on one of these layouts:\n"
        f"  - {text}\n"
        "  - 'messages': a list of {'role', 'content'} turns, rendered with the tokenizer's chat template\n"
        "  - 'conversations': ShareGPT turns {'from', 'value'} (TRL converts them to messages)\n"
        "  - 'prompt' and 'completion': the loss is on the completion\n"
        "  - Alpaca's 'instruction', 'input', 'output': pass formatting_func= (a function that writes the text "
        "of a row), or map them to 'messages' with notebookkit.data.alpaca_to_messages\n"
        "Map your columns onto one of them, for example:\n"
        f"  {_mapping_hint(columns, row)}"
    )


def _needs_chat_template(
    name: str, column: str, tokenizer: Any, chat_template: Optional[str]
) -> Optional[SFTInputError]:
    inner = getattr(tokenizer, "tokenizer", None)  # a multimodal processor wraps its tokenizer
    templates = (chat_template, getattr(tokenizer, "chat_template", None), getattr(inner, "chat_template", None))
    if tokenizer is None or any(templates):
        return None
    from notebookkit.data.chat_templates import list_chat_templates

    return SFTInputError(
        f"{name} is conversational ({column!r} holds chat turns), but the tokenizer has no chat template to render "
        "them into text. Set the format your model uses first, e.g.\n"
        "  from notebookkit.chat_templates import get_chat_template\n"
        "  tokenizer = get_chat_template(tokenizer, 'chatml')\n"
        f"(formats: {', '.join(list_chat_templates())}), or write the text yourself into a 'text' column."
    )


def check_sft_dataset(
    dataset: Any,
    tokenizer: Any = None,
    *,
    name: str = "train_dataset",
    dataset_text_field: str = "text",
    formatting_func: Optional[Callable] = None,
    chat_template: Optional[str] = None,
) -> None:
    """Raise a readable error when ``dataset`` is something TRL's ``SFTTrainer`` cannot train on.

    Checks, in order: it is a ``datasets.Dataset`` / ``IterableDataset`` (not a list, a DataFrame or
    a ``DatasetDict`` of splits); it has at least one row; its first row has a layout SFTTrainer
    reads (see the module docstring), unless a ``formatting_func`` writes the text; chat turns have
    ``role``/``content`` keys and the tokenizer (or ``chat_template``, TRL's ``chat_template_path``)
    has a chat template to render them.

    Raises:
        TypeError: not a data set of rows (the message says how to make one).
        SFTInputError: no rows, or no layout SFTTrainer reads (the message lists the columns found,
            the layouts accepted and a line that maps them).
    """
    error = dataset_type_error(name, dataset)
    if error is not None:
        raise error
    row = first_dataset_row(name, dataset)
    columns = list(getattr(dataset, "column_names", None) or row)
    if "input_ids" in columns or formatting_func is not None:
        return
    # The order in which TRL decides (SFTTrainer._prepare_dataset): ShareGPT turns are converted to
    # "messages" first; then "prompt" rows are prompt/completion pairs; then "messages" rows are chats;
    # any other row is read from dataset_text_field.
    if "conversations" in columns and _is_turns(row["conversations"], ("from", "value")):
        error = _needs_chat_template(name, "conversations", tokenizer, chat_template)
    elif "prompt" in columns:
        if "completion" not in columns:
            raise SFTInputError(
                f"{name} has a 'prompt' column but no 'completion': SFT learns the completion of each prompt. Add "
                "the answers as a 'completion' column (rows with a prompt only are for GRPO, which generates the "
                f"answers itself). Columns found: {columns}."
            )
        error = _needs_chat_template(name, "prompt", tokenizer, chat_template) if isinstance(row["prompt"], list) else None
    elif "messages" in columns and _is_turns(row["messages"], ("role", "content")):
        error = _needs_chat_template(name, "messages", tokenizer, chat_template)
    elif dataset_text_field in columns:
        error = None
    elif "messages" in columns and isinstance(row["messages"], list):
        keys = sorted({k for t in row["messages"] if isinstance(t, dict) for k in t})
        raise SFTInputError(
            f"{name}'s 'messages' turns have the keys {keys}; SFTTrainer reads turns with 'role' and 'content'. "
            "Rewrite them first: dataset = standardize_sharegpt(dataset, column='messages') "
            "(from notebookkit.chat_templates)."
        )
    elif "conversations" in columns and _is_turns(row["conversations"], ("role", "content")):
        raise SFTInputError(
            f"{name} has 'conversations' of {{'role', 'content'}} turns; SFTTrainer reads such turns only from a "
            "column named 'messages'. Rename it: dataset = dataset.rename_column('conversations', 'messages'), "
            "or write the text yourself: dataset = dataset.map(lambda row: {'text': "
            "tokenizer.apply_chat_template(row['conversations'], tokenize=False)})."
        )
    else:
        raise _layout_error(name, columns, row, dataset_text_field)
    if error is not None:
        raise error


def check_batch_settings(args: Any) -> None:
    """Raise a readable ``SFTInputError`` for a batch setting below 1 (found at the first step otherwise)."""
    for field, what in (
        ("per_device_train_batch_size", "sequences each device takes per step"),
        ("gradient_accumulation_steps", "micro-batches summed into one optimizer step"),
        ("per_device_eval_batch_size", "sequences each device takes per evaluation step"),
    ):
        value = getattr(args, field, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SFTInputError(
                f"{field}={value!r} must be a whole number of at least 1: it is the number of {what}. For a larger "
                "effective batch with little memory, keep per_device_train_batch_size small and raise "
                "gradient_accumulation_steps."
            )
