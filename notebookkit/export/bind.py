"""The export methods a model from ``FastLanguageModel`` carries (``model.save_pretrained_merged`` ...).

They are bound on the instance (never on a class, so plain Hugging Face models are untouched), by
``notebookkit.models`` at the end of ``from_pretrained`` and ``get_peft_model``. A PEFT wrapper gets
its own binding, so ``self`` is the object the user holds: the ``PeftModel`` (adapter saving needs
it) or the plain model (full fine-tuning, or no LoRA yet).
"""

from __future__ import annotations

import types

import torch.nn as nn

__all__ = ["EXPORT_METHODS", "bind_export_methods"]


def _methods() -> dict:
    from .gguf_file import save_pretrained_gguf
    from .hub import push_to_hub_gguf, push_to_hub_merged
    from .merged import save_pretrained_merged

    return {
        "save_pretrained_merged": save_pretrained_merged,
        "save_pretrained_gguf": save_pretrained_gguf,
        "push_to_hub_merged": push_to_hub_merged,
        "push_to_hub_gguf": push_to_hub_gguf,
    }


EXPORT_METHODS = ("save_pretrained_merged", "save_pretrained_gguf", "push_to_hub_merged", "push_to_hub_gguf")


def bind_export_methods(model: nn.Module) -> nn.Module:
    """Attach the export methods to this model instance; returns it."""
    for name, function in _methods().items():
        object.__setattr__(model, name, types.MethodType(function, model))
    return model
