"""``python -m notebookkit.data.tiny``, the old command, still builds the embedded default.

The tiny models, their tokenizer and corpus, the bundled datasets and their cache live in
:mod:`notebookkit.embedded` now; the command is ``python -m notebookkit.embedded``.
"""

from __future__ import annotations

if __name__ == "__main__":
    from notebookkit.embedded.cli import main

    raise SystemExit(main())
