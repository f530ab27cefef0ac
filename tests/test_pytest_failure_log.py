"""``scripts/pytest_failure_log.py``, the plugin the Makefile's GPU halves load: each failure's id and traceback
in the file ``NOTEBOOKKIT_FAILURE_LOG`` names, once, with xdist's workers too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_each_failure_is_logged_once_under_xdist(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "def test_passes():\n    assert True\n\n\ndef test_fails():\n    assert 1 + 1 == 3, 'planted'\n")
    log = tmp_path / "failures.log"
    env = dict(os.environ, NOTEBOOKKIT_FAILURE_LOG=str(log))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                          "-p", "scripts.pytest_failure_log", "--confcutdir", str(tmp_path), "--rootdir", str(tmp_path),
                          "-o", "addopts=", str(tmp_path / "test_sample.py")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr  # one test failed
    text = log.read_text()
    assert text.count("==== ") == 1 and "test_sample.py::test_fails (call)" in text, text
    assert "planted" in text and "test_passes" not in text
