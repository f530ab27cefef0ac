"""The chat helpers under the module path ported notebooks import them from::

    from notebookkit.chat_templates import get_chat_template, train_on_responses_only
    from notebookkit.chat_templates import standardize_sharegpt, standardize_data_formats

They live in :mod:`notebookkit.data` (``chat_templates``, ``responses_only``, ``sharegpt``); this
module only names them again. A helper of other notebooks' ``chat_templates`` module that
notebookkit does not provide raises an ``ImportError`` saying what to use instead.
"""

from __future__ import annotations

from notebookkit._porting import CHAT_TEMPLATES_MODULE, not_provided
from notebookkit.data.chat_templates import get_chat_template, list_chat_templates
from notebookkit.data.responses_only import train_on_responses_only
from notebookkit.data.sharegpt import standardize_data_formats, standardize_sharegpt

__all__ = [
    "get_chat_template",
    "list_chat_templates",
    "train_on_responses_only",
    "standardize_sharegpt",
    "standardize_data_formats",
]


def __getattr__(name: str):
    if name in CHAT_TEMPLATES_MODULE:
        raise not_provided(__name__, name, CHAT_TEMPLATES_MODULE)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
