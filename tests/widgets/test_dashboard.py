"""The live dashboard fed synthetic Trainer events: history, throttling, the figure."""

import time

from transformers import TrainerControl, TrainerState

from notebookkit.widgets import LiveDashboard


class _Args:
    per_device_train_batch_size = 2
    gradient_accumulation_steps = 1


def _run(dash, steps=20, eval_every=10, sleep=0.0):
    state, control, args = TrainerState(), TrainerControl(), _Args()
    state.max_steps = steps
    dash.on_train_begin(args, state, control)
    for step in range(1, steps + 1):
        state.global_step = step
        state.epoch = step / steps
        dash.on_step_end(args, state, control)
        if sleep:
            time.sleep(sleep)
        dash.on_log(args, state, control, logs={
            "loss": 3.0 - 0.1 * step, "learning_rate": 2e-4 * (1 - step / steps), "grad_norm": 1.0 / step,
            "num_tokens": 64.0 * step, "epoch": state.epoch,
        })
        if step % eval_every == 0:
            dash.on_log(args, state, control, logs={"eval_loss": 2.5 - 0.05 * step, "epoch": state.epoch})
            dash.on_evaluate(args, state, control, metrics={"eval_loss": 2.5 - 0.05 * step})
    dash.on_log(args, state, control, logs={"train_runtime": 1.0, "train_loss": 2.0})
    dash.on_train_end(args, state, control)
    return state


def test_history_records_every_log_event(tmp_path):
    dash = LiveDashboard(display=False)
    _run(dash, steps=20, eval_every=10, sleep=0.001)
    train_rows = [r for r in dash.history if r["loss"] is not None]
    eval_rows = [r for r in dash.history if r["eval_loss"] is not None]
    assert len(train_rows) == 20 and len(eval_rows) == 2  # on_evaluate after on_log is not counted twice
    assert [r["step"] for r in train_rows] == list(range(1, 21))
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    assert all(r["mem_gib"] is not None and r["mem_gib"] > 0 for r in dash.history)
    assert all(r["tokens_per_s"] and r["tokens_per_s"] > 0 for r in train_rows[1:])
    assert dash.summary["train_loss"] == 2.0 and dash.finished
    assert dash.series("eval_loss") == ([10, 20], [2.0, 1.5])
    fig = dash.figure()
    assert len(fig.axes) == 4 and fig.axes[0].get_title() == "loss"
    assert len(fig.axes[0].lines) == 2  # train and eval
    path = dash.save_figure(tmp_path / "dash.png")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_widget_updates_in_place_and_is_throttled(monkeypatch):
    dash = LiveDashboard(display=True, update_every=60.0, plot_every=60.0, static_figure=False)
    shown = []
    monkeypatch.setattr(LiveDashboard, "display", lambda self: (shown.append(1), setattr(self, "_shown", True)))
    renders = []
    original = LiveDashboard.render

    def counting(self, final=False):
        renders.append(final)
        original(self, final)

    monkeypatch.setattr(LiveDashboard, "render", counting)
    _run(dash, steps=50, eval_every=25)
    # once at the start (forced), never again within 60 s, once at the end (forced, final)
    assert renders == [False, True]
    assert shown == [1]
    assert dash._bar.value == 50 and dash._bar.bar_style == "success"
    assert "step 50/50" in dash._progress.value and "done" in dash._progress.value
    assert "-2.0000" in dash._stats.value and "0.0000" in dash._stats.value  # latest loss, eval loss
    assert dash._image.value[:4] == b"\x89PNG"
    assert "nbk-dashboard-plot" in dash._image._dom_classes


def test_cheap_per_step_without_display():
    dash = LiveDashboard(display=False)
    t = time.perf_counter()
    _run(dash, steps=300, eval_every=1000)
    assert (time.perf_counter() - t) / 300 < 0.005  # well under 5 ms per step on a busy CPU


def test_with_a_real_trainer(tmp_path):
    """A few steps of transformers.Trainer on a 2-layer toy Llama: the callback API matches."""
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
    Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4], callbacks=[dash]).train()
    losses = [r["loss"] for r in dash.history if r["loss"] is not None]
    evals = [r["eval_loss"] for r in dash.history if r["eval_loss"] is not None]
    assert len(losses) == 6 and len(evals) == 2 and dash.step == 6 and dash.finished
    assert all(r["learning_rate"] is not None for r in dash.history if r["loss"] is not None)
    assert dash.tokens_per_s and dash.tokens_per_s > 0
    assert dash.save_figure(tmp_path / "d.png").endswith("d.png")
