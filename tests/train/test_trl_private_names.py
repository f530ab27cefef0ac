"""No private name of TRL (or of the transformers Trainer under it) is used in ``notebookkit/train`` outside
:mod:`notebookkit.train.trl_compat`: neither read or written (``self._metrics``, ``trainer._step``,
``super()._hook(...)``) nor overridden (``def _generate_single_turn``).

A TRL private name is one that TRL's trainer classes (every class above notebookkit's trainers in their
MRO, read from the training-method record) define or use as ``self._name`` in their source. A notebookkit
method of its own on a TRL subclass (``_loss``, ``_clock``) is not one, and fails here the day TRL starts
using the same name (an accidental override).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import cache
from pathlib import Path

import pytest

pytest.importorskip("trl")

from notebookkit.training_methods import TRAINING_METHODS  # noqa: E402

TRAIN = Path(__file__).resolve().parents[2] / "notebookkit" / "train"
COMPAT = TRAIN / "trl_compat.py"
FOREIGN = ("trl", "transformers")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@cache
def trl_private_names() -> frozenset[str]:
    """The private names of the TRL / transformers classes notebookkit's trainers subclass."""
    import notebookkit.train as train

    names: set[str] = set()
    for method in TRAINING_METHODS.values():
        for base in getattr(train, method.trainer).__mro__:
            if base.__module__.split(".")[0] not in FOREIGN:
                continue
            names |= {n for n in vars(base) if _private(n)}
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
            names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and _private(node.attr)
                      and isinstance(node.value, ast.Name) and node.value.id == "self"}
    return frozenset(names)


def private_uses(source: str, private: frozenset[str]) -> list[tuple[int, str]]:
    """``(line, what)`` for each access to or method definition of a name in ``private``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in private:
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.ClassDef):
            found += [(f.lineno, f"def {f.name}") for f in node.body
                      if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name in private]
    return found


def test_the_scan_knows_trl_s_private_names():
    names = trl_private_names()
    assert {"_metrics", "_step", "_generate_single_turn", "_get_per_token_logps_and_entropies"} <= names


def test_no_private_trl_name_outside_trl_compat():
    private = trl_private_names()
    found = {path.name: hits for path in sorted(TRAIN.rglob("*.py"))
             if path != COMPAT and (hits := private_uses(path.read_text(), private))}
    assert found == {}


def test_a_planted_override_and_read_are_found():
    planted = textwrap.dedent("""
        class FastGRPOTrainer(GRPOTrainer):
            def _generate_single_turn(self, prompts):
                return self._metrics["train"]
    """)
    assert private_uses(planted, trl_private_names()) == [(3, "def _generate_single_turn"), (4, "._metrics")]


def test_the_compat_module_holds_them():
    assert private_uses(COMPAT.read_text(), trl_private_names())
