"""A pytest plugin for long GPU runs: each failing test's id and traceback go to the file ``NOTEBOOKKIT_FAILURE_LOG``
names, as the failure comes; each test's start and outcome go to the file ``NOTEBOOKKIT_PROGRESS_LOG`` names.

    NOTEBOOKKIT_FAILURE_LOG=runs/gpu-failures-1.log NOTEBOOKKIT_PROGRESS_LOG=runs/gpu-progress-1.log \\
        python -m pytest -p scripts.pytest_failure_log ...
    python scripts/pytest_failure_log.py runs/gpu-progress-1.log   # the tests that started and never finished

The Makefile's GPU halves load it. When an xdist worker crashes (a CUDA error, the card out of memory), xdist can
stop with an ``INTERNALERROR`` before the summary, and the failures' tracebacks are lost with it: session 46's first
half-1 run ended so, with 52 failures and no reason shown. When a half is killed at its time limit, ``-q`` has
printed only dots: session 47's half 1 stopped at 738 of 740 with no name of the two still running, which the
progress log gives. Only the controlling process writes (a worker's reports reach it too), so each line is written
once.
"""

from __future__ import annotations

import os
import sys

_in_a_worker = {"now": False}  # set per process by pytest_configure


def pytest_configure(config) -> None:
    # an xdist worker's config has workerinput (its environment would not do: a pytest run inside a worker's test
    # inherits PYTEST_XDIST_WORKER)
    _in_a_worker["now"] = hasattr(config, "workerinput")


def _append(variable: str, text: str) -> None:
    path = os.environ.get(variable)
    if path and not _in_a_worker["now"]:
        with open(path, "a", encoding="utf-8") as log:
            log.write(text)


def pytest_runtest_logstart(nodeid, location) -> None:
    _append("NOTEBOOKKIT_PROGRESS_LOG", f"start {nodeid}\n")


def pytest_runtest_logreport(report) -> None:
    if report.failed:
        _append("NOTEBOOKKIT_FAILURE_LOG", f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
    # a test's outcome: its call's, or its setup's where that failed or skipped, or its teardown's failure
    if report.when == "call" or (report.when == "setup" and not report.passed) or (report.when == "teardown"
                                                                                    and report.failed):
        line = f"{report.outcome} {report.nodeid} {report.duration:.1f}s ({report.when})\n"
        _append("NOTEBOOKKIT_PROGRESS_LOG", line)


def unfinished(progress_log: str) -> list[str]:
    """The tests the log saw start and never saw end, in their starting order."""
    started, ended = [], set()
    with open(progress_log, encoding="utf-8") as log:
        for line in log:
            word, _, rest = line.rstrip("\n").partition(" ")
            if word == "start":
                started.append(rest)
            else:  # "<outcome> <nodeid> <seconds>s (<when>)"
                ended.add(rest.rsplit(" ", 2)[0])
    return [nodeid for nodeid in started if nodeid not in ended]


if __name__ == "__main__":
    for nodeid in unfinished(sys.argv[1]):
        print(nodeid)
