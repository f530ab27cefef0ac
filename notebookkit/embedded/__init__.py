"""The embedded default: tiny models of every supported family, their tokenizer and corpus, the
bundled datasets, and the cache they are built into; offline and deterministic.

Used by tests, demos and notebooks, never by the layers above for real work::

    from notebookkit.embedded import ensure_tiny_model, load_bundled
    folder = ensure_tiny_model("notebookkit/tiny-llama")   # what from_pretrained loads for that name
    chat = load_bundled("chat_messages")

``python -m notebookkit.embedded`` builds everything once and prints a table. The modules:

==============================  =================================================================
:mod:`.tiny`                    reserved names (``notebookkit/tiny-<family>``), corpus, tokenizer and
                                model folders, built on first use
:mod:`.bundled`                 the bundled datasets (JSONL read with ``datasets``)
:mod:`.cache`                   versioned cache folders built once under a file lock
:mod:`.cli`                     the command
:mod:`.corpus`                  the small world the corpus and datasets talk about, and its text
:mod:`.generate_tokenizer`      byte-level BPE training and the per-family tokenizer folders
:mod:`.generate_models`         the tiny config of each family (from :mod:`notebookkit.families`)
:mod:`.generate_vision_models`  the tiny vision-language models (``Family.vision``)
:mod:`.generate_pretrain`       the short pre-training of ``tiny-llama``
:mod:`.generate_datasets`       the rows of each bundled dataset
==============================  =================================================================
"""

from __future__ import annotations

from notebookkit._lazy import lazy_package

__getattr__, __dir__, __all__ = lazy_package(__name__, {
    "tiny": ("TINY_MODELS", "TINY_VISION_MODELS", "TINY_LOW_BIT_MODELS", "ensure_tiny_model",
             "resolve_model_name", "is_tiny_model_name", "tiny_model_info"),
    "bundled": ("load_bundled", "dataset_path", "list_bundled"),
    "cli": ("build_all",),
})
