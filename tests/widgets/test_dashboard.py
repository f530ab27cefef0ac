"""The live dashboard fed Trainer events: history, throughput and ETA, throttling, the figure.

The synthetic runs log seeded random values (no trend, no pattern), so what the tests read back
(history, series, the numbers shown, the plotted lines) can only match if the dashboard recorded
and drew what it was given; a fake clock makes tokens/s and the ETA exact.
"""

import random
import time
import types

import pytest
from transformers import TrainerControl, TrainerState

from notebookkit.train import callbacks
from notebookkit.train.callbacks import format_seconds
from notebookkit.widgets import LiveDashboard


class _Args:
    per_device_train_batch_size = 2
    gradient_accumulation_steps = 1


def _logs(steps: int, eval_every: int, seed: int = 0) -> dict:
    """Seeded random per-step logs: loss, learning rate, grad norm, cumulative tokens; eval losses."""
    rnd = random.Random(seed)
    tokens, per_step = 0, []
    for _ in range(steps):
        tokens += rnd.randint(40, 90)  # packed batches: a different token count every step
        per_step.append(dict(loss=round(rnd.uniform(0.5, 4.0), 4), learning_rate=rnd.uniform(1e-5, 3e-4),
                             grad_norm=rnd.uniform(0.1, 5.0), num_tokens=float(tokens)))
    evals = {step: round(rnd.uniform(0.5, 4.0), 4) for step in range(eval_every, steps + 1, eval_every)}
    return dict(per_step=per_step, evals=evals)


def _run(dash, logs, sleep=0.0, clock=None, step_seconds=()):
    """Feed ``logs`` to ``dash`` as a Trainer would; ``clock`` (a one-item list) is advanced by
    ``step_seconds[i]`` before step ``i + 1`` when given."""
    steps = len(logs["per_step"])
    state, control, args = TrainerState(), TrainerControl(), _Args()
    state.max_steps = steps
    dash.on_train_begin(args, state, control)
    for step, entry in enumerate(logs["per_step"], start=1):
        if clock is not None:
            clock[0] += step_seconds[step - 1]
        state.global_step = step
        state.epoch = step / steps
        dash.on_step_end(args, state, control)
        if sleep:
            time.sleep(sleep)
        dash.on_log(args, state, control, logs=dict(entry, epoch=state.epoch))
        if step in logs["evals"]:
            dash.on_log(args, state, control, logs={"eval_loss": logs["evals"][step], "epoch": state.epoch})
            dash.on_evaluate(args, state, control, metrics={"eval_loss": logs["evals"][step]})
    dash.on_log(args, state, control, logs={"train_runtime": 1.0, "train_loss": 2.0})
    dash.on_train_end(args, state, control)
    return state


@pytest.fixture
def fake_clock(monkeypatch):
    """``time.perf_counter`` of the monitor (and the dashboard) reads this list's one value."""
    clock = [1000.0]
    fake = types.SimpleNamespace(perf_counter=lambda: clock[0], time=time.time, sleep=time.sleep)
    monkeypatch.setattr(callbacks, "time", fake)
    monkeypatch.setattr("notebookkit.widgets.dashboard.time", fake)
    return clock


