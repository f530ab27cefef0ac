"""benchmarks/moe_step.py on a CPU: one --tiny run of the harness (tiny gpt-oss: notebookkit, hf, a missing
Unsloth, the capped row without a peer peak, the T4-emulation row), and the pure parts: the table's ratios,
a system's refusal as a row, and the learning check failing when the loss does not fall."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import moe_step  # noqa: E402
import process_rounds  # noqa: E402


def test_tiny_run_writes_rows_and_tables(tmp_path):
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "moe_step.py"), "--tiny", "--shapes", "gpt-oss-20b",
         "--systems", "notebookkit-capped,unsloth,notebookkit,hf", "--t4-systems", "notebookkit",
         "--seq", "32", "--warmup", "1", "--steps", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [result] = tmp_path.glob("*-moe-step-tiny.json")
    rows = {(r["table"], r["system"]): r for r in json.loads(result.read_text())["rows"]}
    # the capped row runs after Unsloth's, whose peak it would take
    assert list(rows) == [("gpt-oss-20b", s) for s in ("unsloth", "notebookkit-capped", "notebookkit", "hf")] + \
        [("t4", "notebookkit")]
    if importlib.util.find_spec("unsloth") is None:
        assert rows["gpt-oss-20b", "unsloth"]["status"] == "not installed (unsloth)"
        assert rows["gpt-oss-20b", "notebookkit-capped"]["status"] == "skipped: no unsloth peak to cap at"
    ours, hf, t4 = rows["gpt-oss-20b", "notebookkit"], rows["gpt-oss-20b", "hf"], rows["t4", "notebookkit"]
    assert ours["status"] == hf["status"] == t4["status"] == "ok", (ours, hf, t4)
    # the same weights, adapters and tokens: the same first loss and trainable count
    assert ours["trainable"] == hf["trainable"] > 0 and abs(ours["losses"][0] - hf["losses"][0]) <= 1e-4 * hf["losses"][0]
    assert len(ours["losses"]) == 3 and ours["tok_s"] > 0 and ours["peak_gib"] > 0 and ours["expert_gib"] > 0
    assert ours["predicted_gib"] > 0 and "predicted_gib" not in hf
    assert t4["skipped_steps"] == 0 and len(t4["scales"]) == 3 and t4["first_step_finite"] and t4["host_rss_peak_gib"] > 0
    table = result.with_suffix(".md").read_text()
    assert "## notebookkit/tiny-gpt_oss" in table and "## T4 emulation" in table and "not installed (unsloth)" in table
    assert (tmp_path / result.name.replace(".json", "-logs") / "gpt-oss-20b-hf.log").exists()


def test_stacked_expert_adapters_train_what_unsloth_trains():
    """``--expert-adapters stacked`` on tiny Qwen3-MoE: notebookkit and hf adapt gate_up and down at rank r (Unsloth's
    count, ``L E r (H + 2I + I + H)`` on the experts), where PEFT's mapping puts gate_up at 2r."""
    import torch
    from transformers import AutoConfig

    folder = moe_step.model_folder("qwen3-30b-a3b", 2, tiny=True)
    c = AutoConfig.from_pretrained(folder)
    L, E, H, I = c.num_hidden_layers, c.num_experts, c.hidden_size, c.moe_intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attention = L * moe_step.R * ((H + q) + 2 * (H + kv) + (q + H))  # q, k, v, o: r (in + out) each
    experts_at_r = L * E * moe_step.R * (H + 2 * I + I + H)

    def trainable(system: str, adapters: str) -> int:
        model = moe_step.load_system(system, folder, "cpu", torch.float32, "none", 32, 1, None, adapters)
        return sum(p.numel() for p in model.parameters() if p.requires_grad)

    stacked = trainable("notebookkit", "stacked")
    assert stacked == trainable("hf", "stacked") == attention + experts_at_r
    assert trainable("notebookkit", "peft") - stacked == L * E * moe_step.R * (H + 2 * I)  # gate_up's second r


def _row(system: str, tok_s: float, peak: float, losses=(12.0, 11.0, 10.0), table: str = "gpt-oss-20b", **extra) -> dict:
    return dict(dict(table=table, system=system, status="ok", tok_s=tok_s, step_ms=2048 / tok_s * 1e3, peak_gib=peak,
                     losses=list(losses), loss_first=losses[0], loss_last=losses[-1], trainable=100, expert_gib=1.0,
                     expert_format="4-bit"), **extra)


