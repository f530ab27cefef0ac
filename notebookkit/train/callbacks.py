"""Trainer callbacks: a metrics recorder that dashboards (and tests) build on.

:class:`TrainingMonitor` is a ``transformers.TrainerCallback`` that keeps, per logging event, the
step, epoch, wall time, training loss, evaluation loss, learning rate, gradient norm, tokens per
second and memory (GPU allocated now and peak; resident host memory on CPU) in ``history`` (a list
of dicts), and tracks progress and ETA every step. It draws nothing: :meth:`render` is a hook that
is called at most every ``update_every`` seconds during training and always once at the end;
``notebookkit.widgets.LiveDashboard`` overrides it to update a notebook output in place.

Tokens per second come from, in order: TRL's cumulative ``num_tokens`` log entry, the Trainer's
``state.num_input_tokens_seen`` (``include_num_input_tokens_seen=True``), or ``tokens_per_step``
given by the user (e.g. ``batch * accumulation * max_seq_length``, an upper bound with padding).
"""

from __future__ import annotations

import math
import time
from typing import Any

from transformers import TrainerCallback

GiB = 1024**3

HISTORY_KEYS = (
    "step", "epoch", "time", "loss", "eval_loss", "learning_rate", "grad_norm", "tokens_per_s",
    "mem_gib", "mem_peak_gib",
)


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def format_seconds(s: float | None) -> str:
    """``75 -> '01:15'``, ``3700 -> '1:01:40'``."""
    if s is None or not math.isfinite(s) or s < 0:
        return "--:--"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


def remove_progress_display(trainer: Any) -> None:
    """Remove the Trainer's progress display: the text bar in a terminal (``ProgressCallback``) and, in a
    notebook, the "Step | Training Loss" table (``NotebookProgressCallback``, which is not a subclass of the
    first, so ``trainer.remove_callback(ProgressCallback)`` leaves it in place)."""
    from transformers import ProgressCallback

    try:
        from transformers.utils.notebook import NotebookProgressCallback
    except ImportError:  # pragma: no cover - transformers without its notebook helpers
        NotebookProgressCallback = ProgressCallback
    for kind in (ProgressCallback, NotebookProgressCallback):
        while trainer.callback_handler.pop_callback(kind) is not None:
            pass


