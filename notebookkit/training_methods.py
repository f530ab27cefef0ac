"""The training methods notebookkit runs: one record per method, read by every layer.

Adding a method is one :class:`TrainingMethod` row in :data:`TRAINING_METHODS` plus its trainer and
tests; everything that depends on a method reads the row:

* the memory model (:mod:`notebookkit.memory.estimate`): rows per example ("a pair is two rows"),
  which loss buffers (cross-entropy or per-token log-probs), a reference pass, a loss over the
  completion only, generation alongside training;
* the activation planner (:mod:`notebookkit.memory.planner`): the rows a batch puts through the tower;
* the training panel (:mod:`notebookkit.widgets.training_panel`): which fields it shows, the batch
  unit, the note and the switch between methods that share a panel;
* the trainers (:mod:`notebookkit.train`: ``trainer``, exported lazily from ``notebookkit.train.<name>``;
  their banners and timing keys) and the metrics they log (``metrics``, TRL's log keys);
* the live dashboard (:mod:`notebookkit.widgets.rl_metrics`): which view draws a run's metrics, told
  apart by the first of them, and the parts of a step it times.

``tests/test_training_methods.py`` fails when a row lacks any of these consumers.

This module imports nothing (no torch, no trl), so every layer can read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainingMethod:
    """Everything notebookkit knows about one training method.

    Memory model:

    * ``rows_per_example``: rows one example puts through the model (2 for a preference pair: chosen
      and rejected go through as one batch of ``2 * batch_size`` rows);
    * ``logprob_loss``: the loss reads per-token log-probs (``kernels.linear_logprobs``: the fused
      cross-entropy's buffers plus an fp32 entropy per row) instead of the cross-entropy;
    * ``reference_pass``: a no-grad forward of the reference model (adapters off) after the policy's
      forward, while the policy's activations are saved (DPO);
    * ``completion_loss``: only the completion's positions reach the LM head (``logits_to_keep``, GRPO);
    * ``generates``: generation alongside training, on the same model (GRPO).

    Training panel:

    * ``panel``: the panel the method is chosen in; methods sharing one get a switch (DPO / ORPO);
      ``panel_title``: its subtitle; ``label``: the switch's label;
    * ``batch_unit``: what a batch counts; ``packing``: the panel offers packing (SFT);
      ``beta_label``: the label of its ``beta`` field (``""``: none); ``note``: a line under the batch size.

    Trainer and dashboard:

    * ``trainer``: its trainer class, defined in ``notebookkit.train.<name>`` and exported by
      :mod:`notebookkit.train`;
    * ``metrics``: TRL's log keys it adds to the loss; the first one marks a run of this method in the logs;
    * ``dashboard``: the live dashboard's view of those metrics (``""``: none, the loss curve only);
    * ``step_times``: log keys of the seconds one optimizer step spends in each part (generation, scoring,
      training), which its trainer logs and the dashboard stacks.
    """

    name: str
    label: str
    trainer: str
    rows_per_example: int = 1
    logprob_loss: bool = False
    reference_pass: bool = False
    completion_loss: bool = False
    generates: bool = False
    panel: str = ""
    panel_title: str = ""
    batch_unit: str = "sequences"
    packing: bool = False
    beta_label: str = ""
    note: str = ""
    metrics: tuple[str, ...] = ()
    dashboard: str = ""
    step_times: tuple[str, ...] = ()


_PREFERENCE_METRICS = ("rewards/margins", "rewards/chosen", "rewards/rejected", "rewards/accuracies")

TRAINING_METHODS: dict[str, TrainingMethod] = {m.name: m for m in (
    TrainingMethod("sft", "SFT", "FastSFTTrainer", panel="sft", panel_title="optimizer steps and schedule", packing=True),
    TrainingMethod(
        "dpo", "DPO", "FastDPOTrainer", rows_per_example=2, logprob_loss=True, reference_pass=True,
        panel="preference", panel_title="preference optimisation", batch_unit="preference pairs", beta_label="beta",
        note="DPO: beta scales the implicit reward; the reference is the model with adapters off",
        metrics=_PREFERENCE_METRICS, dashboard="preference",
    ),
    TrainingMethod(
        "orpo", "ORPO", "FastORPOTrainer", rows_per_example=2, logprob_loss=True,
        panel="preference", panel_title="preference optimisation", batch_unit="preference pairs", beta_label="beta",
        note="ORPO: SFT loss on the chosen answer + beta x odds-ratio term; no reference",
        metrics=_PREFERENCE_METRICS, dashboard="preference",
    ),
    TrainingMethod(
        "grpo", "GRPO", "FastGRPOTrainer", logprob_loss=True, completion_loss=True, generates=True,
        panel="grpo", panel_title="reinforcement learning (GRPO)", batch_unit="completions", beta_label="KL beta",
        note="GRPO: the batch is prompts x generations; beta > 0 adds a KL term to the reference",
        metrics=("reward", "reward_std", "kl", "completions/mean_length"), dashboard="grpo",
        step_times=("time/generation", "time/scoring", "time/training"),
    ),
)}


def training_method(name: str) -> TrainingMethod:
    """The record of method ``name`` (``"sft"``, ``"dpo"``, ...); a readable error otherwise."""
    try:
        return TRAINING_METHODS[name]
    except KeyError:
        raise ValueError(f"Unknown training method {name!r}; the methods are: {', '.join(TRAINING_METHODS)}.") from None


def panel_methods(panel: str) -> dict[str, TrainingMethod]:
    """The methods chosen in one panel (``"preference"`` -> DPO and ORPO), in the table's order."""
    return {name: m for name, m in TRAINING_METHODS.items() if m.panel == panel}


def dashboard_methods(view: str) -> dict[str, TrainingMethod]:
    """The methods whose metrics the dashboard's ``view`` draws (``"preference"`` -> DPO and ORPO)."""
    return {name: m for name, m in TRAINING_METHODS.items() if m.dashboard == view}