def test_table_ratios_and_the_capped_rows_cap():
    rows = [_row("unsloth", 1000.0, 8.0), _row("notebookkit", 1500.0, 10.0, predicted_gib=9.9, plan="4 keep"),
            _row("notebookkit-capped", 1300.0, 7.5), _row("hf", 500.0, 20.0, expert_format="bfloat16")]
    table = "\n".join(moe_step.step_table(rows))
    assert "| notebookkit | 1,500 | 1365.3 | 1.50 | 3.00† | 10.00 | 1.25 | 9.90 |" in table
    assert "| notebookkit-capped | 1,300 | 1575.4 | 1.30 | 2.60† | 7.50 | 0.94 |" in table
    assert "| hf | 500 | 4096.0 | 0.50 | 1.00† | 20.00 | 2.50 | – | – | bfloat16 1.00 GiB |" in table
    assert moe_step.capped_memory(rows, None) == ("8.000GiB", "unsloth's peak")
    assert moe_step.capped_memory(rows, 6.5) == ("6.500GiB", "--cap-gib 6.5")
    assert moe_step.capped_memory(rows[1:], None)[0] is None
    assert moe_step.order_systems(["notebookkit-capped", "hf", "unsloth"]) == ["hf", "unsloth", "notebookkit-capped"]
    # the T4 rows right after their shape's step rows, or last
    order = moe_step.run_order(["gpt-oss-20b", "qwen3-30b-a3b"], ["hf"], ["notebookkit"], "gpt-oss-20b")
    assert order == [("gpt-oss-20b", "hf", False), ("gpt-oss-20b", "notebookkit", True), ("qwen3-30b-a3b", "hf", False)]
    assert moe_step.run_order(["qwen3-30b-a3b"], ["hf"], ["notebookkit"], "gpt-oss-20b")[-1] == \
        ("gpt-oss-20b", "notebookkit", True)
    # a table without an unsloth or hf row shows no ratio instead of dividing by nothing
    alone = "\n".join(moe_step.step_table([_row("notebookkit", 1500.0, 10.0)]))
    assert "| notebookkit | 1,500 | 1365.3 | – | – | 10.00 | – |" in alone


def test_repeated_rows_show_their_median_process_and_the_round_by_round_ratios():
    order = moe_step.run_order(["qwen3-30b-a3b"], ["unsloth", "notebookkit"], [], "gpt-oss-20b", repeats=2)
    assert [s for _, s, _ in order] == ["unsloth", "notebookkit", "unsloth", "notebookkit"]
    rows = [_row("unsloth", 2048 / 0.050, 4.2, repeat=0), _row("notebookkit", 2048 / 0.040, 4.1, repeat=0),
            _row("unsloth", 2048 / 0.048, 4.2, repeat=1), _row("notebookkit", 2048 / 0.060, 4.1, repeat=1),
            _row("unsloth", 2048 / 0.052, 4.2, repeat=2), _row("notebookkit", 2048 / 0.044, 4.1, repeat=2),
            dict(table="gpt-oss-20b", system="hf", status="failed (exit 1): boom", repeat=0)]
    table = "\n".join(moe_step.step_table(rows))
    # each system's median process (50 and 44 ms), not its fastest one or a blend of them
    assert "| unsloth | 40,960 | 50.0 | 1.00 |" in table and "| notebookkit | 46,545 | 44.0 | 1.14 |" in table
    assert table.count("| notebookkit |") == 1 and "failed (exit 1): boom" in table
    ratios = process_rounds.paired_ratios(rows, "notebookkit", "unsloth", "step_ms")
    assert ratios == pytest.approx([50 / 40, 48 / 60, 52 / 44])
    spread = moe_step.markdown(rows, dict(repeats=3, expert_adapters="stacked", layers=4))
    assert "one process per row, every system 3 times in rounds (the table: its median process)." in spread
    assert "unsloth 50.0, 48.0, 52.0; notebookkit 40.0, 60.0, 44.0." in spread
    assert "notebookkit × unsloth, round by round: 1.25, 0.80, 1.18 (median 1.18)." in spread
    assert process_rounds.spread_lines(rows[:2], "step_ms", "unsloth", "ms") == []  # one process a system
    # each timed step with the host's record (host_waits), where the row kept one
    host = dict(sync_s=0.0, syncs=0, gc_s=0.0, read_s=0.0, cpu_s=0.041, preempted=3, steal_s=0.01, counts={})
    rows[3].update(step_ms_all=[60.0, 58.5], step_host=[host, dict(host, preempted=0)])
    assert moe_step.step_host_lines(rows)[2] == (
        "- notebookkit (run 2): 60.0 ms (waits 0 ms in 0, end read 0 ms, gc 0.0 ms, cpu 41 ms, preempted 3, steal 10 ms); "
        "58.5 ms (waits 0 ms in 0, end read 0 ms, gc 0.0 ms, cpu 41 ms, preempted 0, steal 10 ms)")
    assert len(moe_step.step_host_lines(rows)) == 3 and moe_step.step_host_lines(rows[:3]) == []
    # the child is told its round and the profile folder (a parent's --profile reached no child before)
    args = types.SimpleNamespace(layers=4, seq=2048, batch=1, quant="nf4", warmup=2, steps=5, lr=2e-4, t4_cap_gib=15.0,
                                 expert_adapters="stacked", profile="prof", tiny=False)
    cmd = moe_step.child_command("notebookkit", "qwen3-30b-a3b", args, repeat=2)
    assert cmd[cmd.index("--repeat") + 1] == "2" and cmd[cmd.index("--profile") + 1] == os.path.abspath("prof")


