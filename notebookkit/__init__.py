"""notebookkit: fast, memory-lean LoRA/QLoRA fine-tuning of open LLMs in Jupyter.

Import what you need; heavy modules load on first use::

    from notebookkit import FastLanguageModel, FastVisionModel, is_bfloat16_supported
    from notebookkit.chat_templates import get_chat_template, train_on_responses_only

The names match those of the most used fine-tuning notebooks, so that such a notebook ports by
changing its imports (README, "Porting a notebook"); a name of theirs notebookkit does not provide
raises an ``ImportError`` that says what to use instead.
"""

from __future__ import annotations

from notebookkit._lazy import lazy_exports
from notebookkit._porting import TOP_LEVEL

__version__ = "0.1.0"

_LAZY = {
    "FastLanguageModel": "models",
    "FastVisionModel": "models",
    "is_bfloat16_supported": "models.common.precision",
    "is_bf16_supported": "models.common.precision",
    "get_chat_template": "data",
    "standardize_sharegpt": "data",
    "standardize_data_formats": "data",
    "train_on_responses_only": "data",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, not_provided=TOP_LEVEL)
__all__ = ["__version__", *_LAZY]
