"""The preference (DPO, ORPO) and RL (GRPO) metrics of the live dashboard, read from TRL's log keys.

The dashboard's monitor keeps every scalar a trainer logs (:class:`~notebookkit.train.callbacks.TrainingMonitor`);
this module picks out, per kind of run:

* GRPO (a ``reward`` key): the mean reward with its spread (``reward`` +- ``reward_std``), each reward
  function's mean (``rewards/<name>/mean``), the KL to the reference (``kl``, logged when ``beta > 0``),
  the completion length (``completions/mean_length``, min and max) and the seconds per step spent in
  generation, scoring and training (``time/*``, logged by :class:`~notebookkit.train.grpo.FastGRPOTrainer`);
* preference pairs (a ``rewards/margins`` key): the implicit rewards of the chosen and rejected answers,
  their margin and the fraction of pairs ranked right (``rewards/accuracies``).

Which view draws a method's run, the key that tells the runs apart and the timed parts of a step are
the training-method record's (:mod:`notebookkit.training_methods`: ``dashboard``, the first of
``metrics``, ``step_times``); :data:`VIEWS` holds the drawing of each view.

:func:`stat_cells` gives the latest numbers for the table, :func:`panels` the plots; both are empty for
a plain SFT run, whose dashboard stays as it was.
"""

from __future__ import annotations

from typing import Any, Callable

from notebookkit.training_methods import TRAINING_METHODS, dashboard_methods

__all__ = ["run_kind", "reward_functions", "stat_cells", "panels", "TIME_PARTS", "VIEWS"]

#: the dashboard views drawn here (the record's ``dashboard`` values)
GRPO_VIEW, PREFERENCE_VIEW = "grpo", "preference"


def _step_times(view: str) -> tuple[str, ...]:
    return next((m.step_times for m in dashboard_methods(view).values() if m.step_times), ())


#: (log key, label, colour) of the parts of a GRPO step, from the record's ``step_times``
TIME_PARTS = tuple((key, key.split("/", 1)[-1], colour)
                   for key, colour in zip(_step_times(GRPO_VIEW), ("#4e79a7", "#f28e2b", "#59a14f")))


def _keys(monitor: Any) -> set[str]:
    return {k for row in monitor.history for k, v in row.items() if v is not None}


def run_kind(monitor: Any) -> str | None:
    """``"grpo"``, ``"preference"`` or ``None`` (neither), from what has been logged so far: the view of the
    method whose first metric (``reward``, ``rewards/margins``) is in the logs."""
    keys = _keys(monitor)
    for method in TRAINING_METHODS.values():
        if method.dashboard and method.metrics[0] in keys:
            return method.dashboard
    return None


def reward_functions(monitor: Any) -> list[str]:
    """Names of the reward functions with logged means (``rewards/<name>/mean``), in first-logged order."""
    names: list[str] = []
    for row in monitor.history:
        for key in row:
            if key.startswith("rewards/") and key.endswith("/mean") and row[key] is not None:
                name = key[len("rewards/"):-len("/mean")]
                if name not in names:
                    names.append(name)
    return names


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def stat_cells(monitor: Any) -> list[tuple[str, str]]:
    """``(label, value)`` pairs of the latest RL numbers (empty for a run without them)."""
    kind = run_kind(monitor)
    return VIEWS[kind][0](monitor) if kind in VIEWS else []


def _preference_cells(monitor: Any) -> list[tuple[str, str]]:
    latest = monitor.latest
    return [
        ("reward chosen", _fmt(latest("rewards/chosen"), ".3f")),
        ("reward rejected", _fmt(latest("rewards/rejected"), ".3f")),
        ("margin", _fmt(latest("rewards/margins"), ".3f")),
        ("accuracy", _fmt(latest("rewards/accuracies"), ".0%")),
    ]


