"""Run a notebook headless, with parameters, the way CI and ``make demo`` do.

The notebook's cell tagged ``parameters`` holds defaults. Overrides are written into a new cell
tagged ``injected-parameters`` right after it (the papermill convention), then every cell runs in a
fresh Jupyter kernel through ``nbclient``. The executed notebook, outputs included, is written to
``output_path`` whether the run passed or failed, so a failure can be read in Jupyter.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["NotebookRun", "inject_parameters", "run_notebook"]


@dataclass
class NotebookRun:
    """Outcome of :func:`run_notebook`."""

    path: str
    ok: bool
    seconds: float
    output_path: str | None
    error: str | None = None
    failed_cell: int | None = None

    def log_line(self) -> str:
        """One line for CI logs: path, outcome, wall time."""
        status = "PASSED" if self.ok else f"FAILED (cell {self.failed_cell})"
        return f"notebook {self.path}: {status} in {self.seconds:.1f} s"


def inject_parameters(nb: Any, parameters: dict[str, Any]) -> Any:
    """Insert ``name = value`` assignments after the ``parameters`` cell (or first, if none)."""
    import nbformat

    if not parameters:
        return nb
    source = "# Parameters injected by notebookkit.train.headless\n" + "\n".join(
        f"{k} = {v!r}" for k, v in parameters.items()
    )
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    cell["id"] = "injected-parameters"
    index = next(
        (i + 1 for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])), 0
    )
    nb.cells = [c for c in nb.cells if "injected-parameters" not in c.get("metadata", {}).get("tags", [])]
    nb.cells.insert(index, cell)
    return nb


def run_notebook(
    path: str | os.PathLike,
    parameters: dict[str, Any] | None = None,
    output_path: str | os.PathLike | None = None,
    *,
    cell_timeout: int = 900,
    cwd: str | os.PathLike | None = None,
    kernel_name: str = "python3",
    env: dict[str, str] | None = None,
) -> NotebookRun:
    """Execute ``path`` top to bottom in a fresh kernel and report how it went.

    Args:
        path: the ``.ipynb`` file.
        parameters: values overriding the ``parameters`` cell.
        output_path: where to write the executed notebook (not written when ``None``).
        cell_timeout: seconds one cell may run.
        cwd: working directory of the kernel (default: the repository root, i.e. the current one).
        kernel_name: Jupyter kernel to start.
        env: extra environment variables for the kernel.

    Returns:
        :class:`NotebookRun` (``ok``, ``seconds``, ``error`` with the failing cell's traceback).
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    nb = nbformat.read(str(path), as_version=4)
    inject_parameters(nb, parameters or {})
    old_env = {}
    for k, v in (env or {}).items():
        old_env[k] = os.environ.get(k)
        os.environ[k] = v
    client = NotebookClient(
        nb,
        timeout=cell_timeout,
        kernel_name=kernel_name,
        resources={"metadata": {"path": str(cwd or os.getcwd())}},
    )
    start = time.perf_counter()
    error: str | None = None
    failed: int | None = None
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError) as err:
        error = str(err)
        failed = next(
            (i for i, c in enumerate(nb.cells) if c.cell_type == "code"
             and any(o.get("output_type") == "error" for o in c.get("outputs", []))),
            None,
        )
        if failed is None:  # timeout: the first cell without an execution count
            failed = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                           and c.get("execution_count") is None), None)
    finally:
        seconds = time.perf_counter() - start
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if output_path is not None:
        Path(output_path).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(output_path))
    return NotebookRun(str(path), error is None, seconds, str(output_path) if output_path else None, error, failed)
