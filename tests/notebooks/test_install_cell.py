"""The notebooks' first cell, run the way a Colab or Kaggle user meets it: in a fresh Python environment
where notebookkit is not installed, as the first cell of a notebook run top to bottom in a Jupyter kernel.

- from a wheel path (``NOTEBOOKKIT_SOURCE``), and from a wheel uploaded beside the notebook (no source given);
- from a git URL (a local bare clone of this repository stands in for the hosted one);
- from a name that does not exist: the cell raises with what to do, and the next cell never runs.

The fresh environment is a venv without notebookkit that sees this environment's other packages (torch,
transformers, ipykernel) through a ``.pth`` file, and pip installs with ``PIP_NO_DEPS=1``, so nothing large is
downloaded: what is proved is the mechanism (the source is found, installed, imported from the new
environment, or refused loudly).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "sft" / "chat_sft.ipynb"
MARKER = "after-install.txt"

pytestmark = pytest.mark.slow


def _install_cell() -> str:
    import nbformat

    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    return next(c.source for c in nb.cells if c.cell_type == "code")


@pytest.fixture(scope="module")
def fresh_kernel(tmp_path_factory) -> Path:
    """A venv without notebookkit, registered as the Jupyter kernel ``nbk-fresh`` (under the returned folder)."""
    base = tmp_path_factory.mktemp("fresh")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # this environment's packages, after the venv's own; .pth files of this environment (notebookkit's
    # editable install) are not read from a folder added this way, so notebookkit stays missing
    (site / "parent-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    check = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('notebookkit'))"],
                           capture_output=True, text=True, cwd=base, env=_clean_env())
    assert check.stdout.strip() == "None", f"notebookkit is importable in the fresh venv: {check.stdout}{check.stderr}"
    spec = base / "jupyter" / "kernels" / "nbk-fresh"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fresh venv", "language": "python"}))
    return base


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True)
    (path,) = out.glob("notebookkit-*.whl")
    return path


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "NOTEBOOKKIT_SOURCE"))}
    return env


def _run(fresh: Path, workdir: Path, source: str | None, monkeypatch) -> tuple:
    """Run [install cell, marker cell, import check] top to bottom in the fresh kernel; return the notebook and
    the error (or None)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(_install_cell()),
        nbformat.v4.new_code_cell(f"open({MARKER!r}, 'w').write('ran')"),
        nbformat.v4.new_code_cell("import notebookkit, sys; print(notebookkit.__file__); print(sys.prefix)"),
    ]
    for key in [k for k in os.environ if k.startswith(("PIP_", "PYTHONPATH", "NOTEBOOKKIT_SOURCE"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("JUPYTER_PATH", str(fresh / "jupyter"))
    monkeypatch.setenv("PIP_NO_DEPS", "1")                      # no torch download: the mechanism, not the deps
    monkeypatch.setenv("PIP_NO_BUILD_ISOLATION", "0")            # (pip reads "0" as: build without isolation)
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    if source is not None:
        monkeypatch.setenv("NOTEBOOKKIT_SOURCE", source)
    workdir.mkdir(parents=True, exist_ok=True)
    client = NotebookClient(nb, kernel_name="nbk-fresh", timeout=600, resources={"metadata": {"path": str(workdir)}})
    try:
        client.execute()
        return nb, None
    except CellExecutionError as err:
        return nb, err


def _uninstall(fresh: Path) -> None:
    subprocess.run([str(fresh / "venv" / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", "notebookkit"],
                   env=_clean_env(), cwd=fresh, capture_output=True)


def _text(cell) -> str:
    return "".join(o.get("text", "") + "\n".join(o.get("traceback", [])) + o.get("evalue", "")
                   for o in cell.get("outputs", []))


def _assert_installed_from_fresh_venv(fresh: Path, workdir: Path, nb) -> None:
    assert (workdir / MARKER).exists(), "the cell after the install cell did not run"
    where = _text(nb.cells[2])
    assert str(fresh / "venv") in where, where
    assert "site-packages/notebookkit" in where, f"notebookkit was not imported from the installed copy:\n{where}"


def test_install_from_a_wheel_path(fresh_kernel, wheel, tmp_path, monkeypatch):
    _uninstall(fresh_kernel)
    nb, err = _run(fresh_kernel, tmp_path, str(wheel), monkeypatch)
    assert err is None, err
    print(_text(nb.cells[0]))
    assert f"installing notebookkit from {wheel}" in _text(nb.cells[0])
    _assert_installed_from_fresh_venv(fresh_kernel, tmp_path, nb)


def test_install_finds_a_wheel_uploaded_beside_the_notebook(fresh_kernel, wheel, tmp_path, monkeypatch):
    _uninstall(fresh_kernel)
    (tmp_path / wheel.name).write_bytes(wheel.read_bytes())
    nb, err = _run(fresh_kernel, tmp_path, None, monkeypatch)
    assert err is None, err
    assert f"installing notebookkit from {wheel.name}" in _text(nb.cells[0]), _text(nb.cells[0])
    _assert_installed_from_fresh_venv(fresh_kernel, tmp_path, nb)


def test_install_from_a_git_url(fresh_kernel, tmp_path, monkeypatch):
    _uninstall(fresh_kernel)
    bare = tmp_path / "notebookkit.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(ROOT), str(bare)], check=True)
    nb, err = _run(fresh_kernel, tmp_path / "work", f"git+file://{bare}", monkeypatch)
    assert err is None, err
    print(_text(nb.cells[0]))
    _assert_installed_from_fresh_venv(fresh_kernel, tmp_path / "work", nb)


def test_install_from_a_name_that_does_not_exist_stops_the_notebook(fresh_kernel, tmp_path, monkeypatch):
    _uninstall(fresh_kernel)
    nb, err = _run(fresh_kernel, tmp_path, "notebookkit-no-such-package-31", monkeypatch)
    assert err is not None, "the install cell carried on after pip failed"
    message = _text(nb.cells[0])
    print(message)
    assert "RuntimeError" in message and "could not be installed from 'notebookkit-no-such-package-31'" in message
    assert "What to do" in message and "make dist" in message
    assert not (tmp_path / MARKER).exists(), "a cell after the failed install cell ran"
    assert not nb.cells[1].get("outputs") and nb.cells[1].get("execution_count") is None
