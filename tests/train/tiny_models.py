"""The tiny default with LoRA adapters, as the trainer tests load it (fp32 on CPU, r=4)."""

from __future__ import annotations

from notebookkit.models import FastLanguageModel


def tiny_model(adapters: bool = True, max_seq_length: int = 64, dtype=None):
    """``(model, tokenizer)``: ``notebookkit/tiny-llama``, with r=4 LoRA adapters unless ``adapters=False``
    (``dtype``: as ``from_pretrained``'s; None is fp32 on a CPU)."""
    model, tok = FastLanguageModel.from_pretrained(
        "notebookkit/tiny-llama", max_seq_length=max_seq_length, load_in_4bit=False, dtype=dtype, show_banner=False
    )
    if adapters:
        model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, show_banner=False)
    return model, tok
