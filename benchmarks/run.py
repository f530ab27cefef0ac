"""Side-by-side training benchmark: every available system on every configuration, one run.

    python benchmarks/run.py --out benchmarks/results            # all configurations
    python benchmarks/run.py --only 8b-nf4-4096x2 --systems hf,notebookkit

Each (configuration, system) row runs in its own process (`benchmarks/train_step.py`). A system
whose package is missing is reported as "not installed", never silently dropped. Results go to
``<out>/<date>-<gpu>.json`` and ``.md`` plus a PNG bar chart; the markdown table is printed last.

Every row also says whether it learned what HF+PEFT learned (the "learning check" column, see
:func:`learning_verdict`): all systems train on the same learnable token stream, so the loss falls
several percent within the run, and each row's final ``lora_B`` (the adapters' update) is compared
with the ``hf`` row's of the same configuration.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from learning_check import loss_drop, update_difference  # noqa: E402  (this folder, also when imported)
from process_rounds import median_rows, rounds, spread_lines  # noqa: E402

# name -> (shape, quant, seq, batch)
CONFIGS: dict[str, tuple[str, str, int, int]] = {
    "8b-nf4-4096x2": ("llama-3.1-8b", "nf4", 4096, 2),
    "8b-bf16-4096x2": ("llama-3.1-8b", "bf16", 4096, 2),
    "1b-bf16-2048x8": ("llama-3.2-1b", "bf16", 2048, 8),
    "8b-nf4-16384x1": ("llama-3.1-8b", "nf4", 16384, 1),
    "qwen3-4b-bf16-2048x4": ("qwen3-4b", "bf16", 2048, 4),
    "gemma2-2b-bf16-2048x4": ("gemma-2-2b", "bf16", 2048, 4),
    "8b-nf4-4096x1-t4": ("llama-3.1-8b", "nf4", 4096, 1),
}
# A T4 emulated: its fp16 (autocast + GradScaler, as Trainer(fp16=True)) under a 15 GiB VRAM cap. notebookkit's
# default "auto" then plans for the cap (torch.cuda.set_per_process_memory_fraction, which the planner reads).
CONFIG_ARGS = {"8b-nf4-4096x1-t4": ["--dtype", "float16", "--memory-cap-gib", "15"]}
# Long rows: fewer steps (warm-up, timed) so a full run fits in one device call.
STEPS = {"8b-nf4-16384x1": (1, 3)}
SYSTEMS = ["hf", "compile", "liger", "unsloth", "notebookkit", "notebookkit-offload"]
NEEDS = {"liger": "liger_kernel", "unsloth": "unsloth"}
# Extra seconds for a system's first row in a run: Unsloth compiles its patched modules on first import
# (over a minute on a fresh machine), which is not training time and must not eat the row's --timeout.
FIRST_ROW_GRACE_S = {"unsloth": 120, "compile": 60}
# Variants of our system: (train_step --system, extra arguments). "notebookkit" is the default a user
# gets ("auto": the planner fits free VRAM, so on a 139 GiB card it keeps every activation);
# "notebookkit-offload-mlp" parks every offloaded layer's MLP gate/up outputs in host memory too, and
# "notebookkit-offload-mlp-card" the share the planner prices for this GPU's host link (what "auto" parks),
# "notebookkit-park" every offloaded layer of the "auto" plan; "notebookkit-spread" the "auto" plan with the
# planner's layout="spread" (offloaded layers among the kept ones, more of them parked), "-park0.75" with three
# in four of them parked (less traffic on the host link than the planner's share);
# "notebookkit-offload" is the memory-lean mode (layer inputs in pinned host memory), the mode Unsloth
# runs; "notebookkit-lean" adds offload_embedding=True (the input embedding table in host memory, untied
# models); "notebookkit-<N>GiB" asks the planner for the fastest plan under a cap of N GiB, and
# "notebookkit-fp8-<N>GiB" does the same with the FP8 forward, "notebookkit-spread-<N>GiB" with layout="spread"
# (a plan further under the T4's 15 GiB cap: headroom for the caching allocator, see host_waits' counters), and
# "notebookkit-lean-<N>GiB" with the input embedding table in host memory (#34's T4 row at no more than Unsloth's
# 7.03 GiB: the planner puts the 8B step at 6.05 GiB under a 7.03 GiB cap that way, and finds no plan without it).
# Suffixes on any system (SUFFIXES): "+expandable" runs it with PyTorch's expandable_segments allocator (what
# Unsloth sets on import), "+nogc" with Python's garbage collector off during the timed steps.
VARIANTS = {
    "notebookkit": ("notebookkit", []),
    "notebookkit-offload": ("notebookkit", ["--checkpointing", "offload"]),
    "notebookkit-recompute": ("notebookkit", ["--checkpointing", "true"]),
    "notebookkit-offload-mlp": ("notebookkit", ["--checkpointing", "offload_mlp"]),
    "notebookkit-offload-mlp-card": ("notebookkit", ["--checkpointing", "offload", "--park-fraction", "card"]),
    "notebookkit-park": ("notebookkit", ["--park-fraction", "1"]),
    "notebookkit-spread": ("notebookkit", ["--spread"]),
    "notebookkit-spread-park0.75": ("notebookkit", ["--spread", "--park-fraction", "0.75"]),
    "notebookkit-fp8": ("notebookkit", ["--fp8"]),
    "notebookkit-fp8-offload": ("notebookkit", ["--fp8", "--checkpointing", "offload"]),
    "notebookkit-lean": ("notebookkit", ["--checkpointing", "offload", "--offload-embedding"]),
    "notebookkit-lean-mlp": ("notebookkit", ["--checkpointing", "offload_mlp", "--offload-embedding"]),
    "notebookkit-fp8-lean": ("notebookkit", ["--fp8", "--checkpointing", "offload", "--offload-embedding"]),
}

SUFFIXES = {"+expandable": "--expandable-segments", "+nogc": "--no-gc"}


def resolve_system(system: str) -> tuple[str, list[str]]:
    """(train_step system, extra arguments) for a system name of the table."""
    for suffix, flag in SUFFIXES.items():
        if system.endswith(suffix):
            base, args = resolve_system(system[: -len(suffix)])
            return base, [*args, flag]
    if system in VARIANTS:
        return VARIANTS[system]
    if system.startswith("notebookkit-fp8-") and system.endswith("GiB"):
        return "notebookkit", ["--fp8", "--max-memory", system[len("notebookkit-fp8-"):]]
    if system.startswith("notebookkit-spread-") and system.endswith("GiB"):
        return "notebookkit", ["--spread", "--max-memory", system[len("notebookkit-spread-"):]]
    if system.startswith("notebookkit-lean-") and system.endswith("GiB"):
        return "notebookkit", ["--offload-embedding", "--max-memory", system[len("notebookkit-lean-"):]]
    if system.startswith("notebookkit-") and system.endswith("GiB"):
        return "notebookkit", ["--max-memory", system[len("notebookkit-"):]]
    return system, []


# Learning check (learning_verdict): the loss must fall by at least MIN_LOSS_DROP over the run (on random
# tokens it moved 0.1-0.2%) and by at least half as much as HF+PEFT's; the last loss must be within
# FINAL_LOSS_TOL of HF+PEFT's (the FP8 forward changes the forward numerics: 2%); the adapters' update
# (final lora_B) within MAX_LORA_B_REL_ERR of HF+PEFT's. One that never updated is 1.0 away, one that
# started from other LoRA A values about 1.4: a loose bound, to be tightened to a few times the spread
# between the peers (hf, compile, liger: the same math) once a run of record has measured it.
MIN_LOSS_DROP = 0.01
FINAL_LOSS_TOL = {"16-bit": 0.01, "fp8": 0.02}
MAX_LORA_B_REL_ERR = 0.5


def available(system: str) -> bool:
    module = NEEDS.get(system)
    return module is None or importlib.util.find_spec(module) is not None


def run_row(config: str, system: str, steps: int, timeout: int, extra: list[str], lora_b_path: str | None = None) -> dict:
    """Run one (configuration, system) row in its own process; ``lora_b_path``: where it saves its final lora_B."""
    shape, quant, seq, batch = CONFIGS[config]
    row = dict(config=config, system=system, shape=shape, quant=quant, seq=seq, batch=batch)
    base_system, variant_args = resolve_system(system)
    if not available(base_system):
        return row | dict(status="not installed")
    warmup, steps = STEPS.get(config, (2, steps))
    cmd = [sys.executable, os.path.join(HERE, "train_step.py"), "--system", base_system, "--shape", shape,
           "--quant", quant, "--seq", str(seq), "--batch", str(batch), "--warmup", str(warmup), "--steps", str(steps),
           *CONFIG_ARGS.get(config, []), *variant_args, *extra, *(["--save-lora-b", lora_b_path] if lora_b_path else [])]
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


def learning_verdict(row: dict, hf_row: dict | None) -> str:
    """"pass", "FAIL: <reasons>", or "–" with why there is nothing to check, for one ok row.

    Checks (NaN fails each): the loss fell by at least ``MIN_LOSS_DROP``; against ``hf_row`` (the
    same configuration's HF+PEFT row, when it ran): fell by at least half as much, last loss within
    ``FINAL_LOSS_TOL``, ``lora_B`` update within ``MAX_LORA_B_REL_ERR`` (``row["lora_b_vs_hf"]``).
    """
    if "losses" not in row:
        return "– (random tokens: nothing to learn)"
    problems = []
    drop = loss_drop(row["losses"])
    if not drop >= MIN_LOSS_DROP:
        problems.append(f"loss fell {drop:.2%} (< {MIN_LOSS_DROP:.0%})")
    if hf_row is not None and hf_row is not row and "losses" in hf_row:
        hf_drop = loss_drop(hf_row["losses"])
        if not drop >= 0.5 * hf_drop:
            problems.append(f"loss fell {drop:.2%}, hf {hf_drop:.2%}")
        tol = FINAL_LOSS_TOL["fp8" if "fp8" in row["system"] else "16-bit"]
        gap = abs(row["loss_last"] - hf_row["loss_last"]) / abs(hf_row["loss_last"])
        if not gap <= tol:
            problems.append(f"last loss {gap:.2%} from hf's (> {tol:.0%})")
        lora = row.get("lora_b_vs_hf")
        if lora is not None and not lora["rel_err"] <= MAX_LORA_B_REL_ERR:
            init = "" if lora.get("same_init", True) else ", other LoRA A init"
            problems.append(f"lora_B {lora['rel_err']:.2f} from hf's{init}")
    return "pass" if not problems else "FAIL: " + "; ".join(problems)


def _lora_cell(row: dict) -> str:
    lora = row.get("lora_b_vs_hf")
    if lora is None:
        return "–"
    return f"{lora['rel_err']:.3f} (cos {lora['cosine']:.3f}){'' if lora.get('same_init', True) else ', other init'}"


NF4_HF_NOTE = ("† NF4 rows: `hf` (and `compile`, `liger`) run PEFT's `prepare_model_for_kbit_training`, which casts the "
               "embeddings, the norms and the LM head to fp32 (how most plain QLoRA notebooks run it); the × hf ratio "
               "includes the cost of those fp32 layers.")


def median_processes(rows: list[dict]) -> list[dict]:
    """One row a (configuration, system): its median process by step time where ``--repeats`` ran it more than once
    (:func:`process_rounds.median_rows`), configurations in their order."""
    configs = list(dict.fromkeys(r["config"] for r in rows))
    return [row for c in configs for row in median_rows([r for r in rows if r["config"] == c], "s_step")]


def markdown(rows: list[dict]) -> str:
    """The table (a row a configuration and system: its median process when it ran in several rounds), then each
    repeated configuration's process times and round-by-round ratios, then each timed step's host record."""
    runs, rows = rows, median_processes(rows)
    lines = ["| config | system | tokens/s | median step tok/s | × hf | × unsloth | peak GiB | predicted GiB | activation plan "
             "| loss first → last | loss fall | lora_B vs hf | learning check | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r.get("status") == "ok"
        ref = {s: x.get("tok_s") for x in rows if x["config"] == r["config"] and x.get("status") == "ok" for s in [x["system"]]}
        hf_row = next((x for x in rows if x["config"] == r["config"] and x["system"] == "hf" and x.get("status") == "ok"), None)
        mark = "†" if r.get("quant") == "nf4" else ""
        ratio = lambda s: f"{r['tok_s'] / ref[s]:.2f}{mark if s == 'hf' else ''}" if ok and ref.get(s) else "–"  # noqa: E731
        fall = f"{loss_drop(r['losses']):.1%}" if ok and r.get("losses") else "–"
        lines.append(
            f"| {r['config']} | {r['system']} | {r['tok_s']:,.0f} | "
            f"{format(r['tok_s_median'], ',.0f') if r.get('tok_s_median') else '–'} | {ratio('hf')} | {ratio('unsloth')} | "
            f"{r['peak_gib']:.2f} | {r.get('predicted_gib') or '–'} | {r.get('plan') or '–'} | "
            f"{r['loss_first']:.4f} → {r['loss_last']:.4f} | {fall} | {_lora_cell(r)} | {learning_verdict(r, hf_row)} | ok |"
            if ok else f"| {r['config']} | {r['system']} | – | – | – | – | – | – | – | – | – | – | – | {r['status']} |"
        )
    if any(r.get("quant") == "nf4" and r.get("status") == "ok" for r in rows):
        lines += ["", NF4_HF_NOTE]
    for config in dict.fromkeys(r["config"] for r in runs):
        spread = spread_lines([r for r in runs if r["config"] == config], "s_step", "unsloth", "s", ".3f")
        lines += [spread[0], f"{config}: {spread[1]}", *spread[2:]] if spread else []
    return "\n".join(lines + step_lines(runs))


def step_lines(rows: list[dict]) -> list[str]:
    """Each timed step of the rows that recorded their host waits (``host_waits``): the GPU's step time, then the
    host's waits on the GPU, its read at the step's end (rows that recorded it), its garbage-collector pauses in
    that step, in ms, and the allocator counters the step moved."""
    out = []
    for r in rows:
        if r.get("status") == "ok" and r.get("step_host"):
            cells = [f"{t:.3f} s ({step_host_cell(h)})" for t, h in zip(r["step_s"], r["step_host"])]
            run_no = f" (run {r['repeat'] + 1})" if r.get("repeat") else ""
            out.append(f"- {r['config']} {r['system']}{run_no}{' (gc off)' if r.get('no_gc') else ''}: " + "; ".join(cells))
    if not out:
        return []
    return ["", "Per timed step: the step's GPU time (host waits on the GPU, the read at the step's end, "
            "garbage-collector pauses, the host's CPU time, involuntary context switches and the machine's steal "
            "time, allocator counters):", *out]


def step_host_cell(h: dict) -> str:
    """One timed step's host record (``host_waits.HostWaits``) in a few words, in ms."""
    parts = [f"waits {h['sync_s'] * 1e3:.0f} ms in {h['syncs']}"]
    if "read_s" in h:
        parts.append(f"end read {h['read_s'] * 1e3:.0f} ms")
    parts.append(f"gc {h['gc_s'] * 1e3:.1f} ms")
    if "cpu_s" in h:  # rows from session 41 on: the host's contention counters
        parts.append(f"cpu {h['cpu_s'] * 1e3:.0f} ms, preempted {h['preempted']:.0f}"
                     + (f", steal {h['steal_s'] * 1e3:.0f} ms" if "steal_s" in h else ""))
    parts += [f"{name} {n}" for name, n in sorted(h.get("counts", {}).items())]
    return ", ".join(parts)


def compare_lora_with_hf(rows: list[dict], paths: dict[str, str]) -> None:
    """Add ``lora_b_vs_hf`` (rel_err, cosine, worst tensor, same_init) to each ok row of one
    configuration whose final lora_B was saved (``paths``: system -> .pt file, the first round's), against the hf
    row's."""
    import torch

    hf = next((r for r in rows if r["system"] == "hf" and r.get("status") == "ok"), None)
    if hf is None or not os.path.exists(paths.get("hf", "")):
        return
    ref = torch.load(paths["hf"])
    for r in rows:
        if r is hf or r.get("status") != "ok" or r.get("repeat", 0) or not os.path.exists(paths.get(r["system"], "")):
            continue
        ours = torch.load(paths[r["system"]])
        if ours.keys() != ref.keys():
            r["lora_b_vs_hf"] = dict(rel_err=math.inf, cosine=math.nan, worst=("other tensor names", math.inf))
            continue
        diff = update_difference(ours, ref)
        a, b = r.get("lora_a_init_sum"), hf.get("lora_a_init_sum")
        same_init = a is not None and b is not None and abs(a - b) <= 1e-6 * (1 + abs(b))
        r["lora_b_vs_hf"] = dict(rel_err=round(diff["rel_err"], 5), cosine=round(diff["cosine"], 5),
                                 worst=[diff["worst"][0], round(diff["worst"][1], 5)], same_init=same_init)


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
        "(2 + 4 unless the call says otherwise; 1 + 3 for the 16k row), one process per row. Token stream: rows walking one "
        "fixed cycle of 32 token ids (`learning_check.cycle_stream`), so that the loss falls within the run; the kernels' "
        "work does not depend on token values (runs of record up to session 9 used uniformly random tokens). "
        "Learning check: the loss fell at least 1% and at least half as much as HF+PEFT's, the last loss is within 1% of "
        "HF+PEFT's (FP8 forward: 2%), and the adapters' update (final `lora_B`) is within 0.5 relative of HF+PEFT's "
        "(never updated: 1.0). tokens/s is over the whole "
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
    bar_chart(median_processes(rows), stem + ".png")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--merge", nargs="+", default=None, help="merge earlier .json results into one table")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configuration names")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every system this many times, a process each, in rounds (benchmarks/process_rounds.py): "
                         "the table shows each one's median process, and under it every process and the ratio to "
                         "Unsloth round by round")
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
    lora_dir = stem + "-lora"  # each row's final lora_B, removed once compared with the hf row's
    for config in args.only.split(","):
        config_rows, paths = [], {}
        os.makedirs(lora_dir, exist_ok=True)
        for system, repeat in rounds(args.systems.split(","), args.repeats):
            base = resolve_system(system)[0]  # the first row of a system compiles its patches
            grace = 0 if base in started else FIRST_ROW_GRACE_S.get(base, 0)
            started.add(base)
            if repeat == 0:  # the first round's adapters are compared with hf's
                paths[system] = os.path.join(lora_dir, f"{config}-{system}.pt")
            row = run_row(config, system, args.steps, args.timeout + grace, extra,
                          lora_b_path=paths[system] if repeat == 0 else None) | dict(repeat=repeat)
            config_rows.append(row)
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(stem + ".json", "w") as fh:
                json.dump(rows, fh, indent=1)
        compare_lora_with_hf(config_rows, paths)
        shutil.rmtree(lora_dir, ignore_errors=True)
    print(write_results(rows, stem))


if __name__ == "__main__":
    main()
