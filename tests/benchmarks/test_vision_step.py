"""CPU smoke test of benchmarks/vision_step.py: the parent runs each system in its own process on the tiny
Qwen2.5-VL (fp32), writes JSON + markdown, and reports a missing package as "not installed".

The systems train on the same batch from the same weights and LoRA seed, so their first-step losses
agree (to the fused path's rounding, ~1e-7 relative): a row that trained on other inputs or other
adapters would differ."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


def test_vision_step_tiny_on_cpu(tmp_path):
    # the repository first, keeping the PYTHONPATH that may provide the packages (the GPU recipe's .site)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    systems = "notebookkit,hf,unsloth"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "vision_step.py"), "--tiny", "--systems", systems,
         "--batch", "2", "--warmup", "1", "--steps", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [result] = [p for p in os.listdir(tmp_path) if p.endswith(".json")]
    rows = {r["system"]: r for r in json.load(open(tmp_path / result))["rows"]}
    assert rows["notebookkit"]["status"] == rows["hf"]["status"] == "ok", rows
    ours, hf = rows["notebookkit"], rows["hf"]
    assert ours["image_tokens"] == hf["image_tokens"] == 2 * 16 and ours["trainable"] == hf["trainable"] > 0
    assert abs(ours["losses"][0] - hf["losses"][0]) <= 1e-4 * hf["losses"][0]
    assert ours["fused"]["fused CE loss"] and ours["fused"]["attention"] and hf["fused"] is None
    assert ours["plan"] == "all keep" and hf["plan"] is None  # no checkpointing on the CPU
    assert all(r["s_step"] > 0 and r["peak_gib"] > 0 for r in (ours, hf))
    # the memory model's prediction beside the measurement, for notebookkit's rows only
    assert 0 < ours["predicted_gib"] < ours["peak_gib"] and hf["predicted_gib"] is None
    if "not installed" in rows["unsloth"]["status"]:
        assert rows["unsloth"]["status"] == "not installed (unsloth)"
    table = open(tmp_path / result.replace(".json", ".md")).read()
    assert "| notebookkit |" in table and "| hf |" in table and "| unsloth |" in table
    assert "predicted GiB" in table and f"| {ours['predicted_gib']:.2f} |" in table
    # every row is in the log as it finishes (a run cut short by a device call's limit keeps the rows done)
    logged = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    assert [r["system"] for r in logged] == systems.split(",") and logged[0]["s_step"] == ours["s_step"]


def test_runs_split_over_calls_are_combined(tmp_path):
    import time
    import types

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import vision_step

    prefix = str(tmp_path / "2026-12-01-GPU-vision-qwen2.5-vl-7b")
    row = dict(shape="qwen2.5-vl-7b", device="GPU", seq=300, image_tokens=1024, trainable=1, losses=[1.0], peak_gib=9.0)
    runs = [[dict(row, system="notebookkit", status="ok", s_step=1.0), dict(row, system="hf", status="ok", s_step=2.0)],
            [dict(system="unsloth", status="failed (exit 1): boom"), dict(row, system="hf", status="ok", s_step=4.0),
             dict(row, system="notebookkit-lean-9GiB", status="ok", s_step=0.5, plan="12 keep, 16 offload")]]
    for i, rows in enumerate(runs):
        json.dump({"rows": rows}, open(f"{prefix}-run{i}.json", "w"))
        time.sleep(0.01)
    args = types.SimpleNamespace(shape="qwen2.5-vl-7b", quant="nf4", batch=4, image_size=448, warmup=2, steps=3)
    table = vision_step.combine_runs(prefix, args)
    merged = {r["system"]: r for r in json.load(open(prefix + "-all.json"))["rows"]}
    assert merged["hf"]["s_step"] == 4.0 and merged["unsloth"]["status"].startswith("failed")
    assert "| notebookkit | 1.000 | 4.00 |" in table and "boom" in table
    assert "| notebookkit-lean-9GiB | 0.500 | 8.00 | 9.00 |  | 12 keep, 16 offload |" in table
    assert list(merged) == ["notebookkit", "notebookkit-lean-9GiB", "hf", "unsloth"]  # capped rows beside their row
    assert vision_step.combine_runs(str(tmp_path / "other"), args) is None


def test_repeated_systems_show_their_median_process_and_the_ratio_to_unsloth_round_by_round():
    import types

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import vision_step

    row = dict(shape="qwen2.5-vl-7b", device="GPU", seq=300, image_tokens=1024, trainable=1, losses=[1.0], peak_gib=6.1,
               status="ok")
    steps = {"notebookkit-lean": (0.72, 1.09, 0.80), "unsloth": (0.84, 0.86, 0.83)}  # s / step, rounds 1-3
    rows = [dict(row, system=s, s_step=steps[s][i], repeat=i) for i in range(3) for s in ("notebookkit-lean", "unsloth")]
    args = types.SimpleNamespace(shape="qwen2.5-vl-7b", quant="nf4", batch=4, image_size=448, warmup=2, steps=3,
                                 repeats=3)
    table = vision_step.markdown(rows, args)
    assert "| notebookkit-lean | 0.800 |" in table and "| unsloth | 0.840 |" in table  # each one's median process
    assert table.count("| notebookkit-lean |") == 1 and "every system 3 times, a process each, in rounds" in table
    assert "notebookkit-lean 0.720, 1.090, 0.800; unsloth 0.840, 0.860, 0.830." in table
    assert "notebookkit-lean × unsloth, round by round: 1.17, 0.79, 1.04 (median 1.04)." in table
    assert vision_step.systems_tag(rows) == "notebookkit-lean_unsloth"  # the result files name each system once


def test_capped_rows_name_the_planner_cap():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import argparse

    import pytest
    import vision_step

    assert vision_step.capped("notebookkit-lean-9GiB") == ("notebookkit-lean", "9GiB")
    assert vision_step.capped("notebookkit-7.5GiB") == ("notebookkit", "7.5GiB")
    assert vision_step.capped("notebookkit-lean") == ("notebookkit-lean", None)
    assert vision_step.capped("unsloth-9GiB") == ("unsloth-9GiB", None)  # only our rows take a cap
    with pytest.raises(argparse.ArgumentTypeError, match="unknown system"):
        vision_step.system_name("notebookkit-lean-manyGiB")
    # a capped row is planned for its batch, after a setup without the cap; --max-memory alone plans at setup
    assert vision_step.setup_max_memory("6GiB", None) is None
    assert vision_step.setup_max_memory(None, "7GiB") == "7GiB"
