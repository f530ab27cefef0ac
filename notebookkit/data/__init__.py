"""What a user calls on their own data: chat templates, ShareGPT conversion, response-only labels,
length profile, masking check, padding-free packing, vision collation; and ``load_bundled`` for the bundled datasets.

Everything is imported on first use, so ``import notebookkit.data`` stays light::

    from notebookkit.data import get_chat_template, standardize_sharegpt, train_on_responses_only

The tiny models and the bundled datasets themselves (the embedded default) are a package of their
own, :mod:`notebookkit.embedded`; ``load_bundled`` and ``dataset_path`` are re-exported here
because notebooks read the bundled datasets as they read their own.
"""

from __future__ import annotations

from notebookkit._lazy import lazy_package

__getattr__, __dir__, __all__ = lazy_package(__name__, {
    "chat_templates": ("get_chat_template", "list_chat_templates", "apply_generation_eos",
                       "guess_chat_template", "install_chat_template", "template_spec", "CHAT_TEMPLATES"),
    "sharegpt": ("standardize_sharegpt", "standardize_data_formats", "to_role_content", "alpaca_to_messages"),
    "responses_only": ("train_on_responses_only", "detect_markers", "MarkerNotFoundError"),
    "profile": ("profile_lengths", "LengthProfile", "round_up_length"),
    "masking": ("check_masking", "MaskingReport"),
    "packing": ("PaddingFreeCollator", "pack_examples", "packing_stats"),
    "vision_collator": ("VisionDataCollator", "VisionRowError"),
    "bundled": ("load_bundled", "dataset_path"),
})
