"""What a user calls on their own data: chat templates, ShareGPT conversion, response-only labels,
length profile, masking check, padding-free packing, vision collation; and ``load_bundled`` for the bundled datasets.

Everything is imported on first use, so ``import notebookkit.data`` stays light::

    from notebookkit.data import get_chat_template, standardize_sharegpt, train_on_responses_only

The tiny models and the bundled datasets themselves (the embedded default) are a package of their
own, :mod:`notebookkit.embedded`; ``load_bundled`` and ``dataset_path`` are re-exported here
because notebooks read the bundled datasets as they read their own.
"""

from __future__ import annotations

from notebookkit._lazy import lazy_exports

_LAZY = {
    "get_chat_template": "chat_templates",
    "list_chat_templates": "chat_templates",
    "apply_generation_eos": "chat_templates",
    "guess_chat_template": "chat_templates",
    "template_spec": "chat_templates",
    "CHAT_TEMPLATES": "chat_templates",
    "standardize_sharegpt": "sharegpt",
    "standardize_data_formats": "sharegpt",
    "to_role_content": "sharegpt",
    "alpaca_to_messages": "sharegpt",
    "train_on_responses_only": "responses_only",
    "detect_markers": "responses_only",
    "MarkerNotFoundError": "responses_only",
    "profile_lengths": "profile",
    "LengthProfile": "profile",
    "round_up_length": "profile",
    "check_masking": "masking",
    "MaskingReport": "masking",
    "PaddingFreeCollator": "packing",
    "pack_examples": "packing",
    "packing_stats": "packing",
    "VisionDataCollator": "vision_collator",
    "VisionRowError": "vision_collator",
    "load_bundled": "bundled",
    "dataset_path": "bundled",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
__all__ = list(_LAZY)
