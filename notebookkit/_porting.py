"""Names that the most used notebook API exports and notebookkit does not, each with what to do instead.

Importing one (``from notebookkit import FastSentenceTransformer``) raises :class:`NotProvidedError` with
that text, so a ported notebook stops at the line to change and says why, rather than with a bare
``cannot import name``. Nothing here stands in for the missing name: where notebookkit has no
equivalent, it says so. The README's "Porting a notebook" table lists every name of that API.
"""

from __future__ import annotations

__all__ = ["NotProvidedError", "TOP_LEVEL", "CHAT_TEMPLATES_MODULE", "not_provided"]


class NotProvidedError(ImportError):
    """A name of another notebook API that notebookkit does not provide; the message says what to use."""


#: names imported as ``from <package> import NAME``
TOP_LEVEL: dict[str, str] = {
    "FastModel": (
        "for a text model use FastLanguageModel (the same from_pretrained and for_inference; its get_peft_model "
        "takes target_modules= instead of the finetune_*_layers switches); for a Qwen2.5-VL or Gemma 3 vision "
        "model use FastVisionModel (the same finetune_* switches); audio models are not part of notebookkit."
    ),
    "UnslothVisionDataCollator": (
        "use notebookkit.data.VisionDataCollator(model, processor): messages + images rows, labels on the "
        "assistant's answers only."
    ),
    "PatchFastRL": (
        "there is nothing to patch: TRL's GRPOTrainer runs on the model FastLanguageModel returns, so delete this "
        "line. For notebookkit's fused GRPO loss (per-token log-probs from the chunked LM head) use "
        "notebookkit.train.FastGRPOTrainer."
    ),
    "PatchDPOTrainer": (
        "there is nothing to patch: TRL's DPOTrainer runs on the model FastLanguageModel returns, so delete this "
        "line. For notebookkit's fused DPO / ORPO losses use notebookkit.train.FastDPOTrainer / FastORPOTrainer."
    ),
    "UnslothTrainer": (
        "use TRL's SFTTrainer (or notebookkit.train.FastSFTTrainer); a separate learning rate for the embeddings "
        "(embedding_learning_rate) is not provided."
    ),
    "UnslothTrainingArguments": (
        "use TRL's SFTConfig; a separate learning rate for the embeddings (embedding_learning_rate) is not provided."
    ),
    "FastSentenceTransformer": "embedding models are not part of notebookkit.",
}

#: names imported as ``from <package>.chat_templates import NAME``
CHAT_TEMPLATES_MODULE: dict[str, str] = {
    "to_sharegpt": (
        "merging columns into one conversation is not provided: map the rows to 'messages' yourself, e.g. "
        "dataset.map(alpaca_to_messages) for instruction/input/output rows (from notebookkit.data)."
    ),
    "apply_chat_template": (
        "the data-set helper is not provided: let SFTTrainer render a 'messages' column with the tokenizer's "
        "chat template, or write the text yourself with tokenizer.apply_chat_template(turns, tokenize=False)."
    ),
}


def not_provided(module: str, name: str, table: dict[str, str]) -> NotProvidedError:
    """The error for ``from module import name``."""
    return NotProvidedError(f"{module} has no {name}: {table[name]}", name=name, path=None)
