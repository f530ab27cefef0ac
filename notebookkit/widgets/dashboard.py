"""Live training dashboard: one notebook output updated in place while ``trainer.train()`` runs.

    dash = LiveDashboard()
    trainer = SFTTrainer(..., callbacks=[dash])      # or trainer.add_callback(dash)
    trainer.train()
    dash.history                                      # list of dicts (see TrainingMonitor)
    dash.save_figure("runs/dashboard.png")

While training: a progress bar with elapsed time and ETA, the latest loss / eval loss / learning
rate / grad norm / tokens per second / memory (VRAM now and peak, or host RSS on CPU), and a plot
of the curves. DPO / ORPO runs add the chosen and rejected rewards, their margin and accuracy; GRPO
runs add the reward (mean, spread, per function), KL, completion length and the time per step in
generation vs training (:mod:`notebookkit.widgets.rl_metrics`). Text updates at most every ``update_every`` seconds and the plot at most every
``plot_every`` seconds (drawing a figure costs tens of milliseconds, too much for every CPU step);
everything is redrawn once at the end. Then a static PNG of the final figure is displayed as an
ordinary output, so an executed or exported notebook still shows it without the widget state.
"""

from __future__ import annotations

import html
import io
import time

from notebookkit.train.callbacks import TrainingMonitor, format_seconds

from . import rl_metrics


#: the dashboard's width: the plot's largest width; the stats row wraps within it
STATS_WIDTH_PX = 900


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        ip = get_ipython()
        return ip is not None and getattr(ip, "kernel", None) is not None
    except Exception:
        return False


def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


