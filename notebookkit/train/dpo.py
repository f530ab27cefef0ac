"""DPO on a FastLanguageModel: TRL's ``DPOTrainer`` with the data checked first and no second model.

Direct Preference Optimisation trains on pairs (prompt ``x``, chosen ``y_w``, rejected ``y_l``). With the
implicit reward ``r(x, y) = beta * (log pi_theta(y | x) - log pi_ref(y | x))`` (log-probabilities summed
over the completion's tokens), the losses are

    sigmoid (DPO):  L = -log sigmoid(r(x, y_w) - r(x, y_l))
    ipo:            L = ((log-ratio_w / |y_w| - log-ratio_l / |y_l|) - 1 / (2 beta))^2

(``DPOConfig(loss_type="ipo")``; TRL averages IPO's log-ratios per token). TRL logs, per step,
``rewards/chosen`` and ``rewards/rejected`` (the mean ``r`` of each side), ``rewards/margins`` (their
difference) and ``rewards/accuracies`` (the fraction of pairs with ``r_w > r_l``); before the first
update ``pi_theta = pi_ref``, so all four are 0, and training should raise the margin and accuracy.

:class:`FastDPOTrainer` is ``trl.DPOTrainer``, used the same way, plus:

* the data sets are checked before TRL sees them (:func:`check_preference_dataset`): a missing
  ``prompt`` / ``chosen`` / ``rejected`` column is named, with the expected format;
* the reference is the same weights (:mod:`notebookkit.train.reference`): a fresh adapter's reference
  is the model with the adapters disabled, and a model without adapters is refused rather than
  copied;
* the loss of a micro-batch is computed in one method, :meth:`FastDPOTrainer._loss`, on notebookkit's
  fused path: TRL's batch and masks, per-token log-probs from
  :func:`~notebookkit.train.token_logprobs.token_logprobs` (chunked LM head, never ``[2P, T, V]``
  logits) for the policy and, without gradient, for the reference (the same weights, adapters off),
  and :func:`~notebookkit.train.rl_losses.dpo_loss` (``sigmoid``, ``ipo``, ``robust``, or a weighted
  list). It logs TRL's metrics under TRL's names (``rewards/*``, ``logps/*``, ``logits/*``,
  ``entropy``, ``mean_token_accuracy``, ``num_tokens``), which the dashboard reads. A setting it
  does not implement (another loss type, ``ld_alpha``, ``use_weighting``, an f-divergence, images,
  several processes) runs TRL's own computation, said once in a warning;
* under ``fp16=True`` the adapters train as fp32 master weights (:mod:`notebookkit.models.patching.master_weights`).
"""

from __future__ import annotations

from typing import Any, Optional

from trl import DPOTrainer

from notebookkit.compat import quiet_checkpointing_flag_deprecation
from notebookkit.training_methods import training_method

from .preference_inputs import (
    PREFERENCE_COLUMNS, PreferenceInputError, check_preference_dataset, check_preference_datasets,
)
from .reference import describe_reference, reference_policy, refuse_second_model, use_base_as_reference
from .rl_losses import DPO_LOSS_TYPES, dpo_loss
from .token_logprobs import token_logprobs
from .trainer_glue import (
    bind_trainer_arguments, fall_back_once, print_banner, shared_fallback_reason, unsupported_inputs,
)
from .trl_compat import has_image_dataset, log_token_count, logged_metrics

__all__ = ["PreferenceInputError", "check_preference_dataset", "FastDPOTrainer", "PREFERENCE_COLUMNS"]

#: DPO's row of the training-method record
DPO = training_method("dpo")

#: the batch keys of TRL's DPO collator that the fused path reads
_BATCH_KEYS = ("input_ids", "attention_mask", "completion_mask", "ref_chosen_logps", "ref_rejected_logps")


def _masked_mean(values: Any, mask: Any) -> float:
    """Mean of ``values`` where ``mask`` is set, 0.0 when nothing is (TRL's convention for these metrics)."""
    count = mask.sum().item()
    return (values[mask].sum() / count).item() if count > 0 else 0.0


