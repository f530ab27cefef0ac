"""ShareGPT / Alpaca -> role/content: one conversation format for every chat template.

ShareGPT-style data stores turns as ``{"from": "human" | "gpt" | "system", "value": text}``; chat
templates (and TRL) read ``{"role": "user" | "assistant" | "system", "content": text}``. The mapping
is a renaming of keys and role names; text is left untouched. Alpaca rows
(``instruction``, optional ``input``, ``output``) become a user turn and an assistant turn.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ROLE_ALIASES", "to_role_content", "standardize_sharegpt", "alpaca_to_messages"]

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


def to_role_content(turns: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Convert one conversation's turns to ``{"role", "content"}`` dicts (already-converted turns pass)."""
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
        mapped = ROLE_ALIASES.get(str(role).strip().lower())
        if mapped is None:
            raise ValueError(
                f"Turn {i} has the unknown role {role!r}. Known roles: {sorted(ROLE_ALIASES)}. Rename it, or add "
                "it to notebookkit.data.sharegpt.ROLE_ALIASES."
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
