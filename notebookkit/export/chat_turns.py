"""What a chat template puts around each turn, read off the template itself by rendering it.

The same template that formatted the training data decides where an answer ends when the model is
served, so the serving side (the generation config's EOS ids, the GGUF's end-of-turn token, the
Ollama ``TEMPLATE`` and ``stop`` parameters) is derived from it rather than written by hand:

* render ``[user: U]`` with the generation prompt: the prompt text with ``U`` as a placeholder;
* the same with a system message ``S`` first (when the template accepts one);
* render ``[user: U, assistant: A]``: what follows ``A`` is the assistant's turn suffix; its first
  special token is the end-of-turn token (``<|eot_id|>``, ``<|im_end|>``, ``<end_of_turn>``, ``</s>``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["ChatTurns", "chat_turns"]

_USER, _SYSTEM, _ASSISTANT = "\u2063USER\u2063", "\u2063SYSTEM\u2063", "\u2063ASSISTANT\u2063"


@dataclass(frozen=True)
class ChatTurns:
    """The pieces of one chat template, with ``{user}`` / ``{system}`` placeholders."""

    prompt: str  # one user turn and the generation prompt, "{user}" where the text goes
    prompt_with_system: Optional[str]  # the same with a system message "{system}" first; None if refused
    assistant_suffix: str  # what the template writes after an assistant answer
    end_of_turn: Optional[str]  # the special token that ends the assistant's turn
    end_of_turn_id: Optional[int]
    bos_text: str  # the BOS text the template itself writes at the start ('' if none)


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def chat_turns(tokenizer: Any) -> ChatTurns:
    """Read the turn structure of ``tokenizer.chat_template`` (raises ``ValueError`` without one)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "The tokenizer has no chat template, so the end of an assistant turn is unknown. Set one first: "
            "tokenizer = get_chat_template(tokenizer, 'llama-3') (from notebookkit import get_chat_template)."
        )
    prompt = _render(tokenizer, [{"role": "user", "content": _USER}], True)
    try:
        with_system = _render(tokenizer, [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _USER}], True)
        if _SYSTEM not in with_system:
            with_system = None
    except Exception:  # noqa: BLE001 - templates that refuse a system role
        with_system = None
    answered = _render(tokenizer, [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}], False)
    suffix = answered.split(_ASSISTANT, 1)[1] if _ASSISTANT in answered else ""
    specials = sorted((t for t in tokenizer.all_special_tokens + list(getattr(tokenizer, "added_tokens_encoder", {})) if t), key=len, reverse=True)
    end_token = None
    for i in range(len(suffix)):
        hit = next((t for t in specials if suffix.startswith(t, i)), None)
        if hit is not None:
            end_token = hit
            break
    if end_token is None and tokenizer.eos_token:
        end_token = tokenizer.eos_token
    end_id = tokenizer.convert_tokens_to_ids(end_token) if end_token is not None else None
    bos = tokenizer.bos_token or ""
    bos_text = bos if bos and prompt.startswith(bos) else ""

    def placeholders(text: str) -> str:
        return text.replace("{", "{{").replace("}", "}}").replace(_USER, "{user}").replace(_SYSTEM, "{system}")

    return ChatTurns(
        prompt=placeholders(prompt),
        prompt_with_system=placeholders(with_system) if with_system is not None else None,
        assistant_suffix=suffix,
        end_of_turn=end_token,
        end_of_turn_id=end_id,
        bos_text=bos_text,
    )


def stop_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """Token ids that end generation: the end-of-turn token, the tokenizer's EOS and the config's."""
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v >= 0 and v not in ids:
                ids.append(v)

    if getattr(tokenizer, "chat_template", None):
        add(chat_turns(tokenizer).end_of_turn_id)
    add(tokenizer.eos_token_id)
    if generation_config is not None:
        add(getattr(generation_config, "eos_token_id", None))
    return ids
