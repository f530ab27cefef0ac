"""Every private name of TRL that notebookkit's trainers read, write or override, in one place.

The trainers in this package subclass TRL's and use TRL's public interface where there is one. What is
left has no public equivalent: the hook points where GRPO generates and scores completions, and the
trainer's metric store and counters that TRL logs from. Each entry says what it touches and on which TRL
versions that was read in TRL's source; ``tests/train/test_trl_compat.py`` fails when the installed TRL
stops having a name, and ``tests/train/test_trl_private_names.py`` when a private TRL name is used in
``notebookkit/train`` outside this module.

Why here and not in :mod:`notebookkit.compat`: TRL is a dependency of the train layer only
(nothing below ``train/`` imports it), and the GRPO hooks are methods of a trainer class that call back
into the trainer; in ``models/`` they would be trainer knowledge on a floor below the trainers.
``models/compat.py`` keeps the private names of transformers, accelerate and bitsandbytes, which models/
and memory/ read, and points here. Imports nothing from TRL.

Supported range (``pyproject.toml``): TRL ``>=0.24,<2``. Read on TRL 0.24.0 and 1.16.0; where a name is
missing on 0.24 the entry says so (the trainer that reads it needs a newer TRL, as before).
"""

from __future__ import annotations

from typing import Any

__all__ = ["GRPOHookPoints", "logged_metrics", "micro_steps", "entropy_bonus_enabled", "has_image_dataset",
           "trl_counts_train_tokens", "trl_add_train_tokens", "log_token_count"]


# ---- GRPOTrainer: where it generates and scores --------------------------------------------------------
# Read on TRL 0.24.0 and 1.16.0: ``GRPOTrainer._generate_and_score_completions(inputs)`` turns a batch of
# prompts into TRL's prepared batch (completions, rewards, advantages, old / reference log-probs); it
# generates through ``_generate_single_turn(...)`` (one ``generate`` call on the unwrapped model, or vLLM)
# and scores through ``_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
# batch_size=None, compute_entropy=False, ...)`` -> ``(logps, entropies, ...)``, which ``_compute_loss``
# calls too. Arguments pass through unchanged, so signature differences between versions do not matter.


class GRPOHookPoints:
    """TRL's private ``GRPOTrainer`` hooks under public names: mixed in before ``trl.GRPOTrainer``.

    ``class FastGRPOTrainer(GRPOHookPoints, GRPOTrainer)`` overrides :meth:`generate_single_turn`,
    :meth:`generate_and_score_completions` and :meth:`per_token_logps_and_entropies`; TRL's private hook
    calls each, and ``trl_<name>`` runs TRL's own implementation (what ``super()`` would).
    """

    # what TRL calls
    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        return self.generate_single_turn(*args, **kwargs)

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        return self.generate_and_score_completions(inputs)

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        return self.per_token_logps_and_entropies(*args, **kwargs)

    # TRL's own implementations
    def trl_generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``_generate_single_turn``: completions of one batch of prompts."""
        return super()._generate_single_turn(*args, **kwargs)

    def trl_generate_and_score_completions(self, inputs: Any) -> Any:
        """TRL's ``_generate_and_score_completions``: the prepared batch of one generation round."""
        return super()._generate_and_score_completions(inputs)

    def trl_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``_get_per_token_logps_and_entropies``: per-token log-probs (and entropies) of completions."""
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    # the names a subclass overrides: TRL's own implementations until it does
    generate_single_turn = trl_generate_single_turn
    generate_and_score_completions = trl_generate_and_score_completions
    per_token_logps_and_entropies = trl_per_token_logps_and_entropies


# ---- every TRL trainer: the metric store ---------------------------------------------------------------
# Read on TRL 0.24.0 and 1.16.0: ``self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}``;
# ``log()`` averages each list into the logged value of that key and clears the store.


def logged_metrics(trainer: Any, mode: str) -> dict[str, list]:
    """TRL's metric store of ``mode`` (``"train"`` / ``"eval"``): key -> values, averaged into the next log."""
    return trainer._metrics[mode]


# ---- GRPOTrainer: counters and switches ----------------------------------------------------------------
# Read on TRL 0.24.0 and 1.16.0: ``training_step`` adds 1 to ``self._step`` per micro-step (it picks the
# generation round from it). On 1.16.0 ``self._entropy_bonus_enabled`` says whether ``entropy_coef`` or the
# adaptive entropy bonus is on (0.24 has no entropy bonus, nor this name).


def micro_steps(trainer: Any) -> int:
    """The micro-steps GRPOTrainer has counted (``training_step`` adds 1 per call)."""
    return trainer._step


def entropy_bonus_enabled(trainer: Any) -> bool:
    """Whether GRPO's loss adds an entropy bonus (``GRPOConfig(entropy_coef=...)`` / adaptive entropy)."""
    return trainer._entropy_bonus_enabled


# ---- DPOTrainer: the data set kind ---------------------------------------------------------------------
# Read on TRL 1.16.0: ``DPOTrainer.__init__`` sets ``self._is_vision_dataset`` (rows with images). TRL 0.24's
# DPOTrainer (the older implementation) has no such name.


def has_image_dataset(trainer: Any) -> bool:
    """Whether DPOTrainer found images in its data set."""
    return trainer._is_vision_dataset


# ---- SFTTrainer / DPOTrainer: the cumulative token count -----------------------------------------------
# Read on TRL 0.24.0, 1.15.0, 1.16.0: ``SFTTrainer.__init__`` sets ``self._total_train_tokens = 0`` (1.x
# also ``self._tp_size``, the tensor-parallel size, 1 without it); ``SFTTrainer.compute_loss`` adds each
# micro-batch's token count (divided by ``_tp_size``) and logs ``_metrics["train"]["num_tokens"]``. DPOTrainer
# does the same in 1.16.0 (``_metrics[mode]["num_tokens"]``, counting only in training; 0.24 has neither).
# notebookkit's fused losses replace those ``compute_loss`` methods, so they keep the count the same way.


def trl_counts_train_tokens(trainer: Any) -> bool:
    """Whether ``trainer`` keeps TRL's cumulative ``num_tokens`` train metric."""
    metrics = getattr(trainer, "_metrics", None)
    return isinstance(metrics, dict) and "train" in metrics and hasattr(trainer, "_total_train_tokens")


def trl_add_train_tokens(trainer: Any, tokens: int) -> None:
    """Add ``tokens`` (the step's micro-batch, summed over processes) to TRL's ``num_tokens`` metric."""
    log_token_count(trainer, "train", tokens)


def log_token_count(trainer: Any, mode: str, tokens: int) -> None:
    """Log TRL's cumulative ``num_tokens`` under ``mode``, adding ``tokens`` to it first in training."""
    if mode == "train":
        trainer._total_train_tokens += tokens // getattr(trainer, "_tp_size", 1)
    trainer._metrics[mode]["num_tokens"] = [trainer._total_train_tokens]
