"""Training presets around TRL trainers (SFT, DPO, ORPO, GRPO), reward helpers, the calibration run,
and held-out evaluation. Imported on first use::

    from notebookkit.train import make_sft_trainer, calibrate, answer_loss, exact_match
    from notebookkit.train import FastDPOTrainer, FastORPOTrainer, ORPOConfig, FastGRPOTrainer
    from notebookkit.train import format_reward, correctness_reward
"""

from __future__ import annotations

from notebookkit._lazy import lazy_exports
from notebookkit.training_methods import TRAINING_METHODS

_LAZY = {
    "sft_config": "sft",
    "make_sft_trainer": "sft",
    "precision_flags": "sft",
    "check_sft_dataset": "sft_inputs",
    "SFTInputError": "sft_inputs",
    "calibrate": "calibration",
    "CalibrationResult": "calibration",
    "QAItem": "evaluation",
    "split_heldout": "evaluation",
    "qa_items": "evaluation",
    "answer_loss": "evaluation",
    "exact_match": "evaluation",
    "generate_reply": "evaluation",
    "normalize_answer": "evaluation",
    "check_preference_dataset": "preference_inputs",
    "PreferenceInputError": "preference_inputs",
    "ORPOConfig": "orpo",
    "check_grpo_dataset": "grpo_inputs",
    "GRPOInputError": "grpo_inputs",
    "format_reward": "rewards",
    "correctness_reward": "rewards",
    "checked_reward": "rewards",
    "completion_text": "rewards",
    "extract_tagged_answer": "rewards",
    "RewardFunctionError": "rewards",
    "untrained_tokens": "token_rows",
    "train_token_rows": "token_rows",
    # each method's trainer class, from notebookkit.train.<method name> (the training-method record)
    **{method.trainer: method.name for method in TRAINING_METHODS.values()},
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
__all__ = list(_LAZY)
