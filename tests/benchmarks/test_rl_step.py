"""benchmarks/rl_step.py on a CPU: the --tiny run writes one row per (task, system) with its times, peak and
profile, reports a missing Unsloth instead of dropping it, and the table's ratios come from the rows."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import rl_step  # noqa: E402


def test_tiny_run_writes_rows_and_table(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rl_step.py"), "--tiny", "--out", str(tmp_path),
                           "--systems", "notebookkit,trl,unsloth", "--profile", str(tmp_path / "prof"),
                           "--memory-history"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(next(tmp_path.glob("*-rl-step-tiny.json")).read_text())
    assert [(r["task"], r["system"]) for r in rows] == [
        (t, s) for t in ("grpo", "dpo") for s in ("notebookkit", "trl", "unsloth")]
    for row in rows:
        if row["system"] == "unsloth" and importlib.util.find_spec("unsloth") is None:
            assert row["status"].startswith("not installed"), row
            continue
        assert row["status"] == "ok", row
        # warm-up, timed, profiled, under the allocator's history
        assert row["step_s"] > 0 and row["peak_gib"] > 0 and len(row["losses"]) == 4
        report = (tmp_path / "prof" / row["profile"]).read_text()
        assert f"# {row['task'].upper()} step of {row['system']}: the training half, profiled (step 3" in report
        memory = (tmp_path / "prof" / row["memory"]).read_text()
        assert "under the allocator's history (step 4" in memory and "no CUDA here" in memory
        if row["task"] == "grpo":
            assert row["generate_calls"] == 4 and 0 < row["generate_s"] < row["step_s"]
            # the step's peak: its generation's or the rest's (host RSS here), whichever is higher
            assert row["peak_gib"] == max(row["generate_peak_gib"], row["rest_peak_gib"]) > 0
            assert abs(row["generate_s"] + row["rest_s"] - row["step_s"]) < 2e-3
            assert row["completion_tokens"] == 2 * 4 * 16
    assert "logged_times" in rows[0]  # notebookkit's own split of the step
    for row in rows:  # notebookkit's rows ran the fused loss: no LM-head forward in training, no fallback
        if row["system"] == "notebookkit":
            assert row["fused_path"] == {"lm_head_forwards_in_training": 0, "fallbacks": []}, row
            assert row["predicted_gib"] > 0  # the memory model's peak for the same step, beside the measured one
        elif row["status"] == "ok":
            assert "fused_path" not in row
    table = next(tmp_path.glob("*-rl-step-tiny.md")).read_text()
    assert "## GRPO: llama-tiny" in table and "## DPO: llama-tiny" in table and "not installed" in table


def test_table_ratios():
    base = dict(shape="s", quant="nf4", prompts=2, generations=8, new_tokens=512, gpu="G", status="ok")
    rows = [
        dict(base, task="grpo", system="notebookkit", step_s=2.0, generate_s=1.5, rest_s=0.5, peak_gib=10.0),
        dict(base, task="grpo", system="unsloth", step_s=5.0, generate_s=4.0, rest_s=1.0, peak_gib=12.0),
        dict(base, task="dpo", system="notebookkit", pairs=2, prompt_len=256, answer_len=767, step_s=1.0, peak_gib=6.0),
        dict(base, task="dpo", system="trl", pairs=2, prompt_len=256, answer_len=767, step_s=2.0, peak_gib=15.0),
        dict(base, task="dpo", system="unsloth", pairs=2, prompt_len=256, answer_len=767, step_s=1.5, peak_gib=8.0),
    ]
    table = rl_step.markdown(rows)
    assert "| notebookkit | 2.00 | 1.50 | 0.50 | 10.00 | – | 2.50 | ok |" in table
    assert rl_step.split_peak(3.2, [2.9, 3.5]) == dict(generate_peak_gib=3.5, rest_peak_gib=3.2, peak_gib=3.5)
    rows[0] |= dict(generate_peak_gib=7.5, rest_peak_gib=10.0)  # which half of the step set its peak
    assert "| notebookkit | 2.00 | 1.50 | 0.50 | 10.00 (7.50 / 10.00) | – | 2.50 | ok |" in rl_step.markdown(rows)
    assert "| notebookkit | 1.00 | 6.00 | – | 0.40 | 1.50 | ok |" in table
    assert "| trl | 2.00 | 15.00 | – | 1.00 | 0.75 | ok |" in table


def test_repeated_rows_show_their_median_process_and_the_ratio_round_by_round():
    base = dict(shape="s", quant="bf16", prompts=2, generations=8, new_tokens=512, gpu="G", status="ok", task="grpo",
                generate_s=1.0, rest_s=0.5, peak_gib=3.6)
    steps = {"notebookkit-lean": (2.46, 1.90, 2.10), "unsloth": (4.42, 4.60, 4.30)}  # s a step, rounds 1-3
    rows = [dict(base, system=s, step_s=steps[s][i], repeat=i) for i in range(3) for s in steps]
    table = rl_step.markdown(rows)
    # each one's median process (2.10 and 4.42 s), the ratio between them: 4.42 / 2.10
    assert table.count("| notebookkit-lean |") == 1
    assert "| notebookkit-lean | 2.10 | 1.00 | 0.50 | 3.60 | – | 2.10 | ok |" in table
    assert "| unsloth | 4.42 | 1.00 | 0.50 | 3.60 | – | 1.00 | ok |" in table
    assert "notebookkit-lean 2.46, 1.90, 2.10; unsloth 4.42, 4.60, 4.30." in table
    assert "notebookkit-lean × unsloth, round by round: 1.80, 2.42, 2.05 (median 2.05)." in table


def test_a_run_past_its_budget_skips_the_rest_and_keeps_its_table(tmp_path):
    import types

    now = [0.0]

    def run(system, task, tiny, out, timeout, site, child_args):  # each row's process takes 50 s of the clock
        given.append(timeout)
        assert child_args == ()  # no --profile
        tables.append((tmp_path / "run.md").exists())  # the rows before this one already in the table
        now[0] += 50
        return dict(task=task, system=system, shape="s", quant="bf16", prompts=2, generations=8, new_tokens=512,
                    gpu="G", status="ok", step_s=2.0 if system == "notebookkit-lean" else 5.0, generate_s=1.0,
                    rest_s=0.5, peak_gib=3.6)

    given: list[int] = []
    tables: list[bool] = []
    args = types.SimpleNamespace(tasks="grpo", systems="notebookkit-lean,unsloth", repeats=2, budget_s=130,
                                 timeout=900, tiny=False, out=str(tmp_path), unsloth_site=None, profile=None)
    rows = rl_step.run_all(args, str(tmp_path / "run"), run=run, clock=lambda: now[0])
    # 130 s: rows start at 0, 50 and 100 s (30 s left: the third gets only those); the fourth finds none left
    assert given == [130, 80, 30] and tables == [False, True, True]
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "skipped: the run's budget of 130 s ran out"]
    assert [r["repeat"] for r in rows] == [0, 0, 1, 1]
    table = (tmp_path / "run.md").read_text()  # written after every row, the last one included
    assert "| unsloth | – | – | – | – | – | – | skipped: the run's budget of 130 s ran out |" in table
    assert "|\n\nEach process's median step (s)" in table  # a blank line ends the table before the spread


def test_the_profile_covers_the_profiled_steps_training_half_only(monkeypatch):
    import types

    class FakeProfile:
        def __init__(self, log):
            self.log = log
            log.append("start")

        def stop(self):
            self.log.append("stop")

    def run_steps(after_generate: bool) -> tuple[list[str], bool]:
        log: list[str] = []
        profiled = rl_step.StepProfile(step=3, after_generate=after_generate)
        monkeypatch.setattr(profiled, "_begin", lambda: (log.append("begin"), setattr(profiled, "prof", FakeProfile(log))))
        callback = profiled.callback()
        for step in (1, 2, 3):
            callback.on_step_begin(None, types.SimpleNamespace(global_step=step - 1), None)
            for _ in range(2 if after_generate else 0):  # two generate calls in each GRPO step
                profiled.around_generate(starting=True)
                log.append(f"generate {step}")
                profiled.around_generate(starting=False)
            log.append(f"train {step}")
            callback.on_step_end(None, types.SimpleNamespace(global_step=step), None)
        return log, profiled.active

    log, active = run_steps(after_generate=True)
    # only step 3, from the end of its last generation: the profile begun after the first is dropped
    assert log == ["generate 1", "generate 1", "train 1", "generate 2", "generate 2", "train 2", "generate 3", "begin",
                   "start", "stop", "generate 3", "begin", "start", "train 3", "stop"] and not active
    log, _ = run_steps(after_generate=False)  # DPO: step 3 whole
    assert log == ["train 1", "train 2", "begin", "start", "train 3", "stop"]


def test_each_generate_call_records_its_peak_and_resets_the_counter(monkeypatch):
    import types

    events: list[str] = []
    monkeypatch.setattr(rl_step, "_peak_gib", lambda: events.append("read") or 2.5)
    monkeypatch.setattr(rl_step, "_reset_peak", lambda: events.append("reset"))
    model = types.SimpleNamespace(generate=lambda **kw: events.append("generate") or "ids")
    peaks: list = []
    calls = rl_step.time_generate(model, peaks=peaks)
    assert model.generate(max_new_tokens=4) == "ids" and model.generate() == "ids"
    # read after each call, then reset: the step's end reads only what followed the generation
    assert events == ["generate", "read", "reset"] * 2 and peaks == [2.5, 2.5] and len(calls) == 2


def test_the_memory_window_follows_the_profile_and_needs_its_folder():
    windows = rl_step.step_windows("grpo", "prof", memory_history=True)
    assert [(k, type(w).__name__, w.step, w.after_generate) for k, w in windows.items()] == [
        ("profile", "StepProfile", 3, True), ("memory", "StepMemory", 4, True)]
    assert list(rl_step.step_windows("dpo", "prof", memory_history=False)) == ["profile"]
    assert rl_step.step_windows("dpo", None, memory_history=True) == {}


def test_memory_history_without_a_profile_folder_is_refused_with_what_to_add(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rl_step.py"), "--tiny", "--out", str(tmp_path),
                           "--memory-history"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "add --profile DIR" in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())  # refused before any row ran


def test_the_peak_is_replayed_from_the_allocators_history():
    import memory_history as mh

    def frames(*files):
        return [{"filename": f, "line": 7, "name": "f"} for f in files]

    mib = 2**20
    here = "/x/site-packages/trl/grpo_trainer.py"
    kernel = "/work/main/notebookkit/kernels/linear_logprobs.py"
    trace = [
        dict(action="alloc", addr=1, size=100 * mib, frames=frames("/x/site-packages/torch/nn/modules/linear.py", here)),
        dict(action="alloc", addr=2, size=50 * mib, frames=frames(kernel)),
        dict(action="free_requested", addr=1, size=100 * mib),  # counted until the free completes
        dict(action="alloc", addr=3, size=30 * mib, frames=frames(kernel)),
        dict(action="free_completed", addr=1, size=100 * mib),
        dict(action="free_completed", addr=9, size=200 * mib),  # a block from before the window
        dict(action="alloc", addr=4, size=250 * mib, frames=[]),
    ]
    # baseline 1000, +100 +50 +30 = 1180 (the peak), -100 -200 +250 = 1130
    peak, before, blocks = mh.peak_of(trace, baseline=1000 * mib)
    assert (peak, before) == (1180 * mib, 1000 * mib) and sorted(b["addr"] for b in blocks) == [1, 2, 3]
    trace.append(dict(action="alloc", addr=5, size=60 * mib, frames=frames(kernel)))  # 1190: a later, higher peak
    peak, before, blocks = mh.peak_of(trace, baseline=1000 * mib)
    assert (peak, before) == (1190 * mib, 800 * mib) and sorted(b["addr"] for b in blocks) == [2, 3, 4, 5]
    assert mh.origin(trace[0]["frames"]) == "trl/grpo_trainer.py:7 (f)"  # torch's module machinery skipped
    assert mh.origin(trace[1]["frames"]) == "notebookkit/kernels/linear_logprobs.py:7 (f)"
    report = mh.peak_report("t", [], trace, 1000 * mib, counter_peak=1190 * mib)
    assert "its peak, replayed: 1.162 GiB (the allocator's peak counter: 1.162 GiB)" in report
    assert "| `(no Python stack)` | 250.0 | 1 |" in report
    assert "| `notebookkit/kernels/linear_logprobs.py:7 (f)` | 140.0 | 3 |" in report
