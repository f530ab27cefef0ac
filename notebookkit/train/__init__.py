"""Training presets around TRL trainers (SFT, DPO, ORPO, GRPO), reward helpers, the calibration run,
and held-out evaluation. Imported on first use::

    from notebookkit.train import make_sft_trainer, calibrate, answer_loss, exact_match
    from notebookkit.train import FastDPOTrainer, FastORPOTrainer, ORPOConfig, FastGRPOTrainer
    from notebookkit.train import format_reward, correctness_reward
"""

from __future__ import annotations

from notebookkit._lazy import lazy_package
from notebookkit.training_methods import TRAINING_METHODS

__getattr__, __dir__, __all__ = lazy_package(__name__, {
    "sft": ("sft_config", "make_sft_trainer", "precision_flags"),
    "sft_inputs": ("check_sft_dataset", "SFTInputError"),
    "calibration": ("calibrate", "CalibrationResult"),
    "evaluation": ("QAItem", "split_heldout", "qa_items", "answer_loss", "exact_match", "generate_reply",
                   "normalize_answer"),
    "preference_inputs": ("check_preference_dataset", "PreferenceInputError"),
    "orpo": ("ORPOConfig",),
    "grpo_inputs": ("check_grpo_dataset", "GRPOInputError"),
    "rewards": ("format_reward", "correctness_reward", "checked_reward", "completion_text",
                "extract_tagged_answer", "RewardFunctionError"),
    "token_rows": ("untrained_tokens", "train_token_rows"),
    # and each method's trainer class, from notebookkit.train.<method name> (the training-method record)
}, more={method.trainer: method.name for method in TRAINING_METHODS.values()})