class FastDPOTrainer(DPOTrainer):
    """TRL's ``DPOTrainer`` for a model from ``FastLanguageModel``: same arguments, same use.

    ``FastDPOTrainer(model=model, ref_model=None, args=DPOConfig(...), train_dataset=pairs,
    processing_class=tokenizer)``. The data sets are checked before TRL builds anything; the
    reference is the same weights (adapters disabled while the adapter is fresh, else TRL's frozen
    adapter copy; never a second model). ``DPOConfig(loss_type="ipo")`` selects IPO. The loss runs on
    the fused path (module notes). Plus:

    Args:
        show_banner: print one line saying what the reference is.
    """

    def __init__(self, *args: Any, show_banner: bool = True, **kwargs: Any) -> None:
        arguments = bind_trainer_arguments(DPOTrainer, args, kwargs)
        check_preference_datasets(arguments, "DPOTrainer", tokenised=True)
        if not getattr(arguments.get("args"), "precompute_ref_log_probs", False):
            refuse_second_model(
                arguments.get("model"), arguments.get("ref_model"), arguments.get("peft_config"),
                trainer=DPO.trainer, reference_off="DPOConfig(precompute_ref_log_probs=True)",
            )
        super().__init__(**arguments)
        use_base_as_reference(self.model)
        if show_banner:
            print_banner(self, f"{DPO.label} ({', '.join(self.loss_types)}, beta={self.beta}); reference: "
                               f"{describe_reference(self)}")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return self._loss(model, inputs, return_outputs)

    def _loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False) -> Any:
        """The DPO loss of one micro-batch, with TRL's metrics, on notebookkit's fused path.

        TRL's batch (``[chosen; rejected]`` concatenated, ``completion_mask`` marking the answers) is
        scored by :func:`~notebookkit.train.token_logprobs.token_logprobs` (chunked LM head, never
        ``[2P, T, V]`` logits) for the policy and, under ``torch.no_grad``, for the reference (the same
        weights with the adapters disabled, :func:`~notebookkit.train.reference.reference_policy`);
        the loss is :func:`~notebookkit.train.rl_losses.dpo_loss`. A setting the fused path does not
        implement (:meth:`_fused_unsupported`) runs TRL's computation, with one warning.
        """
        reason = self._fused_unsupported(inputs, return_outputs)
        if reason is not None:
            fall_back_once(self, reason)
            with quiet_checkpointing_flag_deprecation():  # TRL's loss reads transformers' deprecated flag
                return super().compute_loss(model, inputs, return_outputs=return_outputs)
        return self._fused_loss(model, inputs)

    def _fused_unsupported(self, inputs: dict[str, Any], return_outputs: bool = False) -> Optional[str]:
        """Why this batch cannot take the fused path (a sentence naming the setting), or None."""
        if return_outputs:
            return "return_outputs=True (logits for compute_metrics) was asked for"
        shared = shared_fallback_reason(self, "router_aux_loss_coef")
        if shared is not None:
            return shared
        if has_image_dataset(self):
            return "the data set has images"
        if self.ld_alpha is not None:
            return f"DPOConfig(ld_alpha={self.ld_alpha}) (LD-DPO) is set; leave ld_alpha=None"
        if self.f_divergence_type != "reverse_kl":
            return f"DPOConfig(f_divergence_type={self.f_divergence_type!r}); 'reverse_kl' is fused"
        if self.use_weighting:
            return "DPOConfig(use_weighting=True) (WPO) is set"
        other = [t for t in self.loss_types if t not in DPO_LOSS_TYPES]
        if other:
            return f"DPOConfig(loss_type={other}) is set; the fused losses are {list(DPO_LOSS_TYPES)}"
        if self.label_smoothing and {"sigmoid", "robust"} <= set(self.loss_types):
            return "label_smoothing with both 'sigmoid' and 'robust' losses is set"
        extra = unsupported_inputs(inputs, set(_BATCH_KEYS))
        if extra:
            return f"the batch carries {extra}, which the fused path does not pass to the model"
        return None

    def _score(self, model: Any, inputs: dict[str, Any], **extras: bool) -> Any:
        """Per-token log-probs of the completions (prompt and padding 0), ``[2P, T - 1]``."""
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        return token_logprobs(model, inputs["input_ids"], inputs["attention_mask"], labels=labels, **extras)

    def compute_ref_log_probs(self, model, inputs):
        """The reference's summed completion log-probs ``(chosen [P], rejected [P])`` of one batch (TRL's
        ``precompute_ref_log_probs`` pass), through :func:`token_logprobs`."""
        if self._fused_unsupported(inputs) is not None:
            with quiet_checkpointing_flag_deprecation():  # as above
                return super().compute_ref_log_probs(model, inputs)
        with reference_policy(self) as reference, self.accelerator.autocast():
            return self._score(reference, inputs).sum(1).chunk(2, dim=0)

    def _fused_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
        mode = "train" if self.model.training else "eval"
        logps, entropy, mean_logits, is_top1 = self._score(model, inputs, return_entropy=True,
                                                           return_logit_stats=True)
        chosen_logps, rejected_logps = logps.sum(1).chunk(2, dim=0)
        if self.precompute_ref_logps:
            ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:
            with reference_policy(self) as reference:
                ref_chosen, ref_rejected = self._score(reference, inputs).sum(1).chunk(2, dim=0)
        chosen_lengths, rejected_lengths = inputs["completion_mask"].sum(1).float().chunk(2, dim=0)
        loss, metrics = dpo_loss(
            chosen_logps, rejected_logps, ref_chosen, ref_rejected, beta=self.beta, loss_type=self.loss_types,
            loss_weights=self.loss_weights, label_smoothing=self.label_smoothing if "robust" in self.loss_types else 0.0,
            chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths,
        )
        self._log_fused_metrics(mode, inputs, metrics, entropy, mean_logits, is_top1)
        return loss

    def _log_fused_metrics(self, mode: str, inputs: dict[str, Any], metrics: dict[str, Any], entropy: Any,
                           mean_logits: Any, is_top1: Any) -> None:
        """Append TRL's DPO metrics (the same keys and values as its ``_compute_loss``) to TRL's metric store."""
        mask = inputs["completion_mask"][:, 1:].bool()
        chosen_mask, rejected_mask = mask.chunk(2, dim=0)
        logged = logged_metrics(self, mode)
        logged["entropy"].append(_masked_mean(entropy, mask))
        log_token_count(self, mode, int(inputs["attention_mask"].sum().item()))
        chosen_logits, rejected_logits = mean_logits.chunk(2, dim=0)
        logged["logits/chosen"].append(_masked_mean(chosen_logits, chosen_mask))
        logged["logits/rejected"].append(_masked_mean(rejected_logits, rejected_mask))
        logged["mean_token_accuracy"].append(_masked_mean(is_top1.chunk(2, dim=0)[0].float(), chosen_mask))
        for key, value in metrics.items():
            logged[key].append(value.item())
