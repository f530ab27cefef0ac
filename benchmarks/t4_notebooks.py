"""Every notebook's GPU default as a free T4 runs it: one table of peak VRAM, peak host RSS, wall time, skipped
fp16 steps and the notebook's own learning signal (its last cell).

On the GPU machine (an H200 standing in for a T4)::

    PYTHONPATH=$PWD/.site:$PWD python3 benchmarks/t4_notebooks.py --out runs/t4 [--only grpo,vision_sft]

What makes it a T4 run:

* the notebook's kernel starts with a ``sitecustomize`` that caps its VRAM at 15 GiB
  (``torch.cuda.set_per_process_memory_fraction``) and makes the card report compute capability 7.5 to
  everything but Triton (which must compile for the card it runs on), so
  ``is_bfloat16_supported()`` is ``False``: ``dtype=None`` picks fp16 and the trainers run fp16 under a
  loss scaler, exactly the T4's path (no bf16, no FP8);
* the model is a real-size checkpoint of the notebook's GPU default (``GPU_MODEL``: Qwen3-0.6B for the text
  notebooks, Qwen2.5-VL-7B for the vision one) with random weights and the tiny default's tokenizer, built
  here once (nothing can be downloaded), loaded in 4-bit as the notebook's GPU default does;
* the host's RSS of the kernel process is sampled every 0.2 s (``rss``: what the process holds, mapped file
  pages included; ``anon``: ``rss`` minus file-backed and shared pages, what the OOM killer counts against
  Colab's ~12.7 GB). The target is ``rss`` <= 10.5 GiB (what a free Colab has left after its own ~2 GB).

The kernel writes its peak allocated / reserved VRAM to a file as it exits. Random weights make the learning
signals harder than with a real checkpoint (nothing is known at the start); the table says which passed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
CAP_GIB = 15.0
RSS_TARGET_GIB = 10.5

#: notebook -> (checkpoint kind, extra parameters; the GPU defaults otherwise)
NOTEBOOKS: dict[str, tuple[str, dict]] = {
    "chat_sft": ("qwen3-0.6b", {"CHAT_TEMPLATE": "qwen-3"}),
    "alpaca_sft": ("qwen3-0.6b", {}),
    "dpo": ("qwen3-0.6b", {}),
    "grpo": ("qwen3-0.6b", {}),
    "vision_sft": ("qwen2.5-vl-7b", {}),
    "export": ("qwen3-0.6b", {}),
}

SITECUSTOMIZE = """\
import atexit, json, os, threading, time
import torch

_total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(min(1.0, {cap} * 2**30 / _total))
import triton
triton.runtime.driver.active.get_current_target()  # Triton keeps the real capability: it compiles for this card
torch.cuda.get_device_capability = lambda device=None: (7, 5)   # everything else sees a T4: no bf16, no FP8
torch.cuda.is_bf16_supported = lambda including_emulation=True: False
_out = {out!r}

def _write():
    if torch.cuda.is_initialized():
        json.dump(dict(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved()),
                  open(_out, "w"))

def _loop():
    while True:
        time.sleep(2.0)
        try:
            _write()
        except Exception:
            pass

threading.Thread(target=_loop, daemon=True).start()
atexit.register(_write)
"""


def notebook_path(name: str) -> Path:
    found = [p for p in (ROOT / "notebooks").rglob(f"{name}.ipynb") if ".ipynb_checkpoints" not in p.parts]
    if not found:
        raise SystemExit(f"no notebook named {name}.ipynb under notebooks/")
    return found[0]


def build_text_checkpoint(folder: Path, name: str = "Qwen/Qwen3-0.6B") -> Path:
    """A random-weight bf16 checkpoint with the shape of ``name`` (memory/shapes.py) and the tiny tokenizer of its
    family, built once (nothing can be downloaded). Also the GPU notebook tests' real-size models."""
    import torch
    import transformers as tf

    from notebookkit.embedded.tiny import ensure_tiny_model
    from notebookkit.families import for_model_type
    from notebookkit.memory.shapes import KNOWN_MODELS

    if (folder / "done").exists():
        return folder
    s = KNOWN_MODELS[name]
    tiny = Path(ensure_tiny_model(for_model_type(s.model_type).tiny_name))
    config = getattr(tf, for_model_type(s.model_type).config_class)(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim, tie_word_embeddings=s.tie_word_embeddings, max_position_embeddings=s.max_position_embeddings,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    del model
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, folder / f.name)
    (folder / "done").write_text("")
    return folder


