"""``python -m notebookkit.embedded``: see :mod:`notebookkit.embedded.cli`."""

from notebookkit.embedded.cli import main

raise SystemExit(main())
