"""The tokenizer as GGUF metadata (``tokenizer.ggml.*``): byte-level BPE here, SentencePiece-style
(byte-fallback BPE: Llama 2, Mistral v0.1-v0.3, Gemma) in :mod:`.gguf_sentencepiece`.

llama.cpp rebuilds the Hugging Face tokenizer from:

* ``model = "gpt2"`` (byte-level BPE) and ``pre``: the pre-tokenizer's split regex, by name
  (``gpt-2`` for GPT-2's ByteLevel regex, ``llama-bpe`` for Llama 3's, ``qwen2`` for Qwen2's);
* ``tokens``: every token string by id (ids the tokenizer lacks up to the model's vocab size are
  padded as unused ``[PAD<id>]``), ``token_type``: 1 normal, 3 control (special added tokens),
  4 user-defined (other added tokens), 5 unused; ``merges``: the BPE merges as ``"left right"``;
* the special ids ``bos/eos/pad/unk``, ``eot`` (the token that ends the assistant's turn, from the
  chat template), whether BOS / EOS are added to a prompt, and the chat template itself.
"""

from __future__ import annotations

import json
from typing import Any

from .chat_turns import chat_turns
from .checks import ExportError
from .gguf_sentencepiece import is_sentencepiece_style, sentencepiece_metadata

__all__ = ["tokenizer_metadata", "pre_tokenizer_name"]

_GPT2_PRE = "gpt-2"
# The split regexes of Llama 3 and Qwen2 tokenizers (tokenizer.json "Split" pre-tokenizers).
_SPLIT_REGEXES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}


def pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's name for a tokenizer.json ``pre_tokenizer``; raises for one it has no name for."""
    if pre is None:
        raise ExportError("The tokenizer has no pre-tokenizer; GGUF export supports byte-level BPE tokenizers.")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return _GPT2_PRE
    if pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers", [])
        splits = [p for p in parts if p.get("type") == "Split"]
        if len(splits) == 1 and all(p.get("type") in ("Split", "ByteLevel") for p in parts):
            regex = splits[0].get("pattern", {}).get("Regex")
            if regex in _SPLIT_REGEXES:
                return _SPLIT_REGEXES[regex]
    raise ExportError(
        "GGUF export knows the pre-tokenizers of GPT-2, Llama 3 and Qwen2 byte-level BPE tokenizers, and this "
        f"tokenizer's is another one ({json.dumps(pre)[:200]}). Save with save_pretrained_merged and convert the "
        "folder with llama.cpp's convert_hf_to_gguf.py, which knows more tokenizers."
    )


def _adds_token(tokenizer: Any, token_id: int | None, at_start: bool) -> bool:
    if token_id is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and (ids[0] if at_start else ids[-1]) == token_id


def tokenizer_metadata(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` fields (plus the chat template) of a fast tokenizer: byte-level BPE
    (``model = "gpt2"``, below) or SentencePiece-style (``model = "llama"``, :mod:`.gguf_sentencepiece`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ExportError("GGUF export needs a fast tokenizer (tokenizer.json); load it with use_fast=True.")
    spec = json.loads(backend.to_str())
    if is_sentencepiece_style(spec):
        meta = sentencepiece_metadata(spec, vocab_size)
    else:
        meta = _byte_level_metadata(spec, vocab_size)
    meta["add_bos"] = _adds_token(tokenizer, tokenizer.bos_token_id, True)
    meta["add_eos"] = _adds_token(tokenizer, tokenizer.eos_token_id, False)
    for key, value in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                       ("pad", tokenizer.pad_token_id), ("unk", getattr(tokenizer, "unk_token_id", None))):
        if value is not None:
            meta[key] = int(value)
    if getattr(tokenizer, "chat_template", None):
        meta["chat_template"] = tokenizer.chat_template
        end = chat_turns(tokenizer).end_of_turn_id
        if end is not None:
            meta["eot"] = int(end)
    return meta


def _byte_level_metadata(spec: dict, vocab_size: int) -> dict[str, Any]:
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise ExportError(
            f"GGUF export writes BPE tokenizers (byte-level, or SentencePiece-style with byte fallback); this one is "
            f"{model.get('type')}. Save with save_pretrained_merged and convert the folder with llama.cpp's convert_hf_to_gguf.py."
        )
    pre = pre_tokenizer_name(spec.get("pre_tokenizer"))
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t for t in spec.get("added_tokens", [])}
    for content, tok in added.items():
        vocab[content] = tok["id"]
    n = max(vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [5] * n
    for text, idx in vocab.items():
        tokens[idx] = text
        tok = added.get(text)
        types[idx] = 1 if tok is None else (3 if tok.get("special") else 4)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "token_type": types, "merges": merges}
