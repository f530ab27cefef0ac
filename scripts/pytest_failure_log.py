"""A pytest plugin: each failing test's id and traceback go to the file ``NOTEBOOKKIT_FAILURE_LOG`` names, as the
failure comes.

    NOTEBOOKKIT_FAILURE_LOG=runs/gpu-failures-1.log python -m pytest -p scripts.pytest_failure_log ...

The Makefile's GPU halves load it. When an xdist worker crashes (a CUDA error, the card out of memory), xdist can
stop with an ``INTERNALERROR`` before the summary, and the failures' tracebacks are lost with it: session 46's first
half-1 run ended so, with 52 failures and no reason shown. Only the controlling process writes (a worker's reports
reach it too), so each failure is written once.
"""

from __future__ import annotations

import os


_in_a_worker = {"now": False}  # set per process by pytest_configure


def pytest_configure(config) -> None:
    # an xdist worker's config has workerinput (its environment would not do: a pytest run inside a worker's test
    # inherits PYTEST_XDIST_WORKER)
    _in_a_worker["now"] = hasattr(config, "workerinput")


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("NOTEBOOKKIT_FAILURE_LOG")
    if not path or not report.failed or _in_a_worker["now"]:
        return
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
