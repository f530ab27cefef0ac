"""The export methods a model from ``FastLanguageModel`` carries (``model.save_pretrained_merged`` ...).

They are bound on the instance (never on a class, so plain Hugging Face models are untouched), by
``notebookkit.models`` at the end of ``from_pretrained`` and ``get_peft_model``. A PEFT wrapper gets
its own binding, so ``self`` is the object the user holds: the ``PeftModel`` (adapter saving needs
it) or the plain model (full fine-tuning, or no LoRA yet).
"""

from __future__ import annotations

import torch.nn as nn

from notebookkit.models.patching import WeakBoundMethod

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
    """Attach the export methods to this model instance; returns it.

    Bound through a weak reference (:class:`notebookkit.models.patching.WeakBoundMethod`): a plain bound
    method in the model's own ``__dict__`` would be a reference cycle, and ``del model`` would leave its
    weights allocated until Python's cycle collector ran (tests/memory/test_model_release.py)."""
    for name, function in _methods().items():
        object.__setattr__(model, name, WeakBoundMethod(function, model))
    return model
