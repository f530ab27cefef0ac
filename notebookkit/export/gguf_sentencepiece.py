"""A SentencePiece-style tokenizer (Llama 2, Mistral v0.1-v0.3, Gemma) as GGUF metadata for llama.cpp.

Such a tokenizer, as ``transformers`` runs it (``tokenizer.json``), is a BPE over Unicode characters
with ``byte_fallback``: spaces become ``"▁"`` (U+2581), a character outside the vocabulary becomes
its UTF-8 bytes as the tokens ``<0x00>`` ... ``<0xFF>``, and the merges were generated from the
SentencePiece model's piece scores (every split ``(l, r)`` of a piece with both halves in the
vocabulary, sorted by the piece's score).

llama.cpp's ``llama`` tokenizer (``tokenizer.ggml.model = "llama"``, SPM) rebuilds it from the token
list alone: it replaces spaces by ``"▁"``, starts from single characters and repeatedly merges the
adjacent pair whose concatenation is a token with the highest *score* (ties: the leftmost), then
writes characters that formed no token as byte tokens. So the scores must order merges as the
Hugging Face merges do: a token made by merge number ``k`` (the first merge that yields it) gets
score ``-k``; tokens no merge yields (single characters, bytes, special and added tokens) get 0,
or -1000 for added ones, as llama.cpp's converter writes them. Where some pair of vocabulary tokens
concatenates to a token without being a merge (a vocabulary not generated from scores), llama.cpp
can merge where Hugging Face does not: :func:`sentencepiece_metadata` counts such pairs and warns.

Token types: 1 normal, 2 unknown, 3 control (special added tokens, BOS/EOS), 4 user-defined (other
added tokens, their ``"▁"`` written as spaces: llama.cpp matches them in the raw text), 5 unused
(ids up to the model's vocabulary size that the tokenizer lacks), 6 byte (``<0xNN>``).

The leading ``"▁"`` (``tokenizer.ggml.add_space_prefix``): llama.cpp puts a space before the text at
the start and after every special token. Hugging Face spells the same rule three ways:

* legacy Llama / Mistral: normalizer ``Prepend("▁")`` + ``Replace(" ", "▁")`` on every text segment
  (between added tokens): exactly llama.cpp's rule, ``add_space_prefix = true``;
* Gemma: ``Replace(" ", "▁")`` alone: ``false``;
* ``Metaspace(prepend_scheme=...)`` pre-tokenizer (non-legacy): ``"never"`` is ``false``; ``"first"``
  prepends only to text at the very start of the input, never after a special token, so ``false``
  matches it wherever the text begins with a special token (every chat prompt: BOS, ``[INST]``) and
  differs by one leading ``"▁"`` for plain text with no special token before it; ``"always"``
  prepends unless the segment already starts with a space: ``true``, which differs after a special
  token followed by a space.
"""

from __future__ import annotations

import json
import re
import warnings
from typing import Any

from .checks import ExportError

__all__ = ["is_sentencepiece_style", "sentencepiece_metadata", "space_prefix_rule", "merge_scores"]

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def is_sentencepiece_style(spec: dict) -> bool:
    """A ``tokenizer.json`` whose model is a BPE with byte fallback (SentencePiece converted to tokenizers)."""
    model = spec.get("model", {})
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def _is_replace_space(step: dict | None) -> bool:
    return bool(step) and step.get("type") == "Replace" and step.get("pattern", {}).get("String") == " " and step.get("content") == SPACE


def space_prefix_rule(spec: dict) -> bool:
    """``add_space_prefix`` for this tokenizer.json (module docstring); raises for a layout llama.cpp cannot mirror."""
    normalizer, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    steps = normalizer.get("normalizers", []) if normalizer and normalizer.get("type") == "Sequence" else ([normalizer] if normalizer else [])
    pre_is_noop = pre is None or (pre.get("type") == "Split" and pre.get("pattern", {}).get("String") == " ")  # Gemma: no spaces left
    if pre_is_noop and len(steps) == 2 and steps[0].get("type") == "Prepend" and steps[0].get("prepend") == SPACE and _is_replace_space(steps[1]):
        return True
    if pre_is_noop and len(steps) == 1 and _is_replace_space(steps[0]):
        return False
    if not steps and pre and pre.get("type") == "Metaspace" and pre.get("replacement") == SPACE and not pre.get("split", True):
        scheme = pre.get("prepend_scheme", "always")
        return {"always": True, "first": False, "never": False}[scheme]
    raise ExportError(
        "GGUF export writes SentencePiece-style tokenizers whose spaces are handled as Llama 2 / Mistral / Gemma do "
        "(normalizer Prepend('▁') + Replace(' ', '▁'), Replace(' ', '▁') alone, or a Metaspace pre-tokenizer with "
        f"split=False); this one has normalizer {json.dumps(normalizer)[:160]} and pre_tokenizer {json.dumps(pre)[:160]}. "
        "Save with save_pretrained_merged and convert the folder with llama.cpp's convert_hf_to_gguf.py."
    )


def merge_scores(vocab: dict[str, int], merges: list[str]) -> tuple[dict[str, float], int]:
    """Score of each token made by a merge (``-k`` for the first merge ``k`` that yields it), and the
    number of vocabulary pairs ``(l, r)`` whose concatenation is a token but which are not merges."""
    scores: dict[str, float] = {}
    pairs = set()
    for k, merge in enumerate(merges):
        left, right = merge.split(" ", 1)
        pairs.add((left, right))
        scores.setdefault(left + right, float(-k))
    missing = 0
    for token in vocab:
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab and (left, right) not in pairs:
                missing += 1
    return scores, missing


def sentencepiece_metadata(spec: dict, vocab_size: int) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` fields of a SentencePiece-style tokenizer (``model = "llama"``)."""
    model = spec["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t for t in spec.get("added_tokens", [])}
    for content, tok in added.items():
        vocab[content] = tok["id"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    scores_by_token, missing = merge_scores(dict(model["vocab"]), merges)  # added tokens are matched whole, first
    if missing:
        warnings.warn(
            f"{missing} pairs of vocabulary tokens join into a token without being one of the tokenizer's merges. "
            "llama.cpp's SentencePiece tokenizer merges any such pair, so its tokens can differ from Hugging Face's "
            "on some words (the GGUF check reports whether the prompts tokenize alike).",
            UserWarning, stacklevel=3,
        )
    unk = model.get("unk_token")
    n = max(vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [UNUSED] * n
    scores = [-1000.0] * n
    for text, idx in vocab.items():
        tok = added.get(text)
        if text == unk:
            kind, score = UNKNOWN, 0.0
        elif tok is not None:
            kind, score = (CONTROL, 0.0) if tok.get("special") else (USER_DEFINED, -1000.0)
            if kind == USER_DEFINED:
                text = text.replace(SPACE, " ")
        elif _BYTE_TOKEN.fullmatch(text):
            kind, score = BYTE, 0.0
        else:
            kind, score = NORMAL, scores_by_token.get(text, 0.0)
        tokens[idx], types[idx], scores[idx] = text, kind, score
    if "<0x0A>" not in vocab:
        raise ExportError("This SentencePiece-style tokenizer has no byte tokens (<0x0A> for a newline); llama.cpp needs them.")
    return {"model": "llama", "pre": "default", "tokens": tokens, "token_type": types, "scores": scores,
            "add_space_prefix": space_prefix_rule(spec)}
