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
preference-data check of :func:`notebookkit.train.dpo.check_preference_dataset`, fp32 adapters under
``fp16=True``, and the loss on notebookkit's fused path: :meth:`FastORPOTrainer.get_batch_loss_metrics`
(training and evaluation) scores TRL's concatenated ``[chosen; rejected]`` batch once with
:func:`~notebookkit.train.token_logprobs.token_logprobs` (chunked LM head; TRL's own computation runs the
model's forward to full ``[2P, T, V]`` logits) and computes :func:`~notebookkit.train.rl_losses.orpo_loss`,
logging TRL's keys (``logits/*`` from :mod:`~notebookkit.train.logit_statistics`). An encoder-decoder,
an MoE router loss, images or several processes run TRL's computation, said once in a warning.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from notebookkit.training_methods import training_method

from .preference_inputs import check_preference_datasets
from .rl_losses import orpo_loss, sequence_logps
from .token_logprobs import token_logprobs
from .trainer_glue import bind_trainer_arguments, fall_back_once, print_banner, shared_fallback_reason

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


#: ORPO's row of the training-method record
ORPO = training_method("orpo")

#: TRL's ORPO config and trainer, from where the installed TRL keeps them
ORPOConfig, ORPOTrainer = _trl_orpo()


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
        if show_banner:
            print_banner(self, f"{ORPO.label} (lambda = beta = {self.beta}); no reference model (ORPO needs none)")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return self._loss(model, inputs, return_outputs)

    def _loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False) -> Any:
        """The ORPO loss of one micro-batch (and its metrics): TRL's ``compute_loss`` (its autocast,
        its metric store) around :meth:`get_batch_loss_metrics`, which is notebookkit's fused path."""
        return super().compute_loss(model, inputs, return_outputs=return_outputs)

    def _fused_unsupported(self, batch: dict[str, Any]) -> Optional[str]:
        """Why this batch cannot take the fused path (a sentence naming the setting), or None."""
        shared = shared_fallback_reason(self, "output_router_logits")
        if shared is not None:
            return shared
        if self.is_encoder_decoder:
            return "the model is an encoder-decoder"
        extra = [k for k, v in batch.items() if k.endswith("pixel_values") and v is not None]
        if extra:
            return f"the batch carries images ({extra})"
        return None

    def get_batch_loss_metrics(self, model, batch, train_eval="train"):
        """ORPO's loss and TRL's metrics for a batch (training and evaluation), without ``[2P, T, V]`` logits.

        TRL's concatenated ``[chosen; rejected]`` batch is scored once by
        :func:`~notebookkit.train.token_logprobs.token_logprobs` on every non-padding token: the chosen
        rows' mean gives the NLL term (prompt and answer, as TRL), the answer tokens' per-sequence
        mean log-probs give the odds ratio (:func:`~notebookkit.train.rl_losses.orpo_loss`). TRL's
        ``logits/*`` (mean logit over the vocabulary and every position) come from the chunked
        :mod:`~notebookkit.train.logit_statistics`.
        """
        reason = self._fused_unsupported(batch)
        if reason is not None:
            fall_back_once(self, reason)
            return super().get_batch_loss_metrics(model, batch, train_eval)
        joined = self.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=self.padding_value,
                                          device=self.accelerator.device)
        input_ids, attention_mask = joined["concatenated_input_ids"], joined["concatenated_attention_mask"]
        answer_labels = joined["concatenated_labels"]
        n_chosen = batch["chosen_labels"].shape[0]
        every_token = input_ids.masked_fill(attention_mask != 1, -100)
        scored = answer_labels != -100
        if not torch.equal(answer_labels[scored], every_token[scored]):
            raise ValueError(
                "ORPO's answer labels differ from the input ids at the answer tokens; FastORPOTrainer reads them "
                "as TRL's tokenize_row writes them (the input ids with the prompt and padding set to -100)."
            )
        logps, mean_logits, _ = token_logprobs(model, input_ids, attention_mask, labels=every_token,
                                               return_logit_stats=True)
        counted = every_token[:n_chosen, 1:] != -100
        chosen_nll = -logps[:n_chosen].sum() / counted.sum()
        average = sequence_logps(logps, scored[:, 1:], average=True)
        loss, metrics = orpo_loss(average[:n_chosen], average[n_chosen:], chosen_nll, beta=self.beta)
        metrics["logits/chosen"] = mean_logits[:n_chosen].mean()
        metrics["logits/rejected"] = mean_logits[n_chosen:].mean()
        prefix = "eval_" if train_eval == "eval" else ""
        return loss, {f"{prefix}{key}": value.item() for key, value in metrics.items()}
