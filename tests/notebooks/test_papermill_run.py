"""The papermill helper the GPU notebook tests use (``papermill_run.py``), checked on CPU with a two-cell notebook:
parameters land after the ``parameters`` cell, ``env`` reaches the kernel (how the T4 emulation's
``sitecustomize`` gets in) and is gone again afterwards, a failing cell fails the run, and the executed copy is
signed (trusted), so JupyterLab renders its widgets."""

from __future__ import annotations

import os

import nbformat
from nbformat.sign import NotebookNotary

from tests.notebooks.papermill_run import run_with_papermill


def _notebook(path, body: str):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("A = 1", metadata={"tags": ["parameters"]}), nbformat.v4.new_code_cell(body)]
    nbformat.write(nb, str(path))
    return path


def test_parameters_and_environment_reach_the_kernel(tmp_path):
    source = _notebook(tmp_path / "probe.ipynb",
                       "import os\nprint('A =', A, '| NBK_PROBE =', os.environ.get('NBK_PROBE'))\nassert A == 2")
    run = run_with_papermill(str(source), tmp_path / "out.ipynb", {"A": 2}, timeout=120, env={"NBK_PROBE": "t4"})
    assert run.ok, run.error
    assert "A = 2 | NBK_PROBE = t4" in run.stdout()
    assert "NBK_PROBE" not in os.environ
    assert NotebookNotary().check_signature(nbformat.read(str(run.output), as_version=4))


def test_a_failing_cell_fails_the_run_and_the_notebook_is_still_written(tmp_path):
    source = _notebook(tmp_path / "probe.ipynb", "assert A == 2, 'A is not 2'")
    run = run_with_papermill(str(source), tmp_path / "out.ipynb", {"A": 3}, timeout=120)
    assert not run.ok and "A is not 2" in run.error
    assert run.output.is_file()
