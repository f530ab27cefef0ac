"""notebookkit: fast, memory-lean LoRA/QLoRA fine-tuning of open LLMs in Jupyter.

Import what you need; heavy modules load on first use::

    from notebookkit import FastLanguageModel
"""

from __future__ import annotations

from notebookkit._lazy import lazy_exports

__version__ = "0.1.0"

_LAZY = {
    "FastLanguageModel": "models",
    "get_chat_template": "data",
    "standardize_sharegpt": "data",
    "train_on_responses_only": "data",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
__all__ = ["__version__", *_LAZY]
