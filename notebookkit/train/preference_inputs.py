"""What the preference trainers (DPO, ORPO) train on, checked before TRL sees it: ``prompt`` / ``chosen`` /
``rejected`` columns of strings or chat turns, each error naming the fix. Imports nothing heavy (no torch, no
TRL)."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["PreferenceInputError", "check_preference_dataset", "check_preference_datasets", "PREFERENCE_COLUMNS"]

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")
_TOKENISED = ("prompt_ids", "chosen_ids", "rejected_ids")


class PreferenceInputError(ValueError):
    """A preference data set (DPO, ORPO) a trainer cannot train on; the message says what to change."""


def _is_turns(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, dict) and {"role", "content"} <= set(t) for t in value)


def _kind(value: Any) -> Optional[str]:
    if isinstance(value, str):
        return "text"
    if _is_turns(value):
        return "chat"
    return None


_EXPECTED = (
    "Expected format, one row per preference pair:\n"
    "  - 'prompt': the question, a string or a list of chat turns [{'role': 'user', 'content': ...}]\n"
    "  - 'chosen': the preferred answer, a string or [{'role': 'assistant', 'content': ...}]\n"
    "  - 'rejected': a worse answer to the same prompt, in the same form as 'chosen'\n"
    "for example {'prompt': 'What colour is a banana?', 'chosen': 'A banana is yellow.', "
    "'rejected': 'A banana is blue.'}"
)


def _rename_hint(columns: list[str], row: dict[str, Any], missing: list[str]) -> str:
    spare = [c for c in columns if c not in PREFERENCE_COLUMNS and _kind(row.get(c)) is not None]
    if len(spare) == len(missing):
        pairs = ", ".join(f"{old!r}: {new!r}" for old, new in zip(spare, missing))
    else:
        pairs = ", ".join(f"'<your {new} column>': {new!r}" for new in missing)
    return f"  dataset = dataset.rename_columns({{{pairs}}})"


def check_preference_dataset(dataset: Any, *, name: str = "train_dataset", trainer: str = "DPOTrainer",
                             tokenised: bool = True) -> None:
    """Raise a readable error when ``dataset`` is not a preference data set ``trainer`` can read.

    Accepted: ``prompt`` / ``chosen`` / ``rejected`` columns of strings or chat turns (both answers
    in the same form as each other); ``chosen`` / ``rejected`` chats alone, whose shared first turns TRL
    takes as the prompt; and, when ``tokenised``, DPO's pre-tokenised ``prompt_ids`` / ``chosen_ids`` /
    ``rejected_ids``.

    Raises:
        TypeError: not a ``datasets.Dataset`` / ``IterableDataset``.
        PreferenceInputError: no rows, a missing column (named, with the expected format and a line
            that renames columns), or a value of the wrong type (the row's column and its type).
    """
    from .trainer_glue import first_row

    row, columns = first_row(dataset, name, trainer, PreferenceInputError)
    if tokenised and set(_TOKENISED) <= set(columns):
        return
    implicit_prompt = "prompt" not in columns and _is_turns(row.get("chosen")) and _is_turns(row.get("rejected"))
    missing = [c for c in PREFERENCE_COLUMNS if c not in columns and not (c == "prompt" and implicit_prompt)]
    if missing:
        raise PreferenceInputError(
            f"{name} has the columns {columns}; {trainer} needs 'prompt', 'chosen' and 'rejected' (missing: {missing}). "
            f"{_EXPECTED}\nMap your columns onto these names, for example:\n{_rename_hint(columns, row, missing)}"
        )
    present = [c for c in PREFERENCE_COLUMNS if c in columns]
    kinds = {c: _kind(row[c]) for c in present}
    for column, kind in kinds.items():
        if kind is None:
            raise PreferenceInputError(
                f"{name}[0][{column!r}] is a {type(row[column]).__name__} ({str(row[column])[:80]!r}); {trainer} reads "
                f"a string or a list of chat turns with 'role' and 'content' there. {_EXPECTED}"
            )
    if kinds.get("chosen") != kinds.get("rejected"):
        raise PreferenceInputError(
            f"{name}[0] has 'chosen' as {kinds['chosen']} and 'rejected' as {kinds['rejected']}; both answers must "
            "have the same form (two strings, or two lists of chat turns) so that they are scored alike."
        )
    if kinds.get("prompt") == "chat" and kinds["chosen"] == "text":
        raise PreferenceInputError(
            f"{name}[0] has a chat 'prompt' but plain-text answers; with a chat prompt the answers are assistant "
            "turns: dataset = dataset.map(lambda row: {'chosen': [{'role': 'assistant', 'content': row['chosen']}], "
            "'rejected': [{'role': 'assistant', 'content': row['rejected']}]})"
        )


def check_preference_datasets(arguments: dict[str, Any], trainer: str, tokenised: bool) -> None:
    """:func:`check_preference_dataset` on the ``train_dataset`` and every ``eval_dataset`` of a trainer call."""
    if arguments.get("train_dataset") is not None:
        check_preference_dataset(arguments["train_dataset"], trainer=trainer, tokenised=tokenised)
    evaluation = arguments.get("eval_dataset")
    if isinstance(evaluation, dict):
        for key, dataset in evaluation.items():
            check_preference_dataset(dataset, name=f"eval_dataset[{key!r}]", trainer=trainer, tokenised=tokenised)
    elif evaluation is not None:
        check_preference_dataset(evaluation, name="eval_dataset", trainer=trainer, tokenised=tokenised)