def test_history_records_every_log_event(tmp_path):
    logs = _logs(20, eval_every=10)
    dash = LiveDashboard(display=False)
    _run(dash, logs, sleep=0.001)
    train_rows = [r for r in dash.history if r["loss"] is not None]
    eval_rows = [r for r in dash.history if r["eval_loss"] is not None]
    assert len(train_rows) == 20 and len(eval_rows) == 2  # on_evaluate after on_log is not counted twice
    assert [r["step"] for r in train_rows] == list(range(1, 21))
    for row, entry in zip(train_rows, logs["per_step"]):
        assert (row["loss"], row["learning_rate"], row["grad_norm"]) == (
            entry["loss"], entry["learning_rate"], entry["grad_norm"])
    assert dash.series("loss") == (list(range(1, 21)), [e["loss"] for e in logs["per_step"]])
    assert dash.series("eval_loss") == (list(logs["evals"]), list(logs["evals"].values()))
    assert dash.latest("loss") == logs["per_step"][-1]["loss"]
    assert all(r["mem_gib"] is not None and r["mem_gib"] > 0 for r in dash.history)
    assert all(r["tokens_per_s"] and r["tokens_per_s"] > 0 for r in train_rows[1:])
    assert dash.summary["train_loss"] == 2.0 and dash.finished
    fig = dash.figure()
    assert len(fig.axes) == 4 and fig.axes[0].get_title() == "loss"
    train_line, eval_line = fig.axes[0].lines  # train and eval, drawn from the recorded values
    assert train_line.get_xydata().tolist() == [[s, e["loss"]] for s, e in enumerate(logs["per_step"], 1)]
    assert eval_line.get_xydata().tolist() == [[s, v] for s, v in logs["evals"].items()]
    assert fig.axes[1].lines[0].get_ydata().tolist() == [e["learning_rate"] for e in logs["per_step"]]
    path = dash.save_figure(tmp_path / "dash.png")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_tokens_per_second_and_eta_follow_the_clock(fake_clock):
    """tokens/s = new tokens / seconds since the previous log; ETA = steps left x mean step time
    since the first step. Step times and token counts are random, so only the formula matches."""
    logs = _logs(12, eval_every=100, seed=1)
    rnd = random.Random(2)
    step_seconds = [round(rnd.uniform(0.2, 3.0), 3) for _ in range(12)]
    seen = []

    class Recorder(LiveDashboard):
        def on_log(self, args, state, control, logs=None, **kwargs):
            super().on_log(args, state, control, logs=logs, **kwargs)
            if logs and "loss" in logs:
                seen.append((self.tokens_per_s, self.eta_seconds, self.progress_text()))

    dash = Recorder(display=False)
    _run(dash, logs, clock=fake_clock, step_seconds=step_seconds)
    tokens = [e["num_tokens"] for e in logs["per_step"]]
    assert seen[0][0] == pytest.approx(tokens[0] / step_seconds[0])  # first log: tokens / elapsed
    for i in range(1, 12):
        assert seen[i][0] == pytest.approx((tokens[i] - tokens[i - 1]) / step_seconds[i]), i
        mean_step = sum(step_seconds[1 : i + 1]) / i  # the first step (warm-up) is not in the mean
        assert seen[i][1] == pytest.approx((12 - (i + 1)) * mean_step), i
        assert f"ETA {format_seconds((12 - (i + 1)) * mean_step)}" in seen[i][2]
    assert [r["tokens_per_s"] for r in dash.history if r["loss"] is not None] == [s[0] for s in seen]


def test_widget_updates_in_place_and_is_throttled(monkeypatch):
    logs = _logs(50, eval_every=25, seed=3)
    dash = LiveDashboard(display=True, update_every=60.0, plot_every=60.0, static_figure=False)
    shown = []
    monkeypatch.setattr(LiveDashboard, "display", lambda self: (shown.append(1), setattr(self, "_shown", True)))
    renders = []
    original = LiveDashboard.render

    def counting(self, final=False):
        renders.append(final)
        original(self, final)

    monkeypatch.setattr(LiveDashboard, "render", counting)
    _run(dash, logs)
    # once at the start (forced), never again within 60 s, once at the end (forced, final)
    assert renders == [False, True]
    assert shown == [1]
    assert dash._bar.value == 50 and dash._bar.bar_style == "success"
    assert "step 50/50" in dash._progress.value and "done" in dash._progress.value
    last_loss, last_eval = logs["per_step"][-1]["loss"], logs["evals"][50]
    assert f"<b>{last_loss:.4f}</b>" in dash._stats.value and f"<b>{last_eval:.4f}</b>" in dash._stats.value
    assert dash._image.value[:4] == b"\x89PNG"
    assert "nbk-dashboard-plot" in dash._image._dom_classes


