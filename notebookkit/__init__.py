"""notebookkit: fast, memory-lean LoRA/QLoRA fine-tuning of open LLMs in Jupyter.

Import what you need; heavy modules load on first use::

    from notebookkit import FastLanguageModel
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "FastLanguageModel": ("notebookkit.models", "FastLanguageModel"),
    "get_chat_template": ("notebookkit.data", "get_chat_template"),
    "standardize_sharegpt": ("notebookkit.data", "standardize_sharegpt"),
    "train_on_responses_only": ("notebookkit.data", "train_on_responses_only"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'notebookkit' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
