"""Prints one log line per executed notebook at the end of the pytest run (see test_notebooks.py)."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ANN001
    lines = getattr(config, "notebookkit_notebook_log", [])
    if lines:
        terminalreporter.section("notebooks")
        for line in lines:
            terminalreporter.write_line(line)
