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


def test_a_killed_run_names_the_tests_still_running(tmp_path):
    """The progress log has each test's start and outcome, so a half killed at its time limit names the tests it
    cut off (session 47: half 1 stopped at 738 of 740 with only dots printed)."""
    import signal
    import time

    sys.path.insert(0, str(ROOT / "scripts"))
    from pytest_failure_log import unfinished

    (tmp_path / "test_sample.py").write_text(
        "import time, pytest\n\n\ndef test_passes():\n    assert True\n\n\n"
        "def test_skips():\n    pytest.skip('planted')\n\n\ndef test_cut_off():\n    time.sleep(60)\n")
    progress = tmp_path / "progress.log"
    env = dict(os.environ, NOTEBOOKKIT_PROGRESS_LOG=str(progress))
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                            "-p", "scripts.pytest_failure_log", "--confcutdir", str(tmp_path), "--rootdir",
                            str(tmp_path), "-o", "addopts=", str(tmp_path / "test_sample.py")],
                           cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (
                progress.exists() and "test_cut_off" in progress.read_text() and progress.read_text().count("\n") >= 5):
            time.sleep(0.2)
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # as `timeout` ends a half, the workers with it
        run.wait()
    text = progress.read_text()
    assert "passed test_sample.py::test_passes" in text and "skipped test_sample.py::test_skips" in text, text
    assert unfinished(str(progress)) == ["test_sample.py::test_cut_off"], text
