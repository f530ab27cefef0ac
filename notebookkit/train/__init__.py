"""Training presets around TRL trainers, the calibration run, held-out evaluation, and the
headless notebook runner. Imported on first use::

    from notebookkit.train import make_sft_trainer, calibrate, answer_loss, exact_match
"""

from __future__ import annotations

from notebookkit._lazy import lazy_exports

_LAZY = {
    "sft_config": "sft",
    "make_sft_trainer": "sft",
    "FastSFTTrainer": "sft",
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
    "run_notebook": "headless",
    "NotebookRun": "headless",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
__all__ = list(_LAZY)