def test_a_switched_system_sets_its_switch_in_its_own_process_only(monkeypatch):
    seen = {}

    def fake_run(cmd, env, **_kwargs):
        seen[cmd[cmd.index("--label") + 1]] = (cmd[cmd.index("--system") + 1], env.get("NOTEBOOKKIT_MOE_DEVICE_BOUNDS"))
        return types.SimpleNamespace(stdout='RESULT {"status": "ok"}', stderr="", returncode=0)

    monkeypatch.delenv("NOTEBOOKKIT_MOE_DEVICE_BOUNDS", raising=False)
    monkeypatch.setattr(moe_step.subprocess, "run", fake_run)
    args = types.SimpleNamespace(layers=4, seq=2048, batch=1, quant="nf4", warmup=2, steps=5, lr=2e-4, t4_cap_gib=15.0,
                                 expert_adapters="stacked", profile=None, tiny=False, log_dir=None)
    for system in ("notebookkit-device-bounds", "notebookkit"):
        assert moe_step.run_child(system, "qwen3-30b-a3b", "qwen3-30b-a3b", args, 60.0)["status"] == "ok"
    assert seen == {"notebookkit-device-bounds": ("notebookkit", "1"), "notebookkit": ("notebookkit", None)}


def test_a_refusal_at_load_is_a_row_with_its_message(monkeypatch, tmp_path):
    message = "Unsloth: this gpt-oss checkpoint stores fused experts, and in float16 its fused 4-bit experts would overflow."

    def refuse(*_args, **_kwargs):
        raise NotImplementedError(message)

    monkeypatch.setattr(moe_step, "load_system", refuse)
    args = types.SimpleNamespace(system="notebookkit", label="unsloth", shape="gpt-oss-20b", layers=4, seq=32, batch=1,
                                 quant="none", t4=True, t4_cap_gib=15.0, max_memory=None, tiny=True, warmup=1, steps=2,
                                 lr=1e-3, expert_adapters="peft")
    row = moe_step.run_system(args)
    assert row["status"] == f"refused at load: NotImplementedError: {message}" and row["system"] == "unsloth"
    assert row["host_rss_peak_gib"] >= row["host_anon_peak_gib"] > 0
    row["table"] = "t4"
    host = f"{row['host_rss_peak_gib']:.2f} ({row['host_anon_peak_gib']:.2f})"
    assert f"| unsloth | – | – | – | – | – | – | {host} |" in "\n".join(moe_step.t4_table([row]))
    assert message in moe_step.markdown([row], dict(tiny=True, t4_cap_gib=15.0))
    # a child that died without a RESULT line: the reason from its output, an OOM named as such
    crashed = moe_step.parse_child("", "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate", 1)
    assert crashed["status"].startswith("out of memory: torch.OutOfMemoryError: CUDA out of memory")
    failed = moe_step.parse_child("", "Traceback ...\nValueError: bad shape", 1)
    assert failed["status"] == "failed (exit 1): ValueError: bad shape"


@pytest.mark.parametrize("losses, hf_losses, verdict", [
    ((12.0, 11.5, 11.0), None, "pass"),
    ((12.0, 12.0, 12.0), None, "FAIL: loss fell 0.00% (< 1%)"),  # adapters that never updated
    ((12.0, 12.1, 12.2), None, "FAIL: loss fell -1.67% (< 1%)"),
    ((12.0, math.nan, math.nan), None, "FAIL: loss fell nan% (< 1%)"),
    ((12.0, 11.8, 11.5), (12.0, 11.0, 10.0), "FAIL: loss fell 4.17%, hf 16.67%; last loss 15.00% from hf's (> 5%)"),
    ((12.0, 10.9, 10.2), (12.0, 11.0, 10.0), "pass"),
])
def test_learning_check(losses, hf_losses, verdict):
    hf = _row("hf", 500.0, 20.0, losses=hf_losses) if hf_losses else None
    assert moe_step.learning_verdict(_row("notebookkit", 1.0, 1.0, losses=losses), hf) == verdict
