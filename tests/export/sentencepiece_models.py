"""Tiny SentencePiece-style tokenizers and random-weight models with them, built offline for the GGUF tests.

A SentencePiece BPE model is a list of pieces with scores; transformers runs it as a ``tokenizer.json``
BPE with byte fallback whose merges are every split ``(l, r)`` of a piece with both halves in the
vocabulary, sorted by the piece's score (``generate_merges`` in transformers' tokenizer conversion).
These tokenizers are made the same way: pieces learnt on the bundled corpus by the ``tokenizers`` BPE
trainer over ``"▁"``-prefixed words (SentencePiece splits at whitespace), scored by their order, the
256 byte tokens ``<0x00>`` ... ``<0xFF>`` in the vocabulary, a small alphabet so that rarer characters
fall back to bytes, and the space handling of three real layouts:

* ``llama2``: legacy Llama 2 / Mistral v0.1 (normalizer ``Prepend("▁")`` + ``Replace``), Llama-2 chat
  template with plain-text ``[INST]``;
* ``mistral``: Mistral v0.3 (``Metaspace(prepend_scheme="first", split=False)``), ``[INST]`` /
  ``[/INST]`` control tokens;
* ``gemma``: Gemma (``Replace(" ", "▁")`` only, no leading space), ``<start_of_turn>`` template.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPACE = "\u2581"
N_PIECES = 700
ALPHABET = 70

LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + '[/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
)

VARIANTS = {
    # specials at ids 0.., then bytes, then pieces; extra control tokens at the end
    "llama2": dict(family="llama", specials=["<unk>", "<s>", "</s>"], bos="<s>", eos="</s>", unk="<unk>", pad=None,
                   extra=[], template=LLAMA2_TEMPLATE),
    "mistral": dict(family="mistral", specials=["<unk>", "<s>", "</s>"], bos="<s>", eos="</s>", unk="<unk>", pad=None,
                    extra=["[INST]", "[/INST]"], template=MISTRAL_TEMPLATE),
    "gemma": dict(family="gemma", specials=["<pad>", "<eos>", "<bos>", "<unk>"], bos="<bos>", eos="<eos>", unk="<unk>",
                  pad="<pad>", extra=["<start_of_turn>", "<end_of_turn>"], template=None),
}


def _trained_pieces(texts: list[str]) -> list[str]:
    """Pieces in the order the trainer made them (alphabet first, then merges)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(vocab_size=N_PIECES, limit_alphabet=ALPHABET, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    vocab = tok.get_vocab()
    return sorted(vocab, key=vocab.get)


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a scored piece into two vocabulary tokens, best score first (then longer left part)."""
    merges = []
    for piece, score in scores.items():
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                merges.append((score, len(left), len(right), left, right))
    merges.sort(key=lambda m: m[:3], reverse=True)
    return [(m[3], m[4]) for m in merges]


def build_tokenizer(variant: str, texts: list[str]):
    """The fast tokenizer of ``variant`` (a ``PreTrainedTokenizerFast``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    spec = VARIANTS[variant]
    vocab: dict[str, int] = {}
    for token in spec["specials"] + [f"<0x{b:02X}>" for b in range(256)]:
        vocab[token] = len(vocab)
    scores: dict[str, float] = {}
    for rank, piece in enumerate(_trained_pieces(texts)):
        if piece not in vocab:
            vocab[piece] = len(vocab)
            scores[piece] = -float(rank)
    merges = _merges_from_scores(vocab, {p: s for p, s in scores.items() if len(p) > 1})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=spec["unk"], fuse_unk=True, byte_fallback=True))
    if variant == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    elif variant == "mistral":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    else:
        tok.normalizer = normalizers.Replace(" ", SPACE)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if variant != "gemma":
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["specials"] + spec["extra"]])
    bos = spec["bos"]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, vocab[bos])])
    template = spec["template"]
    if template is None:
        from notebookkit.tokenizer_templates import GEMMA as template
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=spec["eos"], unk_token=spec["unk"],
                                   pad_token=spec["pad"] or spec["unk"])
    fast.chat_template = template
    return fast


def build_model_folder(variant: str, folder: Path, seed: int = 0) -> Path:
    """A random-weight tiny model of the variant's family with its SentencePiece-style tokenizer."""
    from transformers import AutoModelForCausalLM

    from notebookkit.embedded.generate_models import family_config
    from notebookkit.embedded.tiny import load_corpus

    if (folder / "config.json").exists():
        return folder
    tokenizer = build_tokenizer(variant, load_corpus("train")[:3000])
    ids = dict(bos_token_id=tokenizer.bos_token_id, config_eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = family_config(VARIANTS[variant]["family"], len(tokenizer), ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
