"""The notebooks are authored as jupytext percent scripts paired with their ``.ipynb``.

A teacher edits either form and runs ``make notebooks-sync`` (``jupytext --sync``); these tests fail when
one side was edited alone, when a notebook has no script form, or when the committed ``.ipynb`` carries
outputs. The notebooks themselves run under nbmake (``make test``; see the root ``conftest.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p.relative_to(ROOT) for p in (ROOT / "notebooks").rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in p.parts)
IDS = [str(p) for p in NOTEBOOKS]


def _cells(nb) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(c.cell_type, c.source.strip("\n"), tuple(c.metadata.get("tags", []))) for c in nb.cells]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) == 6, NOTEBOOKS


@pytest.mark.parametrize("rel", NOTEBOOKS, ids=IDS)
def test_notebook_and_its_script_are_in_sync(rel):
    import jupytext
    import nbformat

    ipynb = ROOT / rel
    script = ipynb.with_suffix(".py")
    assert script.is_file(), f"{rel} has no jupytext source {script.name}: run `jupytext --set-formats ipynb,py:percent {rel}`"
    nb = nbformat.read(str(ipynb), as_version=4)
    assert nb.metadata.get("jupytext", {}).get("formats") == "ipynb,py:percent", f"{rel} is not paired with its script"
    from_script, from_ipynb = _cells(jupytext.read(script)), _cells(nb)
    for i, (a, b) in enumerate(zip(from_script, from_ipynb)):
        assert a == b, (f"cell {i} differs between {script.name} and {ipynb.name}; after editing one, run "
                        f"`make notebooks-sync` (jupytext --sync):\n--- {script.name}:\n{a[1]}\n--- {ipynb.name}:\n{b[1]}")
    assert len(from_script) == len(from_ipynb), (
        f"{script.name} has {len(from_script)} cells, {ipynb.name} {len(from_ipynb)}: run `make notebooks-sync`")


@pytest.mark.parametrize("rel", NOTEBOOKS, ids=IDS)
def test_notebook_is_committed_without_outputs(rel):
    import nbformat

    nb = nbformat.read(str(ROOT / rel), as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{rel}: cells {dirty} carry outputs; clear them before committing"
    assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells), f"{rel}: no parameters cell"


def test_every_notebook_starts_with_the_same_install_cell():
    """The install cell cannot import notebookkit (it installs it), so each notebook carries a copy of it;
    the copies are kept identical (tests/notebooks/test_install_cell.py runs it)."""
    import nbformat

    first = {}
    for rel in NOTEBOOKS:
        nb = nbformat.read(str(ROOT / rel), as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert "NOTEBOOKKIT_SOURCE" in code[0].source, f"{rel}: the first code cell is not the install cell"
        first[str(rel)] = code[0].source
    texts = set(first.values())
    assert len(texts) == 1, "the install cells differ: " + ", ".join(
        k for k, v in first.items() if v != first[IDS[0]]) + f" against {IDS[0]}"
