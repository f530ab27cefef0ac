"""Every ``_notebookkit_*`` mark is named once, in :mod:`notebookkit.marks`, and each name has a user.

A mark spelled as a string anywhere else in the package fails here: the next engineer would not find it
in the list, and a rename in one place would silently miss the other.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from notebookkit import marks

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "notebookkit"
MARK = re.compile(r"^_{1,2}notebookkit_\w+$")
NAMES = {name: value for name, value in vars(marks).items() if name.isupper() and isinstance(value, str)}


def spelled_marks(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every string constant in ``source`` that is a mark's attribute name."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and MARK.match(node.value)]


def test_every_mark_is_spelled_only_in_the_marks_module():
    found = {str(path.relative_to(ROOT)): hits for path in PACKAGE.rglob("*.py")
             if path != PACKAGE / "marks.py" and (hits := spelled_marks(path.read_text()))}
    assert found == {}


def test_a_planted_mark_is_found():
    planted = 'object.__setattr__(module, "_notebookkit_new_mark", True)\n'
    assert spelled_marks(planted) == [(1, "_notebookkit_new_mark")]


def test_every_name_is_a_mark_and_unique():
    assert NAMES and all(MARK.match(value) for value in NAMES.values())
    assert len(set(NAMES.values())) == len(NAMES)


def test_every_mark_has_a_user():
    imported: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "notebookkit.marks":
                imported |= {alias.name for alias in node.names}
    assert set(NAMES) - imported == set()


def test_marks_import_nothing():
    code = "import sys, notebookkit.marks; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
