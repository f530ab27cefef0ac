"""ShareGPT / Alpaca -> role/content: one conversation format for every chat template.

ShareGPT-style data stores turns as ``{"from": "human" | "gpt" | "system", "value": text}``; chat
templates (and TRL) read ``{"role": "user" | "assistant" | "system", "content": text}``. The mapping
is a renaming of keys and role names; text is left untouched. Alpaca rows
(``instruction``, optional ``input``, ``output``) become a user turn and an assistant turn.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["ROLE_ALIASES", "to_role_content", "standardize_sharegpt", "standardize_data_formats", "alpaca_to_messages"]

ROLE_ALIASES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "prompter": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


def to_role_content(
    turns: list[dict[str, Any]], role_aliases: dict[str, str] | None = None
) -> list[dict[str, str]]:
    """Convert one conversation's turns to ``{"role", "content"}`` dicts (already-converted turns pass).

    Role names are mapped through ``role_aliases`` (default :data:`ROLE_ALIASES`).
    """
    aliases = ROLE_ALIASES if role_aliases is None else role_aliases
    out = []
    for i, turn in enumerate(turns):
        if "role" in turn and "content" in turn:
            role, content = turn["role"], turn["content"]
        elif "from" in turn and "value" in turn:
            role, content = turn["from"], turn["value"]
        else:
            raise ValueError(
                f"Turn {i} has keys {sorted(turn)}; expected 'from'/'value' (ShareGPT) or 'role'/'content'."
            )
        mapped = aliases.get(str(role).strip().lower())
        if mapped is None:
            where = "notebookkit.data.sharegpt.ROLE_ALIASES" if role_aliases is None else "the role aliases you passed"
            raise ValueError(
                f"Turn {i} has the unknown role {role!r}. Known roles: {sorted(aliases)}. Rename it, or add "
                f"it to {where}."
            )
        out.append({"role": mapped, "content": content})
    return out


def standardize_sharegpt(
    dataset: Any,
    column: str | None = None,
    output_column: str | None = None,
    num_proc: int | None = None,
) -> Any:
    """Rewrite ShareGPT turns (``from``/``value``) as ``role``/``content`` messages.

    Args:
        dataset: a ``datasets.Dataset`` with a list-of-turns column.
        column: the column with the turns; ``"conversations"`` (or ``"messages"``) when left out.
        output_column: where to write; the same column by default (so code written for other
            notebooks that reads ``examples["conversations"]`` keeps working). Pass ``"messages"``
            to get the column name TRL's ``SFTTrainer`` reads directly.
        num_proc: processes for ``datasets.map``.

    Returns:
        A new dataset; other columns are kept.
    """
    names = list(dataset.column_names)
    if column is None:
        column = next((c for c in ("conversations", "messages") if c in names), None)
        if column is None:
            raise ValueError(f"No 'conversations' or 'messages' column in {names}; pass column=.")
    out = output_column or column

    def fn(batch: dict[str, list]) -> dict[str, list]:
        return {out: [to_role_content(turns) for turns in batch[column]]}

    remove = [column] if out != column else None
    kwargs: dict[str, Any] = {"batched": True, "remove_columns": remove, "desc": "Standardising ShareGPT turns"}
    if num_proc:
        kwargs["num_proc"] = num_proc
    return dataset.map(fn, **kwargs)


def standardize_data_formats(
    dataset: Any,
    tokenizer: Any = None,
    aliases_for_system: Sequence[str] = ("system",),
    aliases_for_user: Sequence[str] = ("user", "human", "input"),
    aliases_for_assistant: Sequence[str] = ("gpt", "assistant", "output"),
    batch_size: int = 1000,
    num_proc: int | None = None,
) -> Any:
    """Rewrite the ``conversations`` column as ``{"role", "content"}`` turns, under the name and with
    the role lists the most used notebooks pass (``standardize_data_formats(dataset)``).

    Turns may be ShareGPT's ``from``/``value`` or already ``role``/``content``; each role name is
    mapped to ``system`` / ``user`` / ``assistant`` through the three alias lists (an unknown role
    raises, naming it). A dataset without a ``conversations`` column is returned unchanged. The
    column keeps its name; other columns are kept.

    Args:
        dataset: a ``datasets.Dataset`` or ``IterableDataset``.
        tokenizer: a text tokenizer (it changes nothing). A vision processor, whose turns hold lists
            of typed parts, is refused: vision rows go to :class:`~notebookkit.data.VisionDataCollator`
            as they are.
        aliases_for_system, aliases_for_user, aliases_for_assistant: the role names of each role.
        batch_size, num_proc: for ``datasets.map``.
    """
    if tokenizer is not None and hasattr(tokenizer, "image_processor"):
        raise NotImplementedError(
            "standardize_data_formats: a vision processor was passed; this helper rewrites text conversations only. "
            "Vision rows ('messages' with image and text parts, plus 'images') need no rewriting: pass them to "
            "notebookkit.data.VisionDataCollator(model, processor). Here pass a text tokenizer, or none."
        )
    from datasets import Dataset

    columns = dataset.column_names or list(next(iter(dataset), {}))  # a stream may not know its columns
    if "conversations" not in columns:
        return dataset
    aliases = {name.lower(): "system" for name in aliases_for_system}
    aliases.update({name.lower(): "user" for name in aliases_for_user})
    aliases.update({name.lower(): "assistant" for name in aliases_for_assistant})

    def fn(batch: dict[str, list]) -> dict[str, list]:
        return {"conversations": [to_role_content(turns, aliases) for turns in batch["conversations"]]}

    kwargs: dict[str, Any] = {"batched": True, "batch_size": batch_size}
    if isinstance(dataset, Dataset):  # IterableDataset.map takes neither
        kwargs["desc"] = "Standardising conversations"
        if num_proc:
            kwargs["num_proc"] = num_proc
    return dataset.map(fn, **kwargs)


def alpaca_to_messages(row: dict[str, Any], system: str | None = None) -> dict[str, list[dict[str, str]]]:
    """``{"instruction", "input", "output"}`` -> ``{"messages": [user, assistant]}`` (for ``dataset.map``).

    The optional ``input`` is appended to the instruction after a blank line; ``system`` adds a
    system turn first.
    """
    prompt = str(row["instruction"]).strip()
    extra = str(row.get("input") or "").strip()
    if extra:
        prompt += "\n\n" + extra
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": str(row["output"]).strip()}]
    return {"messages": messages}
