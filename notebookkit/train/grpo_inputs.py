"""What GRPO trains on, checked before TRL sees it: the data set's ``prompt`` column and the reward
functions' parameters against its columns. Imports nothing heavy (no torch, no TRL)."""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["GRPOInputError", "check_grpo_dataset"]


class GRPOInputError(ValueError):
    """A data set GRPO cannot train on; the message says what to change."""


def _is_turns(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, dict) for t in value)


def check_grpo_dataset(dataset: Any, reward_funcs: Iterable[Any] = (), *, name: str = "train_dataset") -> None:
    """Raise a readable error when GRPO cannot train on ``dataset`` with ``reward_funcs``.

    The data set needs a ``prompt`` column: a string the completion continues, or a list of chat
    turns ``{"role", "content"}`` (rendered with the chat template, generation prompt added). Its
    other columns go to the reward functions by name, so each function's parameters are checked
    against them (:func:`~notebookkit.train.rewards.check_reward_functions`).

    Raises:
        TypeError: not a ``datasets.Dataset`` / ``IterableDataset``.
        GRPOInputError: no rows, no ``prompt`` column, or prompts of the wrong form.
        RewardFunctionError: a reward function that needs a column the data set lacks.
    """
    from .rewards import check_reward_functions
    from .trainer_glue import first_row

    row, columns = first_row(dataset, name, "GRPOTrainer", GRPOInputError)
    if "prompt" not in columns:
        source = next((c for c in ("question", "query", "instruction", "input", "problem", "text") if c in columns), None)
        fix = (f"dataset = dataset.map(lambda row: {{'prompt': [{{'role': 'user', 'content': row[{source!r}]}}]}})"
               if source else "dataset = dataset.map(lambda row: {'prompt': [{'role': 'user', 'content': ...}]})")
        raise GRPOInputError(
            f"{name} has the columns {columns}; GRPOTrainer needs a 'prompt' column (missing: ['prompt']). Expected "
            "format, one row per prompt: 'prompt', the text the model continues (a string) or a list of chat turns "
            "[{'role': 'system', 'content': ...}, {'role': 'user', 'content': ...}]; any other column (for example "
            "'answer') is passed to the reward functions under its name. GRPO writes the completions itself, so no "
            f"answer column is trained on. Build the prompts, for example:\n  {fix}"
        )
    prompt = row["prompt"]
    if _is_turns(prompt):
        bad = [t for t in prompt if not {"role", "content"} <= set(t)]
        if bad:
            raise GRPOInputError(
                f"{name}[0]['prompt'] is a list of turns, but {bad[0]!r} has no 'role' and 'content'. Chat prompts are "
                "[{'role': 'user', 'content': 'the question'}] (a 'system' turn first if you like)."
            )
    elif not isinstance(prompt, str):
        raise GRPOInputError(
            f"{name}[0]['prompt'] is a {type(prompt).__name__} ({str(prompt)[:80]!r}); GRPOTrainer reads a string or a "
            "list of chat turns {'role', 'content'} there."
        )
    check_reward_functions(reward_funcs, columns)
