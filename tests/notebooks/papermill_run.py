"""Parameterised notebook runs for the GPU tests (``pytest -m gpu``): papermill, with an environment for the kernel.

papermill writes the overrides into an ``injected-parameters`` cell after the cell tagged ``parameters``,
runs every cell in a fresh kernel and writes the executed notebook (widget state included) whether the run
passed or not; the executed copy is then signed as this user's own output, so JupyterLab renders its widgets. The kernel is a child of this process and inherits its environment, so ``env`` is set in
``os.environ`` for the duration of the call (the T4 emulation's ``sitecustomize`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    notebook: str
    output: Path
    ok: bool
    seconds: float
    error: str | None

    def log_line(self) -> str:
        return f"notebook {self.notebook}: {'PASSED' if self.ok else 'FAILED'} in {self.seconds:.1f} s ({self.output})"

    def stdout(self) -> str:
        """Every stream output of the executed notebook, in order."""
        import nbformat

        nb = nbformat.read(str(self.output), as_version=4)
        return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                       if o.get("output_type") == "stream")


@contextmanager
def environment(env: dict[str, str] | None) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def trust(path: Path) -> None:
    """Sign an executed notebook as this user's own output (what `jupyter trust` does). JupyterLab renders the
    widgets of a trusted notebook only: an untrusted one shows each widget's text fallback
    (``VBox(children=(...``) even though papermill saved the widget state."""
    import nbformat
    from nbformat.sign import NotebookNotary

    nb = nbformat.read(str(path), as_version=4)
    NotebookNotary().sign(nb)


def run_with_papermill(notebook: str, output: Path, parameters: dict[str, Any], *, timeout: int = 1800,
                       env: dict[str, str] | None = None) -> Run:
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    error = None
    with environment(env):
        try:
            pm.execute_notebook(str(ROOT / notebook), str(output), parameters=parameters, cwd=str(ROOT),
                                execution_timeout=timeout, progress_bar=False, kernel_name="python3",
                                coalesce_streams=True)  # a streamed reply is stored as one output, not one per token
        except PapermillExecutionError as err:
            error = str(err)
    trust(output)
    return Run(notebook, output, error is None, time.perf_counter() - start, error)
