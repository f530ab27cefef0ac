"""An Ollama ``Modelfile`` beside a GGUF file, derived from the tokenizer's chat template.

Ollama formats a chat with a Go template. The template here is the training chat template read
back by :func:`notebookkit.export.chat_turns.chat_turns`: the prompt text with ``{{ .System }}`` and
``{{ .Prompt }}`` where the system and user messages go, then ``{{ .Response }}`` and the
assistant's turn suffix. The BOS token is left out when the GGUF adds it itself. ``PARAMETER stop``
lists the end-of-turn token and the EOS token, so Ollama stops where the assistant's turn ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .chat_turns import chat_turns

__all__ = ["ollama_template", "modelfile_text", "write_modelfile"]


def _go_literal(text: str) -> str:
    """Text safe inside a Go template (a literal ``{{`` is written as ``{{ "{{" }}``)."""
    return text.replace("{{", '{{ "{{" }}')


def ollama_template(tokenizer: Any, bos_added_by_runtime: bool = True) -> str:
    """The Go ``TEMPLATE`` of the tokenizer's chat template (single turn, optional system)."""
    turns = chat_turns(tokenizer)

    def fill(text: str) -> str:
        filled = text.format(user="\x00P\x00", system="\x00S\x00")
        if bos_added_by_runtime and turns.bos_text and filled.startswith(turns.bos_text):
            filled = filled[len(turns.bos_text):]
        return _go_literal(filled).replace("\x00P\x00", "{{ .Prompt }}").replace("\x00S\x00", "{{ .System }}")

    prompt = fill(turns.prompt)
    suffix = _go_literal(turns.assistant_suffix)
    if turns.prompt_with_system is not None:
        head = "{{ if .System }}" + fill(turns.prompt_with_system) + "{{ else }}" + prompt + "{{ end }}"
    else:
        head = prompt
    return head + "{{ .Response }}" + suffix


def modelfile_text(gguf_path: Path, tokenizer: Any, bos_added_by_runtime: bool = True) -> str:
    """The whole Modelfile: ``FROM`` the GGUF (relative), ``TEMPLATE`` and ``PARAMETER stop`` lines."""
    turns = chat_turns(tokenizer)
    stops = []
    for token in (turns.end_of_turn, tokenizer.eos_token):
        if token and token not in stops:
            stops.append(token)
    template = ollama_template(tokenizer, bos_added_by_runtime)
    lines = [f"FROM ./{gguf_path.name}", f'TEMPLATE """{template}"""']
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    return "\n".join(lines) + "\n"


def write_modelfile(folder: Path, gguf_path: Path, tokenizer: Any) -> Path:
    """Write ``folder/Modelfile`` for ``gguf_path``; ``ollama create NAME -f Modelfile`` imports it."""
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    bos_added = tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id
    path = Path(folder) / "Modelfile"
    path.write_text(modelfile_text(gguf_path, tokenizer, bos_added))
    return path
