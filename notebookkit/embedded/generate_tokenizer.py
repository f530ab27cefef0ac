"""Byte-level BPE tokenizer trained on the bundled corpus, and the per-family tokenizer folders.

Training (the ``tokenizers`` library's BPE trainer):

* text is split by the GPT-2 byte-level regex (words, numbers, punctuation, whitespace runs) and
  every byte is mapped to one of 256 printable stand-in characters, so any UTF-8 string, emoji
  included, encodes without ``<unk>`` and decodes back to the same bytes;
* starting from the 256 byte symbols, the trainer repeatedly merges the most frequent adjacent
  pair of symbols in the corpus into a new symbol until the vocabulary has ``vocab_size`` entries
  (special tokens + 256 bytes + merges).

One vocabulary serves every family (so their embedding matrices have the same shape); the
families differ only in which special tokens play bos/eos/pad, whether a bos is prepended, the
chat template, and, for Qwen, the split rule (Qwen's regex with single digits, plus NFC
normalisation, which transformers 5 imposes on ``qwen2`` folders anyway). A family's row in
:mod:`notebookkit.families` names its token set (``Family.tokens``, a key of :data:`TOKEN_SETS`).
Every special token a template uses is in the vocabulary as a single id:

=========  =====================  ======================  =======================  ============
family     bos                    eos (tokenizer)         pad                      template
=========  =====================  ======================  =======================  ============
llama      <|begin_of_text|>      <|eot_id|>              <|finetune_right_pad_id|> llama-3 headers
mistral    <s>                    </s>                    <pad>                    [INST] ... [/INST]
qwen2/3    (none)                 <|im_end|>              <|endoftext|>            ChatML
gemma 1-3  <bos>                  <eos>                   <pad>                    <start_of_turn>
=========  =====================  ======================  =======================  ============

The folders load with ``transformers.AutoTokenizer.from_pretrained(folder)`` as a fast tokenizer
(``tokenizer_class`` is ``PreTrainedTokenizerFast``, so no family-specific class rewrites the
byte-level pipeline).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from notebookkit.families import FAMILIES, family as family_record

VOCAB_SIZE = 2048
MODEL_MAX_LENGTH = 2048

#: Special tokens, in id order (ids 0..len-1). Kept stable: models index embeddings by these ids.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>", "<eos>", "<bos>", "<unk>", "<s>", "</s>", "<|endoftext|>", "<|im_start|>",
    "<|im_end|>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eot_id|>", "<|finetune_right_pad_id|>", "<start_of_turn>",
    "<end_of_turn>", "[INST]", "[/INST]", "<think>", "</think>",
    # markers of other common templates (Phi-3 / Phi-4), so any template in get_chat_template
    # renders its markers as single tokens on the tiny models too
    "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|im_sep|>",
)
#: Added tokens that stay visible in ``decode(skip_special_tokens=True)`` (as in Qwen3).
NON_SPECIAL_ADDED: frozenset[str] = frozenset({"<think>", "</think>"})

@dataclass(frozen=True)
class FamilyTokens:
    """Which special tokens a family uses (its chat template is on the family row).

    ``bos`` is ``None`` for families without a begin-of-sequence token (Qwen);
    ``add_bos`` says whether ``tokenizer(text)`` prepends it; ``stop`` lists every token that
    ends generation (written to ``generation_config.json``); ``config_bos`` is the id the model
    config records as bos (Qwen records ``<|endoftext|>`` although its tokenizer has no bos);
    ``config_eos_is_stop_list``: the model config records every stop id as eos (Llama 3.x), not
    only the tokenizer's eos; ``qwen_split``: Qwen's pre-tokenizer (single digits) and NFC.
    """

    bos: str | None
    eos: str
    pad: str
    unk: str | None
    add_bos: bool
    stop: tuple[str, ...]
    config_bos: str
    response_marker: str = field(default="")
    config_eos_is_stop_list: bool = False
    qwen_split: bool = False


#: The special-token sets, by the name a family row gives in ``Family.tokens``.
TOKEN_SETS: dict[str, FamilyTokens] = {
    "llama": FamilyTokens("<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>", None, True,
                          ("<|end_of_text|>", "<|eot_id|>"), "<|begin_of_text|>",
                          "<|start_header_id|>assistant<|end_header_id|>\n\n", config_eos_is_stop_list=True),
    "mistral": FamilyTokens("<s>", "</s>", "<pad>", "<unk>", True, ("</s>",), "<s>", " [/INST]"),
    "qwen2": FamilyTokens(None, "<|im_end|>", "<|endoftext|>", None, False, ("<|im_end|>", "<|endoftext|>"),
                          "<|endoftext|>", "<|im_start|>assistant\n", qwen_split=True),
    "qwen3": FamilyTokens(None, "<|im_end|>", "<|endoftext|>", None, False, ("<|im_end|>", "<|endoftext|>"),
                          "<|endoftext|>", "<|im_start|>assistant\n", qwen_split=True),
    "gemma": FamilyTokens("<bos>", "<eos>", "<pad>", "<unk>", True, ("<eos>", "<end_of_turn>"), "<bos>",
                          "<start_of_turn>model\n"),
}
#: The token set of each family of the record (Gemma 1-3 share one).
FAMILY_TOKENS: dict[str, FamilyTokens] = {f.name: TOKEN_SETS[f.tokens] for f in FAMILIES.values()}


def family_tokens(family: str) -> FamilyTokens:
    """The :class:`FamilyTokens` of ``family`` (``"llama"``, ``"mistral"``, ``"qwen2"``, ...)."""
    try:
        return FAMILY_TOKENS[family]
    except KeyError:
        raise ValueError(f"No tokenizer set-up for family {family!r}; known: {sorted(FAMILY_TOKENS)}") from None


def train_base_tokenizer(docs: list[str], vocab_size: int = VOCAB_SIZE):
    """Train the shared byte-level BPE on ``docs``; returns a ``tokenizers.Tokenizer``.

    The result has no post-processor (no bos); :func:`write_tokenizer_folder` adds the family's.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    # Qwen3 shows <think> in decoded text: mark those added tokens as non-special.
    spec = json.loads(tok.to_str())
    for entry in spec["added_tokens"]:
        if entry["content"] in NON_SPECIAL_ADDED:
            entry["special"] = False
    return Tokenizer.from_str(json.dumps(spec))


