"""The live dashboard's DPO / ORPO and GRPO metrics, fed seeded random logs with TRL's keys: the table shows
the latest values, the panels plot exactly what was logged, and a plain SFT run keeps its four panels."""

import random

from transformers import TrainerControl, TrainerState

from notebookkit.widgets import LiveDashboard
from notebookkit.widgets import rl_metrics


class _Args:
    per_device_train_batch_size = 2
    gradient_accumulation_steps = 1


def _feed(dash, rows):
    state, control, args = TrainerState(), TrainerControl(), _Args()
    state.max_steps = len(rows)
    dash.on_train_begin(args, state, control)
    for step, row in enumerate(rows, start=1):
        state.global_step = step
        dash.on_step_end(args, state, control)
        dash.on_log(args, state, control, logs=dict(row))
    dash.on_train_end(args, state, control)


def _grpo_rows(steps, seed=0, kl=True):
    rnd = random.Random(seed)
    rows = []
    for _ in range(steps):
        fmt, ok = rnd.random(), rnd.random()
        row = {"loss": rnd.uniform(-0.1, 0.1), "learning_rate": 1e-3, "grad_norm": rnd.uniform(0, 2),
               "reward": fmt + ok, "reward_std": rnd.uniform(0, 0.5), "rewards/format_reward/mean": fmt,
               "rewards/format_reward/std": 0.1, "rewards/correctness_reward/mean": ok,
               "rewards/correctness_reward/std": 0.2, "completions/mean_length": rnd.uniform(5, 20),
               "completions/min_length": 2.0, "completions/max_length": 24.0, "time/generation": rnd.uniform(1, 3),
               "time/scoring": rnd.uniform(0.1, 0.3), "time/training": rnd.uniform(0.5, 1)}
        if kl:
            row["kl"] = rnd.uniform(0, 0.01)
        rows.append(row)
    return rows


def _preference_rows(steps, seed=1):
    rnd = random.Random(seed)
    rows = []
    for _ in range(steps):
        chosen, rejected = rnd.uniform(-1, 1), rnd.uniform(-1, 1)
        rows.append({"loss": rnd.uniform(0.3, 0.7), "learning_rate": 5e-4, "grad_norm": rnd.uniform(0, 1),
                     "rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected,
                     "rewards/accuracies": rnd.choice([0.0, 0.25, 0.5, 0.75, 1.0])})
    return rows


def _lines(ax):
    return {line.get_label(): [float(v) for v in line.get_ydata()] for line in ax.lines}


def test_grpo_metrics_are_shown_and_plotted_as_logged():
    rows = _grpo_rows(7)
    dash = LiveDashboard(display=False)
    _feed(dash, rows)
    assert rl_metrics.run_kind(dash) == "grpo"
    assert rl_metrics.reward_functions(dash) == ["format_reward", "correctness_reward"]
    last = rows[-1]
    cells = dict(rl_metrics.stat_cells(dash))
    assert cells["reward"] == f"{last['reward']:.3f} ± {last['reward_std']:.3f}"
    assert cells["format_reward"] == f"{last['rewards/format_reward/mean']:.3f}"
    assert cells["KL"] == f"{last['kl']:.4f}"
    total = last["time/generation"] + last["time/scoring"] + last["time/training"]
    assert cells["generation / step"] == f"{last['time/generation']:.2f} s ({last['time/generation'] / total:.0%})"
    html = dash.stats_html()
    assert "completion length" in html and f"{last['completions/mean_length']:.1f}" in html

    fig = dash.figure()
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["loss", "learning rate", "grad norm", "memory (GiB)", "reward (mean ± std)",
                      "reward per function", "KL to the reference", "completion length (tokens)", "seconds per step"]
    by_title = dict(zip(titles, fig.axes))
    assert _lines(by_title["reward (mean ± std)"])["mean"] == [r["reward"] for r in rows]
    per_function = _lines(by_title["reward per function"])
    assert per_function["correctness_reward"] == [r["rewards/correctness_reward/mean"] for r in rows]
    assert _lines(by_title["KL to the reference"])["kl"] == [r["kl"] for r in rows]
    bars = by_title["seconds per step"].patches
    assert len(bars) == 3 * len(rows)
    # stacked: generation, then scoring on top of it, then training on top of both
    assert [b.get_height() for b in bars[: len(rows)]] == [r["time/generation"] for r in rows]
    assert [b.get_y() for b in bars[2 * len(rows):]] == [r["time/generation"] + r["time/scoring"] for r in rows]
    dash.figure_png()  # draws


def test_grpo_without_kl_has_no_kl_panel():
    dash = LiveDashboard(display=False)
    _feed(dash, _grpo_rows(3, kl=False))
    titles = [ax.get_title() for ax in dash.figure().axes]
    assert "KL to the reference" not in titles and "KL" not in dict(rl_metrics.stat_cells(dash))


def test_preference_metrics_are_shown_and_plotted_as_logged():
    rows = _preference_rows(6)
    dash = LiveDashboard(display=False)
    _feed(dash, rows)
    assert rl_metrics.run_kind(dash) == "preference"
    last = rows[-1]
    assert dict(rl_metrics.stat_cells(dash)) == {
        "reward chosen": f"{last['rewards/chosen']:.3f}", "reward rejected": f"{last['rewards/rejected']:.3f}",
        "margin": f"{last['rewards/margins']:.3f}", "accuracy": f"{last['rewards/accuracies']:.0%}",
    }
    fig = dash.figure()
    by_title = {ax.get_title(): ax for ax in fig.axes}
    implicit = _lines(by_title["implicit reward"])
    assert implicit["chosen"] == [r["rewards/chosen"] for r in rows]
    assert implicit["rejected"] == [r["rewards/rejected"] for r in rows]
    assert by_title["reward accuracy (chosen > rejected)"].lines[0].get_ydata().tolist() == \
        [r["rewards/accuracies"] for r in rows]
    assert by_title["reward margin (chosen - rejected)"].lines[0].get_ydata().tolist() == \
        [r["rewards/margins"] for r in rows]


def test_sft_run_keeps_the_four_panels():
    dash = LiveDashboard(display=False)
    _feed(dash, [{"loss": 1.0 - i / 10, "learning_rate": 1e-4, "grad_norm": 1.0} for i in range(4)])
    assert rl_metrics.run_kind(dash) is None and rl_metrics.stat_cells(dash) == []
    assert [ax.get_title() for ax in dash.figure().axes] == ["loss", "learning rate", "grad norm", "memory (GiB)"]
