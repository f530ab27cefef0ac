"""Training panel: learning rate, epochs or max steps, batch size, accumulation, warm-up, scheduler,
seed, packing, optimizer; for preference training the method (DPO or ORPO) and its beta.

``TrainingPanel().value`` is a :class:`TrainingChoice`; :meth:`~TrainingChoice.trainer_kwargs`
returns ``TrainingArguments`` / TRL ``SFTConfig`` field names (``SFTConfig(output_dir=..., **kw)``).
``TrainingPanel(method="dpo")`` shows a DPO / ORPO switch and a beta field instead of packing; its
``trainer_kwargs()`` then fit ``DPOConfig`` / ``ORPOConfig`` (``beta`` in, ``packing`` out).
``TrainingPanel(method="grpo")`` shows beta as the KL weight, for ``GRPOConfig``; its batch size counts
completions (prompts per step x generations per prompt).

What each method shows (packing or beta, the switch between methods that share a panel, the batch
unit and the note) is its row of :mod:`notebookkit.training_methods`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import ipywidgets as W

from notebookkit.training_methods import TRAINING_METHODS, panel_methods

from ._base import Panel, header, styled

SCHEDULERS = ["linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial"]
OPTIMIZERS = ["adamw_8bit", "paged_adamw_8bit", "adamw_torch", "adamw_torch_fused", "adafactor", "sgd"]
#: method -> label of the preference switch (DPO: beta scales the implicit reward; ORPO: beta weighs
#: the odds-ratio term against the SFT loss)
PREFERENCE_METHODS = {name: m.label for name, m in panel_methods("preference").items()}


def _method_choices() -> str:
    """``'sft', 'dpo' / 'orpo' for preference pairs, or 'grpo'``: the methods, by panel."""
    panels = list(dict.fromkeys(m.panel for m in TRAINING_METHODS.values()))
    parts = []
    for panel in panels:
        methods = panel_methods(panel)
        text = " / ".join(map(repr, methods))
        first = next(iter(methods.values()))
        parts.append(text + (f" for {first.batch_unit}" if first.rows_per_example > 1 else ""))
    return ", ".join(parts[:-1]) + ", or " + parts[-1]


def _default_optim() -> str:
    try:
        import torch

        return "adamw_8bit" if torch.cuda.is_available() else "adamw_torch"
    except Exception:
        return "adamw_torch"


@dataclass
class TrainingChoice:
    """Trainer settings, named as ``TrainingArguments`` / ``SFTConfig`` take them.

    ``max_steps > 0`` stops after that many optimizer steps; ``max_steps = -1`` runs
    ``num_train_epochs`` epochs instead. ``method`` is ``"sft"``, ``"dpo"`` / ``"orpo"`` for
    preference pairs (``beta``: DPO's reward scale, ORPO's odds-ratio weight) or ``"grpo"``
    (``beta``: the weight of the KL term, 0 for none).
    """

    learning_rate: float = 2e-4
    num_train_epochs: float = 1.0
    max_steps: int = 60
    per_device_train_batch_size: int = 2
    gradient_accumulation_steps: int = 4
    warmup_steps: int = 5
    lr_scheduler_type: str = "linear"
    seed: int = 3407
    packing: bool = False
    optim: str = ""
    method: str = "sft"
    beta: float = 0.1

    def __post_init__(self) -> None:
        if not self.optim:
            self.optim = _default_optim()
        if self.method not in TRAINING_METHODS:
            raise ValueError(f"method={self.method!r}: use {_method_choices()}")

    @property
    def effective_batch_size(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    def trainer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``SFTConfig`` (packing included), or for ``DPOConfig`` / ``ORPOConfig`` /
        ``GRPOConfig`` (beta included, no packing) when ``method`` is ``"dpo"`` / ``"orpo"`` / ``"grpo"``."""
        d = asdict(self)
        method = TRAINING_METHODS[d.pop("method")]
        if not method.beta_label:
            d.pop("beta")
        if not method.packing:
            d.pop("packing")
        if self.max_steps and self.max_steps > 0:
            d["num_train_epochs"] = 1.0  # ignored by the Trainer when max_steps > 0
        else:
            d["max_steps"] = -1
        from notebookkit.compat import trainer_checkpointing_flag

        # TRL's default for the Trainer's checkpointing switch, named so that transformers 5.24 does not warn that
        # the old name is deprecated (get_peft_model's plan stays in force either way)
        d.update(trainer_checkpointing_flag())
        return d


