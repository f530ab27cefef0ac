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
    env = dict(os.environ, PYTHONPATH=ROOT)
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
    assert all(r["s_step"] > 0 and r["peak_gib"] > 0 for r in (ours, hf))
    if "not installed" in rows["unsloth"]["status"]:
        assert rows["unsloth"]["status"] == "not installed (unsloth)"
    table = open(tmp_path / result.replace(".json", ".md")).read()
    assert "| notebookkit |" in table and "| hf |" in table and "| unsloth |" in table
