"""The export methods a model from ``FastLanguageModel`` carries (``model.save_pretrained_merged`` ...).

They are the ``writer`` and ``hub`` methods the rows of :mod:`notebookkit.export_forms` name, found by
name in :mod:`notebookkit.export`. They are bound on the instance (never on a class, so plain Hugging
Face models are untouched), by ``notebookkit.models`` at the end of ``from_pretrained`` and
``get_peft_model``. A PEFT wrapper gets its own binding, so ``self`` is the object the user holds: the
``PeftModel`` (adapter saving needs it) or the plain model (full fine-tuning, or no LoRA yet).
"""

from __future__ import annotations

import importlib

import torch.nn as nn

from notebookkit.export_forms import EXPORT_FORMS
from notebookkit.base_layers.rebinding import WeakBoundMethod

__all__ = ["EXPORT_METHODS", "bind_export_methods"]

#: writers first, then the uploads, each once, in the order of the forms
EXPORT_METHODS = tuple(dict.fromkeys([f.writer for f in EXPORT_FORMS.values()] + [f.hub for f in EXPORT_FORMS.values()]))


def _methods() -> dict:
    package = importlib.import_module(__package__)  # notebookkit.export: its lazy names
    return {name: getattr(package, name) for name in EXPORT_METHODS}


def bind_export_methods(model: nn.Module) -> nn.Module:
    """Attach the export methods to this model instance; returns it.

    Bound through a weak reference (:class:`notebookkit.base_layers.rebinding.WeakBoundMethod`): a plain bound
    method in the model's own ``__dict__`` would be a reference cycle, and ``del model`` would leave its
    weights allocated until Python's cycle collector ran (tests/memory/test_model_release.py)."""
    for name, function in _methods().items():
        object.__setattr__(model, name, WeakBoundMethod(function, model))
    return model