def checkpoint(kind: str, root: Path) -> Path:
    if kind == "qwen3-0.6b":
        return build_text_checkpoint(root / kind)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    os.environ.setdefault("NOTEBOOKKIT_BENCH_CKPT", str(root))
    from vision_step import build_checkpoint

    return Path(build_checkpoint(kind, 448))


def _outputs_text(nb: dict) -> str:
    return "".join("".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code"
                   for o in c.get("outputs", []) if o.get("output_type") == "stream")


def run_one(name: str, folder: Path, extra: dict, out: Path) -> dict:
    import papermill

    work = out / name
    work.mkdir(parents=True, exist_ok=True)
    startup = work / "startup"
    startup.mkdir(exist_ok=True)
    vram_file = work / "vram.json"
    (startup / "sitecustomize.py").write_text(SITECUSTOMIZE.format(cap=CAP_GIB, out=str(vram_file)))
    env_before = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(startup), os.environ.get("PYTHONPATH", "")])
    params = dict(extra, MODEL_NAME=str(folder), OUTPUT_DIR=str(work / "outputs"))
    executed = work / f"{name}.ipynb"
    error = None
    start = time.perf_counter()
    try:
        from notebookkit.memory.meters import HostMemorySampler

        # the notebook's kernel (this process's descendants: several harnesses side by side count their own)
        with HostMemorySampler(0.2, children=True) as rss:
            try:
                papermill.execute_notebook(str(notebook_path(name)), str(executed), parameters=params, kernel_name="python3",
                                           cwd=str(ROOT), progress_bar=False, request_save_on_cell_execute=False,
                                           execution_timeout=1800)
            except Exception as exc:  # noqa: BLE001 - the table records what stopped the notebook
                error = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    seconds = time.perf_counter() - start
    vram = json.loads(vram_file.read_text()) if vram_file.exists() else {}
    text = _outputs_text(json.loads(executed.read_text())) if executed.exists() else ""
    skipped = [line for line in text.splitlines() if line.startswith("fp16: ")]
    peak_rss, peak_anon = rss.peak_rss, rss.peak_anon
    return dict(notebook=name, checkpoint=folder.name, ok=error is None, error=error, seconds=round(seconds, 1),
                peak_vram_gib=round(vram.get("peak_allocated", 0) / GiB, 2),
                reserved_vram_gib=round(vram.get("peak_reserved", 0) / GiB, 2),
                peak_rss_gib=round(peak_rss / GiB, 2), peak_anon_gib=round(peak_anon / GiB, 2),
                fp16_lines=skipped, signal=_signal(text))


def _signal(text: str) -> str:
    """The notebook's learning-signal lines (what its last cell checks), as printed."""
    keep = [l for l in text.splitlines() if re.search(r"(loss|accuracy|reward|margin|canary|learn)", l, re.I)]
    return " | ".join(keep[-3:])[:400]


def markdown(rows: list[dict], device: str) -> str:
    lines = [f"T4 emulation on {device}: fp16 (capability reported as 7.5), VRAM capped at {CAP_GIB:g} GiB, "
             f"4-bit weights, random-weight checkpoints of each notebook's GPU default.", "",
             "| notebook | checkpoint | outcome | peak VRAM GiB (reserved) | peak host RSS GiB (anon) | wall s | fp16 skipped | learning signal |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        outcome = "passed" if r["ok"] else f"stopped: {r['error']}"
        skipped = "; ".join(l.replace("fp16: ", "") for l in r["fp16_lines"]) or "–"
        lines.append(f"| {r['notebook']} | {r['checkpoint']} | {outcome} | {r['peak_vram_gib']} ({r['reserved_vram_gib']}) | "
                     f"{r['peak_rss_gib']} ({r['peak_anon_gib']}) | {r['seconds']} | {skipped} | {r['signal']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/t4")
    parser.add_argument("--only", default=",".join(NOTEBOOKS))
    parser.add_argument("--checkpoints", default=os.path.expanduser("~/.cache/notebookkit/bench"))
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="notebook parameters over the GPU defaults (Python literals), e.g. BATCH_SIZE=8")
    args = parser.parse_args()
    import torch

    out, root = Path(args.out).resolve(), Path(args.checkpoints)
    rows = []
    for name in args.only.split(","):
        kind, extra = NOTEBOOKS[name]
        folder = checkpoint(kind, root)
        overrides = {k: ast.literal_eval(v) for k, v in (item.split("=", 1) for item in args.set)}
        row = run_one(name, folder, {**extra, **overrides}, out)
        print(json.dumps(row), flush=True)
        rows.append(row)
    table = markdown(rows, torch.cuda.get_device_name(0))
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