def _grpo_cells(monitor: Any) -> list[tuple[str, str]]:
    latest = monitor.latest
    std = latest("reward_std")
    cells = [("reward", _fmt(latest("reward"), ".3f") + ("" if std is None else f" ± {std:.3f}"))]
    cells += [(name, _fmt(latest(f"rewards/{name}/mean"), ".3f")) for name in reward_functions(monitor)]
    if latest("kl") is not None:
        cells.append(("KL", _fmt(latest("kl"), ".4f")))
    cells.append(("completion length", _fmt(latest("completions/mean_length"), ".1f")))
    parts = [latest(key) for key, _, _ in TIME_PARTS]
    if all(p is not None for p in parts) and sum(parts) > 0:
        cells.append(("generation / step", f"{parts[0]:.2f} s ({parts[0] / sum(parts):.0%})"))
        cells.append(("training / step", f"{parts[2]:.2f} s ({parts[2] / sum(parts):.0%})"))
    return cells


def _grpo_panels(monitor: Any) -> list[Callable[[Any], None]]:
    def reward(ax):
        xs, mean = monitor.series("reward")
        ax.plot(xs, mean, color="#4e79a7", label="mean")
        rows = [r for r in monitor.history if r.get("reward") is not None and r.get("reward_std") is not None]
        if rows:
            steps = [r["step"] for r in rows]
            ax.fill_between(steps, [r["reward"] - r["reward_std"] for r in rows],
                            [r["reward"] + r["reward_std"] for r in rows], color="#4e79a7", alpha=0.2, label="± std")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_title("reward (mean ± std)")

    def per_function(ax):
        for name in reward_functions(monitor):
            ax.plot(*monitor.series(f"rewards/{name}/mean"), label=name)
        if reward_functions(monitor):
            ax.legend(loc="lower right", fontsize=8)
        ax.set_title("reward per function")

    def kl(ax):
        ax.plot(*monitor.series("kl"), color="#e15759", label="kl")
        ax.set_title("KL to the reference")

    def length(ax):
        ax.plot(*monitor.series("completions/mean_length"), color="#76b7b2", label="mean")
        lo_x, lo = monitor.series("completions/min_length")
        hi_x, hi = monitor.series("completions/max_length")
        if lo and hi and lo_x == hi_x:
            ax.fill_between(lo_x, lo, hi, color="#76b7b2", alpha=0.2, label="min-max")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_title("completion length (tokens)")

    def timing(ax):
        rows = [r for r in monitor.history if all(r.get(k) is not None for k, _, _ in TIME_PARTS)]
        bottom = [0.0] * len(rows)
        for key, label, colour in TIME_PARTS:
            values = [r[key] for r in rows]
            ax.bar([r["step"] for r in rows], values, bottom=bottom, color=colour, label=label, width=0.8)
            bottom = [b + v for b, v in zip(bottom, values)]
        if rows:
            ax.legend(loc="upper right", fontsize=8)
        ax.set_title("seconds per step")

    drawn = [reward, per_function]
    if monitor.series("kl")[0]:
        drawn.append(kl)
    return drawn + [length, timing]


def _preference_panels(monitor: Any) -> list[Callable[[Any], None]]:
    def rewards(ax):
        ax.plot(*monitor.series("rewards/chosen"), color="#59a14f", label="chosen")
        ax.plot(*monitor.series("rewards/rejected"), color="#e15759", label="rejected")
        ax.axhline(0.0, color="#999", linewidth=0.6)
        ax.legend(loc="upper left", fontsize=8)
        ax.set_title("implicit reward")

    def margin(ax):
        ax.plot(*monitor.series("rewards/margins"), color="#4e79a7")
        ax.axhline(0.0, color="#999", linewidth=0.6)
        ax.set_title("reward margin (chosen - rejected)")

    def accuracy(ax):
        ax.plot(*monitor.series("rewards/accuracies"), color="#b07aa1")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title("reward accuracy (chosen > rejected)")

    return [rewards, margin, accuracy]


def panels(monitor: Any) -> list[Callable[[Any], None]]:
    """Functions that each draw one RL panel on a matplotlib ``Axes`` (empty for a run without RL metrics)."""
    kind = run_kind(monitor)
    return VIEWS[kind][1](monitor) if kind in VIEWS else []


#: view -> (its stat cells, its panels); every ``dashboard`` value of the record has one
VIEWS: dict[str, tuple[Callable[[Any], list], Callable[[Any], list]]] = {
    GRPO_VIEW: (_grpo_cells, _grpo_panels),
    PREFERENCE_VIEW: (_preference_cells, _preference_panels),
}
