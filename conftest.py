"""Repository-wide pytest set-up, for the notebooks run by nbmake (``make test-notebooks``:
``pytest --nbmake notebooks``) as much as for ``tests/``.

- The kernels nbmake starts inherit this process's environment: nothing is fetched from the Hub (the
  notebooks use the embedded tiny default and bundled data), tokenizers do not fork threads.
- One log line per notebook (path, outcome, seconds) at the end of the run, also appended to
  runs/ci-notebooks/notebooks.log.
- Under ``-n 2`` the notebooks' kernels start at least ``KERNEL_START_GAP_S`` apart: jupyter_client picks a
  kernel's TCP ports before the kernel binds them, so two kernels started at the same moment by two workers
  can pick the same port ("ZMQError: Address already in use", an nbmake internal error).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

for _key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_key, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent
LOG = ROOT / "runs" / "ci-notebooks" / "notebooks.log"
KERNEL_START_LOCK = ROOT / "runs" / "ci-notebooks" / ".kernel-start.lock"
KERNEL_START_GAP_S = 5.0
_lines: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):  # noqa: ANN001
    """A notebook under xdist takes the kernel-start lock and keeps it ``KERNEL_START_GAP_S`` seconds."""
    if str(item.fspath).endswith(".ipynb") and os.environ.get("PYTEST_XDIST_WORKER"):
        KERNEL_START_LOCK.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(KERNEL_START_LOCK, os.O_CREAT | os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)

        def release() -> None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

        threading.Timer(KERNEL_START_GAP_S, release).start()
    yield


def pytest_runtest_logreport(report):  # noqa: ANN001
    path = report.nodeid.split("::")[0]
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under -n, the controller reports (once per notebook)
        return
    if not path.endswith(".ipynb") or report.when != "call" and not (report.when == "setup" and report.failed):
        return
    line = f"notebook {path}: {report.outcome.upper()} in {report.duration:.1f} s"
    _lines.append(line)
    LOG.parent.mkdir(parents=True, exist_ok=True)
    with open(LOG, "a") as log:
        log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")


def pytest_terminal_summary(terminalreporter):  # noqa: ANN001
    if _lines:
        terminalreporter.section("notebooks")
        for line in _lines:
            terminalreporter.write_line(line)
