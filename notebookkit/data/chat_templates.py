"""Chat templates: turn a list of ``{"role", "content"}`` messages into the exact text a model was
(or will be) trained on, and make generation stop at the end of the assistant's turn.

A chat template is a Jinja program stored on the tokenizer (``tokenizer.chat_template``).
``tokenizer.apply_chat_template(messages)`` renders it. Each family wraps turns in its own markers::

    chatml / qwen   <|im_start|>user\\n{u}<|im_end|>\\n<|im_start|>assistant\\n{a}<|im_end|>\\n
    llama-3         <|start_header_id|>user<|end_header_id|>\\n\\n{u}<|eot_id|>...
    gemma           <start_of_turn>user\\n{u}<end_of_turn>\\n<start_of_turn>model\\n{a}<end_of_turn>\\n
    mistral         [INST] {u} [/INST] {a}</s>
    phi-3           <|user|>\\n{u}<|end|>\\n<|assistant|>\\n{a}<|end|>\\n
    phi-4           <|im_start|>user<|im_sep|>{u}<|im_end|><|im_start|>assistant<|im_sep|>{a}<|im_end|>
    alpaca          {system}\\n\\n### Instruction:\\n{u}\\n\\n### Response:\\n{a}</s>\\n\\n

Stopping: a model learns to emit the turn-end token (``<|im_end|>``, ``<|eot_id|>``, ...) after its
answer. ``generate`` stops on ``eos_token_id``, so :func:`get_chat_template` makes the turn-end token
the tokenizer's EOS (``map_eos_token=True``) and, given the model, adds it to
``model.generation_config.eos_token_id``.

The templates below are written for notebookkit; their markers follow the public formats of each
family so that a model trained with them talks to the same template at inference.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from notebookkit.families import FAMILIES, for_model_type

__all__ = [
    "ChatTemplate",
    "CHAT_TEMPLATES",
    "get_chat_template",
    "list_chat_templates",
    "template_spec",
    "apply_generation_eos",
    "guess_chat_template",
]


@dataclass(frozen=True)
class ChatTemplate:
    """One chat format.

    Attributes:
        name: registry name (``"chatml"``, ``"llama-3"``...).
        jinja: the Jinja source stored in ``tokenizer.chat_template``.
        stop_token: the token that ends an assistant turn (becomes EOS), or ``None`` to keep the
            tokenizer's own EOS (mistral, alpaca).
        instruction_part: text that starts a user turn (used by ``train_on_responses_only``).
        response_part: text that starts an assistant turn (labels are kept after it).
        special_tokens: tokens the format needs as single vocabulary entries.
    """

    name: str
    jinja: str
    stop_token: str | None
    instruction_part: str
    response_part: str
    special_tokens: tuple[str, ...] = ()


# Each template renders system / user / assistant messages in order. ``bos_token`` and
# ``eos_token`` are provided by ``apply_chat_template`` from the tokenizer.

_CHATML = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

_QWEN25 = (
    "{%- if messages and messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif -%}"
    + _CHATML
)

# Qwen3 answers either with a reasoning block or, with enable_thinking=False, an empty one.
_QWEN3 = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{ '<think>\n\n</think>\n\n' }}{%- endif -%}"
    "{%- endif -%}"
)

_LLAMA3 = (
    "{%- if bos_token is defined and bos_token -%}{{ bos_token }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}"
)

# Gemma has no system role: a system message is folded into the first user turn.
_GEMMA = (
    "{%- if bos_token is defined and bos_token -%}{{ bos_token }}{%- endif -%}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] | trim + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + ns.system + m['content'] | trim + '<end_of_turn>\n' }}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

_MISTRAL = (
    "{%- if bos_token is defined and bos_token -%}{{ bos_token }}{%- endif -%}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] | trim + '\n\n' -%}"
    "{%- elif m['role'] == 'user' -%}{{ '[INST] ' + ns.system + m['content'] | trim + ' [/INST]' }}"
    "{%- set ns.system = '' -%}"
    "{%- else -%}{{ ' ' + m['content'] | trim + eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

_PHI3 = (
    "{%- for m in messages -%}"
    "{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}"
)

_PHI4 = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '<|im_sep|>' + m['content'] + '<|im_end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant<|im_sep|>' }}{%- endif -%}"
)

_ALPACA = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{ messages[0]['content'] | trim + '\n\n' }}"
    "{%- else -%}"
    "{{ 'You are given an instruction, sometimes with extra input. Write a response that completes it.\n\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ '### Instruction:\n' + m['content'] | trim + '\n\n' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ '### Response:\n' + m['content'] | trim + eos_token + '\n\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '### Response:\n' }}{%- endif -%}"
)

_CHATML_SPEC = dict(
    stop_token="<|im_end|>",
    instruction_part="<|im_start|>user\n",
    response_part="<|im_start|>assistant\n",
    special_tokens=("<|im_start|>", "<|im_end|>"),
)
_LLAMA3_SPEC = dict(
    jinja=_LLAMA3,
    stop_token="<|eot_id|>",
    instruction_part="<|start_header_id|>user<|end_header_id|>\n\n",
    response_part="<|start_header_id|>assistant<|end_header_id|>\n\n",
    special_tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
)
_GEMMA_SPEC = dict(
    jinja=_GEMMA,
    stop_token="<end_of_turn>",
    instruction_part="<start_of_turn>user\n",
    response_part="<start_of_turn>model\n",
    special_tokens=("<start_of_turn>", "<end_of_turn>"),
)

CHAT_TEMPLATES: dict[str, ChatTemplate] = {
    "chatml": ChatTemplate("chatml", _CHATML, **_CHATML_SPEC),
    "qwen-2.5": ChatTemplate("qwen-2.5", _QWEN25, **_CHATML_SPEC),
    "qwen-3": ChatTemplate("qwen-3", _QWEN3, **_CHATML_SPEC),
    "llama-3": ChatTemplate("llama-3", **_LLAMA3_SPEC),
    "llama-3.1": ChatTemplate("llama-3.1", **_LLAMA3_SPEC),
    "gemma": ChatTemplate("gemma", **_GEMMA_SPEC),
    "gemma-3": ChatTemplate("gemma-3", **_GEMMA_SPEC),
    "mistral": ChatTemplate(
        "mistral", _MISTRAL, stop_token=None, instruction_part="[INST]", response_part="[/INST]"
    ),
    "phi-3": ChatTemplate(
        "phi-3",
        _PHI3,
        stop_token="<|end|>",
        instruction_part="<|user|>\n",
        response_part="<|assistant|>\n",
        special_tokens=("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
    ),
    "phi-4": ChatTemplate(
        "phi-4",
        _PHI4,
        stop_token="<|im_end|>",
        instruction_part="<|im_start|>user<|im_sep|>",
        response_part="<|im_start|>assistant<|im_sep|>",
        special_tokens=("<|im_start|>", "<|im_sep|>", "<|im_end|>"),
    ),
    "alpaca": ChatTemplate(
        "alpaca", _ALPACA, stop_token=None, instruction_part="### Instruction:\n", response_part="### Response:\n"
    ),
}

_ALIASES = {
    "llama3": "llama-3",
    "llama-3.2": "llama-3.1",
    "llama-3.3": "llama-3.1",
    "llama31": "llama-3.1",
    "qwen2.5": "qwen-2.5",
    "qwen-2": "qwen-2.5",
    "qwen2": "qwen-2.5",
    "qwen25": "qwen-2.5",
    "qwen3": "qwen-3",
    "gemma2": "gemma",
    "gemma-2": "gemma",
    "gemma3": "gemma-3",
    "phi3": "phi-3",
    "phi-3.5": "phi-3",
    "phi4": "phi-4",
    "unsloth": "chatml",
}
# A family's name picks its format (``"gemma3"`` -> ``gemma-3``; notebookkit.families).
# (names are looked up with "_" read as "-": "qwen3_moe" -> "qwen3-moe")
_ALIASES.update({f.name.replace("_", "-"): f.chat_template for f in FAMILIES.values()
                 if f.chat_template is not None and f.name.replace("_", "-") not in CHAT_TEMPLATES | _ALIASES})
# A family notebookkit has no format of yet (gpt-oss's harmony): its name is refused with the record's reason.
_NO_FORMAT = {f.name.replace("_", "-"): f for f in FAMILIES.values() if f.chat_template is None}


def list_chat_templates() -> list[str]:
    """Names accepted by :func:`get_chat_template` (aliases such as ``"llama3"`` also work)."""
    return sorted(CHAT_TEMPLATES)


def _canonical(name: str) -> str:
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key in _NO_FORMAT:
        raise ValueError(f"No chat template for {name!r}: {_NO_FORMAT[key].chat_template_missing}.")
    if key not in CHAT_TEMPLATES:
        raise ValueError(
            f"Unknown chat template {name!r}. Choose one of: {', '.join(list_chat_templates())}. "
            "To keep the tokenizer's own template, do not call get_chat_template."
        )
    return key


def template_spec(name_or_tokenizer: Any) -> ChatTemplate | None:
    """The :class:`ChatTemplate` for a name, or for a tokenizer whose ``chat_template`` is one of ours.

    Returns ``None`` for a tokenizer carrying some other template.
    """
    if isinstance(name_or_tokenizer, str):
        return CHAT_TEMPLATES[_canonical(name_or_tokenizer)]
    source = getattr(name_or_tokenizer, "chat_template", None)
    if not isinstance(source, str):
        return None
    for spec in CHAT_TEMPLATES.values():
        if spec.jinja == source:
            return spec
    return None


_NAME_HINTS = (
    ("llama-3.1", "llama-3.1"), ("llama-3.2", "llama-3.1"), ("llama-3.3", "llama-3.1"), ("llama-3", "llama-3"),
    ("llama3", "llama-3"), ("qwen3", "qwen-3"), ("qwen-3", "qwen-3"), ("qwen2", "qwen-2.5"), ("qwen", "qwen-2.5"),
    ("gemma-3", "gemma-3"), ("gemma3", "gemma-3"), ("gemma", "gemma"), ("mistral", "mistral"),
    ("phi-4", "phi-4"), ("phi4", "phi-4"), ("phi-3", "phi-3"), ("phi3", "phi-3"), ("llama", "llama-3"),
)
# then any other family named in the model's name, longest name first (notebookkit.families)
_NAME_HINTS += tuple((f.name, f.chat_template) for f in sorted(FAMILIES.values(), key=lambda f: -len(f.name))
                     if f.chat_template is not None
                     if f.name not in dict(_NAME_HINTS))


def guess_chat_template(tokenizer: Any, model_name: str | None = None) -> str:
    """Pick a format for a model: from its name when it names a family (``"Qwen/Qwen3-0.6B"`` ->
    ``qwen-3``, ``"notebookkit/tiny-gemma3"`` -> ``gemma-3``), else from the special tokens the
    tokenizer already has, so no token is added and no embedding resize is needed.

    Token checks, in order: ``<|start_header_id|>`` (llama-3), ``<start_of_turn>`` (gemma),
    ``<|im_sep|>`` (phi-4), ``<|im_start|>`` (chatml), ``<|assistant|>`` (phi-3), ``[INST]``
    (mistral); ``alpaca`` (plain text) when none is present.
    """
    vocab = tokenizer.get_vocab()

    def usable(name: str) -> bool:
        return all(t in vocab for t in CHAT_TEMPLATES[name].special_tokens)

    name = (model_name or getattr(tokenizer, "name_or_path", "") or "").lower()
    for hint, template in _NAME_HINTS:
        if hint in name and usable(template):
            return template
    for token, template in (
        ("<|start_header_id|>", "llama-3"),
        ("<start_of_turn>", "gemma"),
        ("<|im_sep|>", "phi-4"),
        ("<|im_start|>", "chatml"),
        ("<|assistant|>", "phi-3"),
        ("[INST]", "mistral"),
    ):
        if token in vocab and usable(template):
            return template
    return "alpaca"


def _token_id(tokenizer: Any, token: str) -> int | None:
    vocab = tokenizer.get_vocab()
    return vocab.get(token)


def install_chat_template(tokenizer: Any, model: Any, name: str | None = None, model_name: str | None = None) -> str | None:
    """A notebook's chat format for ``model``: ``name`` when given; for a family notebookkit writes no
    format of (``Family.chat_template`` is ``None``: gpt-oss speaks OpenAI's harmony format) whose
    tokenizer ships a template, that template, kept as it is (generation stops at its EOS); else the
    guess of :func:`guess_chat_template`. The tokenizer is changed in place.

    Returns the notebookkit format's name, or ``None`` when the tokenizer's own template was kept."""
    family = for_model_type(getattr(getattr(model, "config", None), "model_type", None))
    if name is None and family is not None and family.chat_template is None and tokenizer.chat_template:
        apply_generation_eos(model, tokenizer)
        return None
    name = name or guess_chat_template(tokenizer, model_name)
    get_chat_template(tokenizer, name, model=model)
    return name


def apply_generation_eos(model: Any, tokenizer: Any) -> list[int]:
    """Make ``model.generate`` stop at the tokenizer's EOS (the turn-end token after
    :func:`get_chat_template`) as well as at the model's original EOS ids.

    Returns the list of stop ids written to ``model.generation_config.eos_token_id``.
    """
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    if gen is None:
        return ids
    old = gen.eos_token_id
    for i in old if isinstance(old, (list, tuple)) else [old]:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    gen.eos_token_id = ids if len(ids) > 1 else ids[0]
    if gen.pad_token_id is None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    return ids


def get_chat_template(
    tokenizer: Any,
    name: str | None = None,
    *,
    chat_template: str | None = None,
    map_eos_token: bool = True,
    model: Any = None,
    add_missing_tokens: bool = True,
    mapping: dict[str, str] | None = None,
) -> Any:
    """Attach a chat format to ``tokenizer`` and make generation stop at the end of a turn.

    Args:
        tokenizer: a Hugging Face tokenizer (changed in place and returned).
        name: one of :func:`list_chat_templates` — ``chatml``, ``llama-3``/``llama-3.1``,
            ``qwen-2.5``/``qwen-3``, ``gemma``/``gemma-3``, ``mistral``, ``phi-3``/``phi-4``, ``alpaca``.
        chat_template: same as ``name`` (the keyword used by other notebooks).
        map_eos_token: set ``tokenizer.eos_token`` to the format's turn-end token (for example
            ``<|im_end|>``) so that generation stops after one answer. The old EOS becomes the pad
            token when the tokenizer had none.
        model: optional; when given, its ``generation_config.eos_token_id`` gets the turn-end id too.
        add_missing_tokens: add the format's special tokens that the vocabulary lacks. The model
            then needs ``model.resize_token_embeddings(len(tokenizer))`` (a warning says so).
        mapping: accepted as other notebooks pass it only when it maps ``role``/``content`` (and
            ``user``/``assistant``) to themselves. A template that reads ShareGPT's ``from``/``value``
            is not provided: convert the data with :func:`~notebookkit.data.sharegpt.standardize_sharegpt`.

    Returns:
        The same tokenizer, so ``tokenizer = get_chat_template(tokenizer, "chatml")`` works.
    """
    chosen = name or chat_template
    if chosen is None:
        raise TypeError("get_chat_template needs a template name, e.g. get_chat_template(tokenizer, 'chatml').")
    if isinstance(chosen, (tuple, list)):
        raise TypeError(
            "get_chat_template: a (jinja template, EOS token) pair is not supported. Set your own template directly: "
            "tokenizer.chat_template = template (and tokenizer.eos_token = eos_token), or pick one of: "
            f"{', '.join(list_chat_templates())}."
        )
    if mapping and any(k != v for k, v in mapping.items()):
        raise TypeError(
            f"get_chat_template: mapping={mapping!r} asks for a template that reads other keys or role names "
            "(ShareGPT's from/value), which notebookkit does not build. Convert the data instead, then leave "
            "mapping out: dataset = standardize_sharegpt(dataset) rewrites from/value turns as role/content."
        )
    spec = CHAT_TEMPLATES[_canonical(chosen)]

    missing = [t for t in spec.special_tokens if _token_id(tokenizer, t) is None]
    if missing:
        if not add_missing_tokens:
            raise ValueError(
                f"The tokenizer has no single token for {missing}, which the {spec.name!r} format needs. "
                "Pick the template your model was trained with, or pass add_missing_tokens=True and resize the "
                "model's embeddings."
            )
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing], special_tokens=True)
        warnings.warn(
            f"Added {missing} to the tokenizer for the {spec.name!r} format; call "
            "model.resize_token_embeddings(len(tokenizer)) before training so the new tokens get embeddings.",
            stacklevel=2,
        )

    tokenizer.chat_template = spec.jinja
    if map_eos_token and spec.stop_token is not None:
        old_eos = tokenizer.eos_token
        if tokenizer.pad_token is None and old_eos is not None and old_eos != spec.stop_token:
            tokenizer.pad_token = old_eos
        tokenizer.eos_token = spec.stop_token
    if model is not None:
        apply_generation_eos(model, tokenizer)
    return tokenizer
