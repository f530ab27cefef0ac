"""`make demo`: run the chat SFT notebook with papermill on the tiny default and keep what it produced.

    .venv/bin/python scripts/run_demo.py [run-name] [--notebook notebooks/sft/chat_sft.ipynb] [-p NAME=VALUE ...]

Writes, under runs/<run-name or a timestamp>/:
  chat_sft.ipynb     the executed notebook, outputs and widget state included (open it in JupyterLab)
  loss_curve.png     training (and held-back) loss per step
  dashboard.png      the live dashboard's final figure: loss, learning rate, memory, tokens/s
  calibration.png    notebookkit vs plain PEFT loss curves from the calibration cell
  lora_adapter/      the trained LoRA adapter and tokenizer
and prints where they are. Exit status 1 if any cell failed (the notebook is still written).

The same run by hand, or a sweep of your own (papermill's ``-p NAME VALUE``, ``-y YAML``)::

    .venv/bin/papermill notebooks/sft/chat_sft.ipynb runs/mine/chat_sft.ipynb -p OUTPUT_DIR runs/mine -p MAX_STEPS 40
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the SFT notebook with papermill into runs/.")
    parser.add_argument("name", nargs="?", default=time.strftime("%Y%m%d-%H%M%S"), help="run folder name")
    parser.add_argument("--notebook", default="notebooks/sft/chat_sft.ipynb")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                        help="override a parameter of the notebook (Python literal), e.g. -p MAX_STEPS=20")
    args = parser.parse_args(argv)

    os.chdir(ROOT)
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(key, "1")  # the demo uses only the embedded tiny default and bundled data
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    run_dir = Path("runs") / args.name
    run_dir.mkdir(parents=True, exist_ok=True)
    params = {"OUTPUT_DIR": str(run_dir)}
    for item in args.param:
        key, _, raw = item.partition("=")
        params[key.strip()] = _value(raw.strip())
    notebook = Path(args.notebook)
    print(f"notebookkit demo: running {notebook} with papermill (this takes a few minutes on a CPU) ...", flush=True)
    start, error = time.perf_counter(), None
    try:
        pm.execute_notebook(str(notebook), str(run_dir / notebook.name), parameters=params, cwd=str(ROOT),
                            execution_timeout=1800, progress_bar=False,
                            coalesce_streams=True)  # a streamed reply is stored as one output, not one per token
    except PapermillExecutionError as err:
        error = f"cell {err.exec_count}: {err.ename}: {err.evalue}\n" + "\n".join(err.traceback)
    print(f"notebook {notebook}: {'FAILED' if error else 'PASSED'} in {time.perf_counter() - start:.1f} s")
    # Sign it as this user's own output (`jupyter trust`): JupyterLab renders the widgets (panels, dashboard) of a
    # trusted notebook only, and shows an untrusted one's as text (VBox(children=(...), state saved or not.
    import nbformat
    from nbformat.sign import NotebookNotary

    NotebookNotary().sign(nbformat.read(str(run_dir / notebook.name), as_version=4))
    latest = Path("runs") / "latest"
    try:
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(run_dir.name)
    except OSError:
        pass
    print(f"\nOutputs in {run_dir.resolve()}:")
    for path in sorted(run_dir.iterdir()):
        size = sum(p.stat().st_size for p in path.rglob("*")) if path.is_dir() else path.stat().st_size
        print(f"  {path.name + ('/' if path.is_dir() else ''):<22} {size / 1024:8.1f} KiB")
    if error:
        tail = error.strip().splitlines()[-25:]
        print("\nThe notebook failed; the executed notebook above shows where. Last lines of the error:")
        print("\n".join(tail))
        return 1
    print(f"\nOpen the executed notebook with: .venv/bin/jupyter lab {run_dir / notebook.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