def test_widget_shows_each_step_while_training(monkeypatch):
    """Unthrottled, the bar, the progress line and the stats show every step's own numbers as it
    arrives (not only at the end)."""
    logs = _logs(8, eval_every=4, seed=4)
    monkeypatch.setattr(LiveDashboard, "display", lambda self: setattr(self, "_shown", True))
    shown = []

    class Watched(LiveDashboard):
        def on_log(self, args, state, control, logs=None, **kwargs):
            super().on_log(args, state, control, logs=logs, **kwargs)
            if logs and "loss" in logs:
                shown.append((self._bar.value, self._progress.value, self._stats.value))

    dash = Watched(display=True, update_every=0.0, plot_every=1e9, static_figure=False)
    _run(dash, logs)
    assert [bar for bar, _, _ in shown] == list(range(1, 9))
    for step, ((_, progress, stats), entry) in enumerate(zip(shown, logs["per_step"]), start=1):
        assert f"step {step}/8" in progress
        assert f"<b>{entry['loss']:.4f}</b>" in stats and f"<b>{entry['grad_norm']:.3f}</b>" in stats


def test_cheap_per_step_without_display():
    logs = _logs(300, eval_every=1000)
    dash = LiveDashboard(display=False)
    t = time.perf_counter()
    _run(dash, logs)
    assert (time.perf_counter() - t) / 300 < 0.005  # well under 5 ms per step on a busy CPU


def test_with_a_real_trainer(tmp_path):
    """A few steps of transformers.Trainer on a 2-layer toy Llama: the callback API matches, and the
    dashboard holds exactly the losses the Trainer logged."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    data = [{"input_ids": torch.randint(0, 64, (16,)).tolist()} for _ in range(16)]
    for row in data:
        row["labels"] = list(row["input_ids"])
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, logging_steps=1,
                             eval_strategy="steps", eval_steps=3, report_to=[], use_cpu=True, save_strategy="no",
                             learning_rate=1e-3, disable_tqdm=True)
    dash = LiveDashboard(display=False, tokens_per_step=4 * 16)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4], callbacks=[dash])
    trainer.train()
    losses = [r["loss"] for r in dash.history if r["loss"] is not None]
    evals = [r["eval_loss"] for r in dash.history if r["eval_loss"] is not None]
    assert len(losses) == 6 and len(evals) == 2 and dash.step == 6 and dash.finished
    assert losses == [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert evals == [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert all(r["learning_rate"] is not None for r in dash.history if r["loss"] is not None)
    assert dash.tokens_per_s and dash.tokens_per_s > 0
    assert dash.save_figure(tmp_path / "d.png").endswith("d.png")


def test_attach_replaces_the_trainers_progress_display_in_a_notebook_and_a_terminal():
    """In a notebook the Trainer's progress display is ``NotebookProgressCallback`` (a "Step | Training Loss"
    table, one row per logging step), which ``trainer.remove_callback(ProgressCallback)`` does not remove."""
    from types import SimpleNamespace

    from transformers import ProgressCallback, TrainerCallback
    from transformers.trainer_callback import CallbackHandler
    from transformers.utils.notebook import NotebookProgressCallback

    from notebookkit.widgets import LiveDashboard

    class Other(TrainerCallback):
        pass

    for display in (NotebookProgressCallback, ProgressCallback):
        handler = CallbackHandler([display, Other], model=None, processing_class=None, optimizer=None,
                                  lr_scheduler=None)
        trainer = SimpleNamespace(callback_handler=handler, add_callback=handler.add_callback)
        dash = LiveDashboard(display=False).attach(trainer)
        kinds = [type(cb) for cb in handler.callbacks]
        assert display not in kinds and Other in kinds and dash in handler.callbacks, kinds
