"""``load_bundled`` where notebooks import it from.

The bundled datasets are part of the embedded default and live in :mod:`notebookkit.embedded.bundled`;
this module re-exports what a notebook calls::

    from notebookkit.data.bundled import load_bundled
    chat = load_bundled("chat_messages")
"""

from __future__ import annotations

from notebookkit.embedded.bundled import KINDS, dataset_path, extract_answer, list_bundled, load_bundled

__all__ = ["KINDS", "dataset_path", "extract_answer", "list_bundled", "load_bundled"]
