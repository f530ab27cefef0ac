"""ORPO on a FastLanguageModel: TRL's ``ORPOTrainer`` (in ``trl.experimental.orpo`` since TRL 1.x) with the
data checked first.

Odds Ratio Preference Optimisation needs no reference model. With the length-averaged log-probability
``p(y | x) = exp(mean_t log pi_theta(y_t | x, y_<t))`` and ``odds(y) = p / (1 - p)``,

    L = NLL(x, y_w) - lambda * log sigmoid(log odds(y_w) - log odds(y_l))

the SFT loss on the chosen answer plus an odds-ratio term (``ORPOConfig(beta=lambda)``, 0.1 by
default). TRL logs ``rewards/chosen`` / ``rewards/rejected`` as ``beta * mean log p`` of each side, and
``rewards/margins`` / ``rewards/accuracies`` from them, like DPO (the dashboard shows both alike), plus
``nll_loss`` and ``log_odds_ratio``.

:class:`FastORPOTrainer` is that trainer, used the same way (``from trl.experimental.orpo import
ORPOConfig``, or :func:`orpo_config_class`, which finds it in either TRL home), plus the
preference-data check of :func:`notebookkit.train.dpo.check_preference_dataset`. The loss of a
micro-batch is computed in :meth:`FastORPOTrainer._loss`; today that is TRL's computation, which
runs the model's forward to full ``[2B, T, V]`` logits (the patched forward returns them when it is
given no labels), and it is the seam where ``notebookkit.train.rl_losses`` takes over.
"""

from __future__ import annotations

import warnings
from typing import Any

from .trainer_glue import built_once

__all__ = ["FastORPOTrainer", "orpo_config_class", "orpo_trainer_class"]


def _trl_orpo() -> tuple[type, type]:
    """``(ORPOConfig, ORPOTrainer)`` from where the installed TRL keeps them."""
    try:
        with warnings.catch_warnings():  # trl.experimental's import notice: this module names the home on purpose
            warnings.filterwarnings("ignore", message=".*trl.experimental.*")
            from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    except ImportError:  # TRL before 1.0 exported them at the top level
        from trl import ORPOConfig, ORPOTrainer
    return ORPOConfig, ORPOTrainer


def orpo_config_class() -> type:
    """TRL's ``ORPOConfig`` (``trl.experimental.orpo`` in TRL 1.x, ``trl`` before)."""
    return _trl_orpo()[0]


def orpo_trainer_class() -> type:
    """TRL's ``ORPOTrainer`` (``trl.experimental.orpo`` in TRL 1.x, ``trl`` before)."""
    return _trl_orpo()[1]


@built_once(__name__, "FastORPOTrainer")
def _fast_orpo_trainer_class() -> type:
    ORPOTrainer = orpo_trainer_class()

    from .dpo import check_preference_datasets
    from .adapter_dtype import keep_fp32_adapters_under_fp16
    from .trainer_glue import bind_trainer_arguments, print_banner

    class FastORPOTrainer(ORPOTrainer):
        """TRL's ``ORPOTrainer`` for a model from ``FastLanguageModel``: same arguments, same use.

        ``FastORPOTrainer(model=model, args=ORPOConfig(...), train_dataset=pairs,
        processing_class=tokenizer)``. The data sets are checked before TRL builds anything. Plus:

        Args:
            show_banner: print one line saying what the trainer computes.
        """

        def __init__(self, *args: Any, show_banner: bool = True, **kwargs: Any) -> None:
            arguments = bind_trainer_arguments(ORPOTrainer, args, kwargs)
            if arguments.get("args") is None:
                raise TypeError(
                    "FastORPOTrainer needs args=ORPOConfig(...) (TRL's ORPOTrainer has no default config), e.g. "
                    "ORPOConfig(output_dir='outputs/orpo', beta=0.1, max_length=512); from "
                    "notebookkit.train import ORPOConfig finds the class in the installed TRL."
                )
            if arguments.get("train_dataset") is None:
                raise TypeError("FastORPOTrainer needs a train_dataset of prompt / chosen / rejected rows.")
            check_preference_datasets(arguments, "ORPOTrainer", tokenised=False)
            super().__init__(**arguments)
            keep_fp32_adapters_under_fp16(self)  # TRL casts a quantised model's adapters to bf16 even for fp16
            if show_banner:
                print_banner(self, f"ORPO (lambda = beta = {self.beta}); no reference model (ORPO needs none)")

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return self._loss(model, inputs, return_outputs)

        def _loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False) -> Any:
            """The ORPO loss of one micro-batch (and its metrics): TRL's computation today.

            The seam for notebookkit's chunked log-prob loss (``notebookkit.train.rl_losses``): the
            chosen answer's NLL and both answers' mean log-probs, from one concatenated batch.
            """
            return super().compute_loss(model, inputs, return_outputs=return_outputs)

    return FastORPOTrainer


def __getattr__(name: str) -> Any:
    if name == "FastORPOTrainer":  # built on first use: importing TRL takes seconds
        return _fast_orpo_trainer_class()
    if name == "ORPOConfig":
        return orpo_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
