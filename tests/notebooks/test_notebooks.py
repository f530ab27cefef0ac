"""Execute every notebook under notebooks/ end to end (nbclient, fresh kernel, CPU defaults).

Each notebook asserts its own learning signal in its last cell, so a pass here means the notebook
runs *and* the model learned. One log line per notebook (path, outcome, seconds) is printed at the
end of the run and appended to runs/ci-notebooks/notebooks.log; the executed notebooks are kept in
runs/ci-notebooks/ for inspection.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p.relative_to(ROOT) for p in (ROOT / "notebooks").rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in p.parts)
OUT = ROOT / "runs" / "ci-notebooks"


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found under notebooks/"


def test_notebooks_match_their_generator():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_notebooks.py"), "--check"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr


def test_notebooks_are_committed_without_outputs():
    import nbformat

    for rel in NOTEBOOKS:
        nb = nbformat.read(str(ROOT / rel), as_version=4)
        dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
        assert not dirty, f"{rel}: cells {dirty} carry outputs; clear them before committing"
        assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells), f"{rel}: no parameters cell"


@pytest.mark.parametrize("rel", NOTEBOOKS, ids=[str(p) for p in NOTEBOOKS])
def test_notebook_runs(rel, monkeypatch, request):
    from notebookkit.train.headless import run_notebook

    monkeypatch.chdir(ROOT)
    stem = "-".join(rel.with_suffix("").parts[1:])
    out_dir = OUT / stem
    result = run_notebook(rel, {"OUTPUT_DIR": str(out_dir)}, OUT / f"{stem}.ipynb", cell_timeout=900)
    line = result.log_line()
    request.config.__dict__.setdefault("notebookkit_notebook_log", []).append(line)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "notebooks.log", "a") as log:
        log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
    print(line)
    assert result.ok, f"{line}\n{result.error}"
