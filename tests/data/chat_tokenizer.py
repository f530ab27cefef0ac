"""A small byte-level BPE tokenizer for data-helper tests (built in well under a second, offline),
and ``CONVO``, the sample conversation those tests render.

It knows the special tokens of every chat format in notebookkit.data.chat_templates, so each format
can be rendered and tokenised without downloading anything.
"""

from __future__ import annotations

import functools

from notebookkit.data.chat_templates import CHAT_TEMPLATES

CORPUS = [
    "What is the capital of France? The capital of France is Paris.",
    "Add two and three. Two plus three is five.",
    "### Instruction:\nName a colour.\n\n### Response:\nBlue.\n\n",
    "You are a helpful assistant. Answer briefly and politely, please.",
    "user assistant system model [INST] [/INST] hello world good morning",
] * 20

# A short conversation with a system turn and two user/assistant exchanges (tests must not change it).
CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus three?"},
    {"role": "assistant", "content": "Five."},
    {"role": "user", "content": "And the capital of France?"},
    {"role": "assistant", "content": "Paris."},
]


@functools.lru_cache(maxsize=None)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<pad>", "<s>", "</s>"]
    for spec in CHAT_TEMPLATES.values():
        specials += [t for t in spec.special_tokens if t not in specials]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str()


def make_tokenizer():
    """A fresh PreTrainedTokenizerFast (tests may change it in place)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
