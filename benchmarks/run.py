"""Side-by-side training benchmark: every available system on every configuration, one run.

    python benchmarks/run.py --out benchmarks/results            # all configurations
    python benchmarks/run.py --only 8b-nf4-4096x2 --systems hf,notebookkit

Each (configuration, system) row runs in its own process (`benchmarks/train_step.py`). A system
whose package is missing is reported as "not installed", never silently dropped. Results go to
``<out>/<date>-<gpu>.json`` and ``.md`` plus a PNG bar chart; the markdown table is printed last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (shape, quant, seq, batch)
CONFIGS: dict[str, tuple[str, str, int, int]] = {
    "8b-nf4-4096x2": ("llama-3.1-8b", "nf4", 4096, 2),
    "8b-bf16-4096x2": ("llama-3.1-8b", "bf16", 4096, 2),
    "1b-bf16-2048x8": ("llama-3.2-1b", "bf16", 2048, 8),
    "8b-nf4-16384x1": ("llama-3.1-8b", "nf4", 16384, 1),
    "qwen3-4b-bf16-2048x4": ("qwen3-4b", "bf16", 2048, 4),
    "gemma2-2b-bf16-2048x4": ("gemma-2-2b", "bf16", 2048, 4),
}
# Long rows: fewer steps (warm-up, timed) so a full run fits in one device call.
STEPS = {"8b-nf4-16384x1": (1, 3)}
SYSTEMS = ["hf", "compile", "liger", "unsloth", "notebookkit", "notebookkit-offload"]
NEEDS = {"liger": "liger_kernel", "unsloth": "unsloth"}
# Extra seconds for a system's first row in a run: Unsloth compiles its patched modules on first import
# (over a minute on a fresh machine), which is not training time and must not eat the row's --timeout.
FIRST_ROW_GRACE_S = {"unsloth": 120, "compile": 60}
# Variants of our system: (train_step --system, extra arguments). "notebookkit" is the default a user
# gets ("auto": the planner fits free VRAM, so on a 139 GiB card it keeps every activation);
# "notebookkit-offload" is the memory-lean mode (layer inputs in pinned host memory), the mode Unsloth
# runs; "notebookkit-<N>GiB" asks the planner for the fastest plan under a cap of N GiB, and
# "notebookkit-fp8-<N>GiB" does the same with the FP8 forward.
VARIANTS = {
    "notebookkit": ("notebookkit", []),
    "notebookkit-offload": ("notebookkit", ["--checkpointing", "offload"]),
    "notebookkit-recompute": ("notebookkit", ["--checkpointing", "true"]),
    "notebookkit-fp8": ("notebookkit", ["--fp8"]),
    "notebookkit-fp8-offload": ("notebookkit", ["--fp8", "--checkpointing", "offload"]),
}


def resolve_system(system: str) -> tuple[str, list[str]]:
    """(train_step system, extra arguments) for a system name of the table."""
    if system in VARIANTS:
        return VARIANTS[system]
    if system.startswith("notebookkit-fp8-") and system.endswith("GiB"):
        return "notebookkit", ["--fp8", "--max-memory", system[len("notebookkit-fp8-"):]]
    if system.startswith("notebookkit-") and system.endswith("GiB"):
        return "notebookkit", ["--max-memory", system[len("notebookkit-"):]]
    return system, []


def available(system: str) -> bool:
    module = NEEDS.get(system)
    return module is None or importlib.util.find_spec(module) is not None


def run_row(config: str, system: str, steps: int, timeout: int, extra: list[str]) -> dict:
    shape, quant, seq, batch = CONFIGS[config]
    row = dict(config=config, system=system, shape=shape, quant=quant, seq=seq, batch=batch)
    base_system, variant_args = resolve_system(system)
    if not available(base_system):
        return row | dict(status="not installed")
    warmup, steps = STEPS.get(config, (2, steps))
    cmd = [sys.executable, os.path.join(HERE, "train_step.py"), "--system", base_system, "--shape", shape,
           "--quant", quant, "--seq", str(seq), "--batch", str(batch), "--warmup", str(warmup), "--steps", str(steps),
           *variant_args, *extra]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return row | dict(status=f"timed out after {timeout}s")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return row | json.loads(line[7:]) | dict(system=system, status="ok")
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    oom = any("OutOfMemory" in t or "out of memory" in t for t in tail)
    return row | dict(status="out of memory" if oom else "failed: " + failure_reason(proc.stderr or proc.stdout))


def failure_reason(output: str, limit: int = 300) -> str:
    """The start of the last ``SomeError: message`` line of a failed row's output (the message says
    what went wrong; its head matters more than its tail), else its last three lines."""
    lines = output.strip().splitlines()
    errors = [ln.strip() for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", ln.strip())]
    text = errors[-1] if errors else " | ".join(lines[-3:])
    return text if len(text) <= limit else text[: limit - 1] + "…"


def markdown(rows: list[dict]) -> str:
    lines = ["| config | system | tokens/s | median step tok/s | × hf | × unsloth | peak GiB | predicted GiB | activation plan "
             "| loss first → last | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r.get("status") == "ok"
        ref = {s: x.get("tok_s") for x in rows if x["config"] == r["config"] and x.get("status") == "ok" for s in [x["system"]]}
        ratio = lambda s: f"{r['tok_s'] / ref[s]:.2f}" if ok and ref.get(s) else "–"  # noqa: E731
        lines.append(
            f"| {r['config']} | {r['system']} | {r['tok_s']:,.0f} | "
            f"{format(r['tok_s_median'], ',.0f') if r.get('tok_s_median') else '–'} | {ratio('hf')} | {ratio('unsloth')} | "
            f"{r['peak_gib']:.2f} | {r.get('predicted_gib') or '–'} | {r.get('plan') or '–'} | "
            f"{r['loss_first']:.4f} → {r['loss_last']:.4f} | ok |"
            if ok else f"| {r['config']} | {r['system']} | – | – | – | – | – | – | – | – | {r['status']} |"
        )
    return "\n".join(lines)


def bar_chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return
    labels = [f"{r['config']}\n{r['system']}" for r in ok]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, len(ok) * 0.9), 7), sharex=True)
    ax1.bar(labels, [r["tok_s"] for r in ok], color="tab:blue")
    ax1.set_ylabel("tokens / s")
    ax2.bar(labels, [r["peak_gib"] for r in ok], color="tab:orange")
    ax2.set_ylabel("peak VRAM (GiB)")
    ax2.tick_params(axis="x", rotation=70, labelsize=7)
    fig.suptitle(f"LoRA training step, {ok[0].get('gpu', 'GPU')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def header(rows: list[dict]) -> str:
    """Title and method lines of the markdown table."""
    ok = [r for r in rows if r.get("status") == "ok"]
    gpu = ok[0].get("gpu", "GPU") if ok else "GPU"
    versions = ok[0].get("versions", {}) if ok else {}
    return (
        f"# Training-step benchmark, one {gpu}, {dt.date.today()}\n\n"
        f"Versions: {', '.join(f'{k} {v}' for k, v in versions.items()) or '–'}. Random-weight checkpoints of the real "
        "shapes, LoRA r=16 alpha=16 on all 7 projections, AdamW (fused), random tokens, warm-up then timed steps "
        "(2 + 4 unless the call says otherwise; 1 + 3 for the 16k row), one process per row. tokens/s is over the whole "
        "timed window (ratios use it); the median step is from CUDA events between steps. Peak = `torch.cuda.max_memory_allocated`; predicted = "
        "notebookkit's memory model for the plan the row ran. `notebookkit` is the default "
        "(`use_gradient_checkpointing=\"auto\"`, planned for free VRAM); `notebookkit-offload` the memory-lean mode; "
        "`notebookkit-<N>GiB` the planner under `max_memory=\"<N>GiB\"`.\n\n"
    )


def write_results(rows: list[dict], stem: str) -> str:
    table = header(rows) + markdown(rows)
    with open(stem + ".json", "w") as fh:
        json.dump(rows, fh, indent=1)
    with open(stem + ".md", "w") as fh:
        fh.write(table + "\n")
    bar_chart(rows, stem + ".png")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--merge", nargs="+", default=None, help="merge earlier .json results into one table")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configuration names")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=300,
                    help="seconds per row (a system's first row gets FIRST_ROW_GRACE_S more)")
    ap.add_argument("--tag", default="")
    args, extra = ap.parse_known_args()
    if args.merge:
        os.makedirs(args.out, exist_ok=True)
        rows = [r for path in args.merge for r in json.load(open(path))]
        print(write_results(rows, os.path.join(args.out, f"{dt.date.today()}-merged{('-' + args.tag) if args.tag else ''}")))
        return
    import torch

    gpu = torch.cuda.get_device_name(0).replace(" ", "-") if torch.cuda.is_available() else "cpu"
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{dt.date.today()}-{gpu}{('-' + args.tag) if args.tag else ''}")
    rows = []
    started: set[str] = set()
    for config in args.only.split(","):
        for system in args.systems.split(","):
            grace = 0 if system in started else FIRST_ROW_GRACE_S.get(system, 0)
            started.add(system)
            row = run_row(config, system, args.steps, args.timeout + grace, extra)
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(stem + ".json", "w") as fh:
                json.dump(rows, fh, indent=1)
    print(write_results(rows, stem))


if __name__ == "__main__":
    main()