class TrainingMonitor(TrainerCallback):
    """Records training metrics into ``history`` and calls :meth:`render` (throttled).

    Args:
        update_every: minimum seconds between two :meth:`render` calls during training.
        tokens_per_step: tokens in one optimizer step, used for tokens/s when the trainer does not
            count tokens itself.
    """

    def __init__(self, update_every: float = 0.5, tokens_per_step: int | None = None) -> None:
        self.update_every = float(update_every)
        self.tokens_per_step = tokens_per_step
        self.history: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {}
        self._reset()

    # ---- state --------------------------------------------------------------------------------
    def _reset(self) -> None:
        self.history = []
        self.summary = {}
        self.step = 0
        self.max_steps = 0
        self.epoch: float | None = None
        self.finished = False
        self._t0 = time.perf_counter()
        self._t_first_step: float | None = None
        self._step_at_first = 0
        self._last_render = -math.inf
        self._last_tokens: tuple[float, float] | None = None  # (time, tokens)
        self._last_step_time: tuple[float, int] | None = None
        self.mem_now_gib: float | None = None
        self.mem_peak_gib: float | None = None
        self.mem_kind = "VRAM"
        self.tokens_per_s: float | None = None
        self.skipped_steps = 0  # fp16: optimizer steps the loss scaler skipped for inf/NaN gradients

    def attach(self, trainer: Any) -> "TrainingMonitor":
        """Add this callback to ``trainer`` in place of its progress display, and return it.

        The Trainer shows a text progress bar in a terminal and, in a notebook, a "Step | Training Loss"
        table (``NotebookProgressCallback``, one row per logging step); this callback shows the same
        numbers, so both are removed. ``trainer.add_callback(monitor)`` alone keeps them.
        """
        remove_progress_display(trainer)
        trainer.add_callback(self)
        return self

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    @property
    def eta_seconds(self) -> float | None:
        """Seconds left, from the mean step time since the first step (which includes warm-up)."""
        if not self.max_steps or self._t_first_step is None:
            return None
        done = self.step - self._step_at_first
        if done <= 0:
            return None
        per_step = (time.perf_counter() - self._t_first_step) / done
        return max(0.0, (self.max_steps - self.step) * per_step)

    def latest(self, key: str) -> Any:
        """The most recent non-None value of ``key`` in the history (None if never logged)."""
        for row in reversed(self.history):
            if row.get(key) is not None:
                return row[key]
        return None

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """``(steps, values)`` of the rows where ``key`` was logged."""
        xs, ys = [], []
        for row in self.history:
            if row.get(key) is not None:
                xs.append(row["step"])
                ys.append(row[key])
        return xs, ys

    def _sample_memory(self) -> None:
        from notebookkit.memory.meters import gpu_memory, host_rss

        g = gpu_memory(with_driver=False)
        if g is not None:
            self.mem_kind = "VRAM"
            self.mem_now_gib = g.allocated / GiB
            self.mem_peak_gib = g.peak_allocated / GiB
        else:
            self.mem_kind = "host RSS"
            now = host_rss() / GiB
            self.mem_now_gib = now
            self.mem_peak_gib = max(now, self.mem_peak_gib or 0.0)

    def _maybe_render(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._last_render >= self.update_every:
            self._last_render = now
            self.render(final=self.finished)

    def render(self, final: bool = False) -> None:
        """Draw the current state; called throttled during training and once at the end."""

    # ---- TrainerCallback events ---------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._reset()
        self.max_steps = int(getattr(state, "max_steps", 0) or 0)
        self.step = int(getattr(state, "global_step", 0) or 0)
        try:
            from notebookkit.memory.meters import reset_gpu_peak

            reset_gpu_peak()
        except Exception:
            pass
        self._sample_memory()
        self._maybe_render(force=True)

    def on_step_end(self, args, state, control, **kwargs):
        # accelerate's optimizer wrapper says when fp16's GradScaler skipped the step (inf/NaN gradients)
        if getattr(kwargs.get("optimizer"), "step_was_skipped", False):
            self.skipped_steps += 1
        self.step = int(getattr(state, "global_step", self.step + 1) or 0)
        self.epoch = _num(getattr(state, "epoch", None))
        if getattr(state, "max_steps", 0):
            self.max_steps = int(state.max_steps)
        if self._t_first_step is None:
            self._t_first_step = time.perf_counter()
            self._step_at_first = self.step
        self._sample_memory()
        self._maybe_render()

    def _tokens_per_s(self, logs: dict[str, Any], state: Any) -> float | None:
        now = time.perf_counter()
        tokens = _num(logs.get("num_tokens"))
        if tokens is None:
            seen = _num(getattr(state, "num_input_tokens_seen", None))
            tokens = seen if seen else None
        if tokens is None and self.tokens_per_step:
            tokens = float(self.step * self.tokens_per_step)
        if tokens is None:
            return None
        rate = None
        if self._last_tokens is not None:
            dt = now - self._last_tokens[0]
            dn = tokens - self._last_tokens[1]
            if dt > 0 and dn > 0:
                rate = dn / dt
        elif self.elapsed > 0 and tokens > 0:
            rate = tokens / self.elapsed
        self._last_tokens = (now, tokens)
        return rate

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = dict(logs or {})
        if "train_runtime" in logs or "train_loss" in logs and "loss" not in logs:
            self.summary.update(logs)  # the Trainer's end-of-training summary
            return
        self.step = int(getattr(state, "global_step", self.step) or self.step)
        self.epoch = _num(logs.get("epoch", getattr(state, "epoch", None)))
        self._sample_memory()
        rate = self._tokens_per_s(logs, state) if "loss" in logs else None
        if rate is not None:
            self.tokens_per_s = rate
        row = {
            "step": self.step,
            "epoch": self.epoch,
            "time": round(self.elapsed, 3),
            "loss": _num(logs.get("loss")),
            "eval_loss": _num(logs.get("eval_loss")),
            "learning_rate": _num(logs.get("learning_rate")),
            "grad_norm": _num(logs.get("grad_norm")),
            "tokens_per_s": rate,
            "mem_gib": self.mem_now_gib,
            "mem_peak_gib": self.mem_peak_gib,
        }
        for k, v in logs.items():  # keep any extra scalar metrics (e.g. mean_token_accuracy)
            if k not in row and k != "eval_loss":
                n = _num(v)
                if n is not None:
                    row[k] = n
        if any(row[k] is not None for k in ("loss", "eval_loss", "learning_rate", "grad_norm")):
            self.history.append(row)
        self._maybe_render()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics = metrics or {}
        if "eval_loss" in metrics and not any(
            r.get("eval_loss") is not None and r["step"] == state.global_step for r in self.history
        ):
            self.on_log(args, state, control, logs={"eval_loss": metrics["eval_loss"], "epoch": state.epoch})

    def on_train_end(self, args, state, control, **kwargs):
        self.step = int(getattr(state, "global_step", self.step) or self.step)
        self.finished = True
        self._sample_memory()
        self._maybe_render(force=True)
