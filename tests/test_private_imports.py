"""No module of notebookkit reaches into another notebookkit module's private names.

A leading underscore says "this file's business": ``from .loader import _fix_tokenizer`` or
``loader._load_banner(...)`` in another file couples the two to a detail neither promises to keep, and
is usually a step that both need and that should be public in the file that owns it. The scan reads
every module's AST: ``from <notebookkit module> import _name`` and ``<imported notebookkit
module>._name``. Dunder names (``__version__``) are public. A use that must stay lists its reason in
``ALLOWED``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "notebookkit"

ALLOWED: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def private_uses(path: Path, modules: set[str]) -> list[tuple[str, str, int]]:
    """``(owner module, private name, line)`` for each private name of another notebookkit module used in ``path``."""
    module = _module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases: dict[str, str] = {}  # local name -> the notebookkit module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            owner = _absolute(module, path, node)
            for alias in node.names:
                if f"{owner}.{alias.name}" in modules:  # ``from . import loader``: a module
                    aliases[alias.asname or alias.name] = f"{owner}.{alias.name}"
                elif owner in modules and owner != module and _is_private(alias.name):
                    found.append((owner, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            value = node.value
            dotted = []
            while isinstance(value, ast.Attribute):
                dotted.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name):
                owner = aliases.get(value.id) or ".".join([value.id, *dotted])
                owner = ".".join([aliases[value.id], *dotted]) if value.id in aliases else owner
                if owner in modules and owner != module:
                    found.append((owner, node.attr, node.lineno))
    return found


def _violations() -> list[str]:
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for owner, name, line in private_uses(path, modules):
            if (module, f"{owner}:{name}") not in ALLOWED:
                out.append(f"{path.relative_to(ROOT)}:{line} uses {owner}.{name}")
    return out


def test_no_module_uses_another_modules_private_names():
    bad = _violations()
    assert not bad, "private names used across notebookkit modules (make them public where they are defined, " \
                    "or add a reason to ALLOWED):\n" + "\n".join(bad)


def test_every_allowance_is_still_needed():
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    used = {(_module_name(p), f"{o}:{n}") for p in PACKAGE.rglob("*.py") for o, n, _ in private_uses(p, modules)}
    assert not set(ALLOWED) - used, f"allowances no longer needed: {sorted(set(ALLOWED) - used)}"


def test_a_planted_private_import_is_found(tmp_path):
    modules = {"notebookkit.models.loader", "notebookkit.models.vision_loader", "notebookkit.models"}
    planted = tmp_path / "notebookkit" / "models" / "vision_loader.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("from .loader import _fix_tokenizer, pick_dtype\nfrom . import loader as ld\n"
                       "ld._load_banner({})\nld.resolve('x')\nx.__version__\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        uses = private_uses(planted, modules)
    finally:
        ROOT = saved
    assert sorted((o, n) for o, n, _ in uses) == [("notebookkit.models.loader", "_fix_tokenizer"),
                                                  ("notebookkit.models.loader", "_load_banner")]
