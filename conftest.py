"""Repository-wide pytest set-up, for the notebooks run by nbmake (``make test-notebooks``:
``pytest --nbmake notebooks``) as much as for ``tests/``.

- The kernels nbmake starts inherit this process's environment: nothing is fetched from the Hub (the
  notebooks use the embedded tiny default and bundled data), tokenizers do not fork threads.
- One log line per notebook (path, outcome, seconds) at the end of the run, also appended to
  runs/ci-notebooks/notebooks.log.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

for _key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_key, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent
LOG = ROOT / "runs" / "ci-notebooks" / "notebooks.log"
_lines: list[str] = []


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