#: Qwen's split rule (letters runs, single digits, punctuation runs, newlines, spaces), as its
#: tokenizer class hard-codes it: transformers 5 rebuilds a ``qwen2`` tokenizer with this rule and
#: NFC normalisation whatever ``tokenizer.json`` says, so the Qwen folders declare it themselves.
QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _family_pipeline(base, fam: FamilyTokens):
    """Copy of ``base`` with the family's pre-tokenizer and bos post-processor."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors

    tok = Tokenizer.from_str(base.to_str())
    if fam.qwen_split:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    steps = [processors.ByteLevel(trim_offsets=False)]
    if fam.add_bos and fam.bos is not None:
        bos_id = tok.token_to_id(fam.bos)
        steps.append(processors.TemplateProcessing(
            single=f"{fam.bos} $A", pair=f"{fam.bos} $A {fam.bos} $B:1",
            special_tokens=[(fam.bos, bos_id)],
        ))
    tok.post_processor = processors.Sequence(steps)
    return tok


def tokenizer_config(family: str, base) -> dict:
    """The ``tokenizer_config.json`` contents for ``family`` (special tokens, template, length)."""
    fam = family_tokens(family)
    spec = json.loads(base.to_str())
    added = {
        str(e["id"]): {"content": e["content"], "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False, "special": e["special"]}
        for e in spec["added_tokens"]
    }
    return {
        "add_bos_token": bool(fam.add_bos and fam.bos),
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": fam.bos,
        "chat_template": family_record(family).tokenizer_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": fam.eos,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": fam.pad,
        "padding_side": "right",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": fam.unk,
    }


def write_tokenizer_folder(base, family: str, folder: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    fam = family_tokens(family)
    folder.mkdir(parents=True, exist_ok=True)
    tok = _family_pipeline(base, fam)
    (folder / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    _write_json(folder / "tokenizer_config.json", tokenizer_config(family, base))
    special_map = {k: v for k, v in (("bos_token", fam.bos), ("eos_token", fam.eos),
                                      ("pad_token", fam.pad), ("unk_token", fam.unk)) if v is not None}
    _write_json(folder / "special_tokens_map.json", special_map)


def special_token_ids(base, family: str) -> dict[str, int | list[int] | None]:
    """Token ids for the model and generation configs of ``family``.

    ``eos_token_id`` (generation config) lists every stop token: the end-of-turn marker and the
    end-of-text token. ``config_eos_token_id`` is what the model's ``config.json`` records: the
    full stop list for llama's token set (as Llama 3.x does), the tokenizer's eos for the others.
    """
    fam = family_tokens(family)
    tid = base.token_to_id
    stop = [tid(t) for t in fam.stop]
    stop_value: int | list[int] = stop[0] if len(stop) == 1 else stop
    return {
        "bos_token_id": tid(fam.config_bos),
        "eos_token_id": stop_value,
        "pad_token_id": tid(fam.pad),
        "config_eos_token_id": stop_value if fam.config_eos_is_stop_list else tid(fam.eos),
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