class LiveDashboard(TrainingMonitor):
    """A ``TrainerCallback`` that shows training progress live in the notebook.

    Args:
        title: heading shown above the dashboard.
        update_every: seconds between text updates (default 0.5).
        plot_every: seconds between plot redraws (default 2.0; always redrawn at the end).
        display: ``"auto"`` shows the dashboard when training starts inside a notebook kernel;
            True always, False never (history is recorded either way).
        static_figure: display a PNG of the final figure when training ends.
        tokens_per_step: see :class:`~notebookkit.train.callbacks.TrainingMonitor`.
    """

    def __init__(
        self,
        title: str = "Training",
        *,
        update_every: float = 0.5,
        plot_every: float = 2.0,
        display: bool | str = "auto",
        static_figure: bool = True,
        tokens_per_step: int | None = None,
    ) -> None:
        super().__init__(update_every=update_every, tokens_per_step=tokens_per_step)
        self.title = title
        self.plot_every = max(float(plot_every), float(update_every))
        self.display_mode = display
        self.static_figure = static_figure
        self._widget = None
        self._shown = False
        self._last_plot = -float("inf")
        self._plot_cost = 0.0
        self._plotted_rows = -1

    # ---- widgets ------------------------------------------------------------------------------
    def _build(self):
        import ipywidgets as W

        self._title = W.HTML(f"<div style='font-size:1.05em;font-weight:600'>{html.escape(self.title)}</div>")
        self._bar = W.IntProgress(value=0, min=0, max=1, bar_style="info", layout=W.Layout(width="420px"))
        self._bar.add_class("nbk-dashboard-progress-bar")
        self._progress = W.HTML("")
        self._progress.add_class("nbk-dashboard-progress")
        self._stats = W.HTML("")
        self._stats.add_class("nbk-dashboard-stats")
        self._image = W.Image(format="png", layout=W.Layout(max_width=f"{STATS_WIDTH_PX}px"))
        self._image.add_class("nbk-dashboard-plot")
        box = W.VBox([self._title, W.HBox([self._bar, self._progress]), self._stats, self._image])
        box.add_class("nbk-dashboard")
        self._widget = box
        return box

    @property
    def widget(self):
        """The dashboard's root widget (built on first use)."""
        return self._widget if self._widget is not None else self._build()

    def display(self) -> None:
        """Show the dashboard now (otherwise it appears when training starts)."""
        from IPython.display import display

        display(self.widget)
        self._shown = True

    def _ipython_display_(self) -> None:
        self.display()

    def _want_display(self) -> bool:
        if self.display_mode == "auto":
            return _in_notebook()
        return bool(self.display_mode)

    # ---- drawing ------------------------------------------------------------------------------
    def stats_html(self) -> str:
        """The latest numbers as an HTML table (also readable in tests)."""
        loss = self.latest("loss")
        eval_loss = self.latest("eval_loss")
        cells = [
            ("loss", _fmt(loss, ".4f")),
            ("eval loss", _fmt(eval_loss, ".4f")),
            ("learning rate", _fmt(self.latest("learning_rate"), ".2e")),
            ("grad norm", _fmt(self.latest("grad_norm"), ".3f")),
            ("tokens/s", _fmt(self.tokens_per_s, ",.0f")),
            (f"{self.mem_kind} now", _fmt(self.mem_now_gib, ".2f") + " GiB"),
            (f"{self.mem_kind} peak", _fmt(self.mem_peak_gib, ".2f") + " GiB"),
        ] + rl_metrics.stat_cells(self)
        # one box per number, wrapping onto a second row when they do not fit the dashboard's width
        # (a GRPO run has 15 of them): a one-row table was wider than the box and cut its last columns
        items = "".join(
            "<div style='padding:0 10px 4px 0;text-align:center;min-width:72px'>"
            f"<div style='color:#666'>{html.escape(k)}</div><b>{html.escape(v)}</b></div>" for k, v in cells)
        return f"<div style='display:flex;flex-wrap:wrap;max-width:{STATS_WIDTH_PX}px'>{items}</div>"

    def progress_text(self) -> str:
        total = self.max_steps or "?"
        state = "done" if self.finished else f"ETA {format_seconds(self.eta_seconds)}"
        return f"step {self.step}/{total} · {format_seconds(self.elapsed)} elapsed · {state}"

    def _draw_loss(self, ax) -> None:
        xs, ys = self.series("loss")
        ax.plot(xs, ys, label="train loss", color="#4e79a7")
        ex, ey = self.series("eval_loss")
        if ex:
            ax.plot(ex, ey, "o-", label="eval loss", color="#e15759")
        ax.set_title("loss")
        if xs or ex:
            ax.legend(loc="upper right", fontsize=8)

    def _draw_series(self, ax, key: str, title: str, colour: str) -> None:
        ax.plot(*self.series(key), color=colour)
        ax.set_title(title)

    def _draw_memory(self, ax) -> None:
        mx, my = self.series("mem_gib")
        px, py = self.series("mem_peak_gib")
        ax.plot(mx, my, label=f"{self.mem_kind} now", color="#76b7b2")
        ax.plot(px, py, "--", label=f"{self.mem_kind} peak", color="#b07aa1")
        ax.set_title("memory (GiB)")
        if mx:
            ax.legend(loc="lower right", fontsize=8)

    def figure(self):
        """A matplotlib ``Figure`` of the curves so far: loss, learning rate, grad norm, memory, and for
        DPO / ORPO / GRPO runs their reward panels (:mod:`notebookkit.widgets.rl_metrics`)."""
        from matplotlib.figure import Figure

        drawers = [
            self._draw_loss,
            lambda ax: self._draw_series(ax, "learning_rate", "learning rate", "#f28e2b"),
            lambda ax: self._draw_series(ax, "grad_norm", "grad norm", "#59a14f"),
            self._draw_memory,
        ] + rl_metrics.panels(self)
        cols = 2 if len(drawers) <= 4 else 3
        rows = -(-len(drawers) // cols)
        size = (10, 5.6) if len(drawers) <= 4 else (13, 2.9 * rows)
        fig = Figure(figsize=size, dpi=90, layout="constrained")
        axes = fig.subplots(rows, cols, squeeze=False).ravel()
        for ax, draw in zip(axes, drawers):
            draw(ax)
            ax.set_xlabel("step")
        for ax in axes[len(drawers):]:
            fig.delaxes(ax)
        tps = [r["tokens_per_s"] for r in self.history if r.get("tokens_per_s")]
        sub = f" · {sum(tps) / len(tps):,.0f} tokens/s" if tps else ""
        fig.suptitle(f"{self.title}: step {self.step}/{self.max_steps or '?'}{sub}", fontsize=11)
        return fig

    def figure_png(self) -> bytes:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        fig = self.figure()
        FigureCanvasAgg(fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()

    def save_figure(self, path: str) -> str:
        """Write the current figure to ``path`` (PNG, or any format matplotlib knows by suffix)."""
        from pathlib import Path

        from matplotlib.backends.backend_agg import FigureCanvasAgg

        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fig = self.figure()
        FigureCanvasAgg(fig)
        fig.savefig(p)
        return str(p)

    def render(self, final: bool = False) -> None:
        if not self._want_display() and not self._shown:
            return
        if not self._shown:
            self.display()
        self.widget  # noqa: B018 - build
        self._bar.max = max(1, self.max_steps or 1)
        self._bar.value = min(self.step, self._bar.max)
        if final:
            self._bar.bar_style = "success"
        self._progress.value = f"<span style='margin-left:8px'>{self.progress_text()}</span>"
        self._stats.value = self.stats_html()
        now = time.perf_counter()
        wait = max(self.plot_every, 5 * self._plot_cost)
        if final or (now - self._last_plot >= wait and len(self.history) != self._plotted_rows):
            t = time.perf_counter()
            png = self.figure_png()
            self._image.value = png
            self._plot_cost = time.perf_counter() - t
            self._last_plot = time.perf_counter()
            self._plotted_rows = len(self.history)
            if final and self.static_figure:
                from IPython.display import Image, display

                display(Image(data=png, format="png"))

    def __repr__(self) -> str:
        return f"LiveDashboard(step={self.step}/{self.max_steps}, rows={len(self.history)})"