class TrainingPanel(Panel):
    """Widgets for the trainer settings. Keyword arguments override the defaults (headless runs).

    ``TrainingPanel(max_steps=30, per_device_train_batch_size=4).value.trainer_kwargs()``
    """

    def __init__(self, **overrides: Any) -> None:
        super().__init__()
        v = self._starting_value(TrainingChoice, overrides)
        st = {"description_width": "150px"}
        lay = W.Layout(width="420px")
        # A log slider cannot show 0: a run asked for with learning rate 0 (a control that trains nothing)
        # keeps exactly 0 until the slider is moved.
        self._zero_learning_rate = float(v.learning_rate) == 0.0
        self.learning_rate = styled(
            W.FloatLogSlider(value=float(v.learning_rate) or 1e-6, base=10, min=-6, max=-2, step=0.1,
                             description="learning rate", readout_format=".1e", continuous_update=False,
                             style=st, layout=lay), "nbk-lr-slider")
        by_steps = bool(v.max_steps and v.max_steps > 0)
        self.stop_by = styled(W.ToggleButtons(options=["max steps", "epochs"], value="max steps" if by_steps else "epochs",
                                              description="stop after", style={"description_width": "150px", "button_width": "90px"}),
                              "nbk-stop-by")
        self.max_steps = styled(W.BoundedIntText(value=int(v.max_steps) if by_steps else 60, min=1, max=10**7,
                                                 description="max steps", style=st, layout=W.Layout(width="260px")),
                                "nbk-max-steps")
        self.epochs = styled(W.BoundedFloatText(value=float(v.num_train_epochs), min=0.01, max=1000, step=0.5,
                                                description="epochs", style=st, layout=W.Layout(width="260px")),
                             "nbk-epochs")
        self.batch_size = styled(W.BoundedIntText(value=int(v.per_device_train_batch_size), min=1, max=4096,
                                                  description="batch size", style=st, layout=W.Layout(width="260px")),
                                 "nbk-batch-size")
        self.grad_accum = styled(W.BoundedIntText(value=int(v.gradient_accumulation_steps), min=1, max=4096,
                                                  description="grad. accumulation", style=st,
                                                  layout=W.Layout(width="260px")), "nbk-grad-accum")
        self.warmup = styled(W.BoundedIntText(value=int(v.warmup_steps), min=0, max=10**6, description="warm-up steps",
                                              style=st, layout=W.Layout(width="260px")), "nbk-warmup")
        sched_opts = SCHEDULERS if v.lr_scheduler_type in SCHEDULERS else SCHEDULERS + [v.lr_scheduler_type]
        self.scheduler = styled(W.Dropdown(options=sched_opts, value=v.lr_scheduler_type, description="scheduler",
                                           style=st), "nbk-scheduler")
        opt_opts = OPTIMIZERS if v.optim in OPTIMIZERS else OPTIMIZERS + [v.optim]
        self.optim = styled(W.Dropdown(options=opt_opts, value=v.optim, description="optimizer", style=st),
                            "nbk-optim")
        self.seed = styled(W.IntText(value=int(v.seed), description="seed", style=st, layout=W.Layout(width="260px")),
                           "nbk-seed")
        self.packing = styled(W.Checkbox(value=bool(v.packing), description="packing (padding-free batches)",
                                         indent=False), "nbk-packing")
        record = TRAINING_METHODS[v.method]
        switch = panel_methods(record.panel)  # fixed per panel: which methods it switches between
        self.method = styled(
            W.ToggleButtons(options=[(m.label, key) for key, m in switch.items()], value=v.method, description="method",
                            style={"description_width": "150px", "button_width": "90px"}), "nbk-method")
        self.beta = styled(W.BoundedFloatText(value=float(v.beta), min=0.0, max=100.0, step=0.01,
                                              description=record.beta_label or "beta", style=st,
                                              layout=W.Layout(width="260px")), "nbk-beta")
        self.summary = styled(W.HTML(""), "nbk-training-summary")
        self._controls = [self.learning_rate, self.stop_by, self.max_steps, self.epochs, self.batch_size,
                          self.grad_accum, self.warmup, self.scheduler, self.optim, self.seed, self.packing,
                          self.method, self.beta]
        # rows that depend on the method: the switch above the schedule, packing or beta below the seed
        top = [self.method] if len(switch) > 1 else []
        bottom = ([self.packing] if record.packing else []) + ([self.beta] if record.beta_label else [])
        self.widget = styled(
            W.VBox([header("Training", record.panel_title), *top,
                    self.learning_rate, self.stop_by, self.max_steps, self.epochs,
                    W.HBox([self.batch_size, self.grad_accum]), self.warmup, self.scheduler, self.optim, self.seed,
                    *bottom, self.summary]),
            "nbk-panel", "nbk-training-panel",
        )
        self.learning_rate.observe(self._slider_moved, names="value")
        self._wire()
        self.on_change(lambda _p: self._update())
        self._update()

    def _slider_moved(self, change: dict) -> None:
        self._zero_learning_rate = False

    def _update(self) -> None:
        steps = self.stop_by.value == "max steps"
        self.max_steps.layout.display = None if steps else "none"
        self.epochs.layout.display = "none" if steps else None
        v = self.value
        method = TRAINING_METHODS[v.method]
        note = method.note
        self.summary.value = (
            f"<div style='color:#555'>effective batch: {v.effective_batch_size} {method.batch_unit} per optimizer step"
            + (f"<br>{note}" if note else "")
            + ("<br>learning rate 0: a control run, nothing trains (move the slider to train)"
               if self._zero_learning_rate else "") + "</div>"
        )

    @property
    def value(self) -> TrainingChoice:
        steps = self.stop_by.value == "max steps"
        return TrainingChoice(
            learning_rate=0.0 if self._zero_learning_rate else float(f"{self.learning_rate.value:.3g}"),
            num_train_epochs=float(self.epochs.value),
            max_steps=int(self.max_steps.value) if steps else -1,
            per_device_train_batch_size=int(self.batch_size.value),
            gradient_accumulation_steps=int(self.grad_accum.value),
            warmup_steps=int(self.warmup.value),
            lr_scheduler_type=str(self.scheduler.value),
            seed=int(self.seed.value),
            packing=bool(self.packing.value) and TRAINING_METHODS[str(self.method.value)].packing,
            optim=str(self.optim.value),
            method=str(self.method.value),
            beta=float(self.beta.value),
        )
