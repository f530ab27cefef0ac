"""GRPO on a FastLanguageModel: TRL's ``GRPOTrainer`` with generation on notebookkit's decode path, its time
measured, and the data set and reward functions checked before training.

Group Relative Policy Optimisation. For each prompt ``x`` the policy samples ``G = num_generations``
completions ``y_1 .. y_G``; each gets the summed score ``r_i = sum_k w_k R_k(x, y_i)`` of the reward
functions (:mod:`notebookkit.train.rewards`) and the advantage ``A_i = (r_i - mean_j r_j) / std_j r_j``
within its group. With the per-token ratio ``rho_t = pi_theta(y_t | .) / pi_old(y_t | .)`` the loss is

    L = -(1 / N) sum_{i,t} min(rho_t A_i, clip(rho_t, 1 - eps, 1 + eps_high) A_i)  +  beta * KL_t

where ``N`` is the token count of the batch for ``loss_type="dapo"`` (TRL's default), each sequence's
own length for ``"grpo"``, and ``G * max_completion_length`` for ``"dr_grpo"``; ``KL_t`` is the k3
estimate against the reference (:mod:`notebookkit.train.reference`), computed only when
``beta > 0`` (TRL's default is 0). With one update per generation (``num_iterations=1``) ``pi_old``
is ``pi_theta`` detached, so ``rho = 1`` and the gradient is ``-A_i * grad log pi_theta(y_i)``.

:class:`FastGRPOTrainer` is ``trl.GRPOTrainer``, used the same way, plus:

* before anything is built, the data set must have a ``prompt`` column (:func:`check_grpo_dataset`)
  and every reward function must be callable with its columns
  (:func:`~notebookkit.train.rewards.check_reward_functions`); each function is wrapped with
  :func:`~notebookkit.train.rewards.checked_reward`;
* completions come from the unwrapped model's ``generate`` (TRL's path without vLLM), switched into
  ``FastLanguageModel.for_inference`` for the call and back with ``for_training``, so notebookkit's
  decode path generates them;
* the generation cache (KV cache, decode buffers, CUDA graphs) is freed after each generation when
  the model's activation plan recomputes or offloads any layer (memory is short: the training step
  gets the cache's room, and the next generation allocates and captures it again) and kept when it
  keeps every layer (``keep_generation_cache=`` overrides; the memory model follows the same rule,
  :func:`~notebookkit.memory.generation.keeps_cache_between_steps`). Freeing has a price: on an H200
  the 1B GRPO step of ``benchmarks/rl_step.py`` went from 1.58 s at 3.77 GiB to 2.26 s at 3.61 GiB
  (session 13), because every cache-length bucket's decode graph was captured again (0.36 s) and the
  training step allocates anew; a generation after a freed cache now captures one graph for its whole
  request (:mod:`notebookkit.models.generation.generate`; not yet measured on a GPU);
* time per optimizer step goes into the logs: ``time/generation`` (``model.generate``),
  ``time/scoring`` (decoding, reward functions, the old / reference log-probs) and ``time/training``
  (the loss's forward and backward), in seconds;
* per-token log-probs (the policy's in the loss, the old policy's and the reference's after
  generation) come from :func:`~notebookkit.train.token_logprobs.token_logprobs`: the chunked LM head
  on the completion positions only, never ``[B, T, V]`` logits; the reference is the same weights
  inside TRL's adapter context (adapters off, or its frozen ``"ref"`` adapter);
* the loss of a micro-batch is :meth:`FastGRPOTrainer._loss`:
  :func:`~notebookkit.train.rl_losses.grpo_loss` (``grpo``, ``dapo``, ``dr_grpo``; clipping with
  ``epsilon`` / ``epsilon_high``; the k3 KL when ``beta > 0``) on TRL's prepared batch, logging TRL's
  ``entropy``, ``kl`` and ``clip_ratio/*``. Settings it does not implement (other loss types,
  sequence-level importance sampling, the off-policy mask, entropy masks or bonuses, ``delta``, vLLM's
  correction, MoE router losses, images, several processes) run TRL's computation, said once in a
  warning;
* under ``fp16=True`` the adapters train as fp32 master weights (:mod:`notebookkit.models.patching.master_weights`).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from trl import GRPOTrainer

from notebookkit.compat import quiet_checkpointing_flag_deprecation
from notebookkit.training_methods import training_method

from ..memory.estimate import activation_plan_of
from ..memory.generation import keeps_cache_between_steps
from ..models.fast_language_model import FastLanguageModel
from ..models.generation.state import drop_cache
from .grpo_inputs import GRPOInputError, check_grpo_dataset
from .reference import describe_reference, refuse_second_model, use_base_as_reference
from .rewards import checked_reward
from .rl_losses import GRPO_LOSS_TYPES, grpo_loss
from .token_logprobs import token_logprobs
from .trainer_glue import (
    bind_trainer_arguments, fall_back_once, print_banner, shared_fallback_reason, unsupported_inputs,
)
from .trl_compat import GRPOHookPoints, entropy_bonus_enabled, logged_metrics, micro_steps

__all__ = ["GRPOInputError", "check_grpo_dataset", "FastGRPOTrainer", "TIME_KEYS"]

#: GRPO's row of the training-method record
GRPO = training_method("grpo")
#: the timing metrics FastGRPOTrainer logs (seconds per optimizer step)
TIME_KEYS = GRPO.step_times


def _as_list(reward_funcs: Any) -> list:
    if reward_funcs is None:
        return []
    return list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]


def _synchronize(trainer: Any) -> None:
    """Wait for queued GPU work, so the clock measures it (no-op on CPU)."""
    device = getattr(trainer.accelerator, "device", None)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


#: the keys of TRL's prepared GRPO batch that the fused loss reads (the rest it does not pass on)
_LOSS_INPUT_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "advantages",
                    "num_items_in_batch", "old_per_token_logps", "ref_per_token_logps",
                    "sampling_per_token_logps")  # the last feeds only settings that fall back (off-policy mask, vLLM)


class FastGRPOTrainer(GRPOHookPoints, GRPOTrainer):
    """TRL's ``GRPOTrainer`` for a model from ``FastLanguageModel``: same arguments, same use.

    ``FastGRPOTrainer(model=model, reward_funcs=[format_reward, correctness_reward],
    args=GRPOConfig(...), train_dataset=prompts, processing_class=tokenizer)``. Checks the data
    set and reward functions first, wraps the reward functions to report failures by row,
    generates under ``for_inference``, and logs ``time/generation``, ``time/scoring`` and
    ``time/training`` per optimizer step. Plus:

    Args:
        show_banner: print one line saying how completions are generated and what the reference is.
        keep_generation_cache: keep the KV cache and the captured decode step between generations
            (faster: nothing is allocated or captured again) or free them after each one (the
            training step gets their memory). Default ``None``: keep them only when the model's
            activation plan keeps every layer.
    """

    def __init__(self, *args: Any, show_banner: bool = True, keep_generation_cache: Optional[bool] = None,
                 **kwargs: Any) -> None:
        arguments = bind_trainer_arguments(GRPOTrainer, args, kwargs)
        funcs = _as_list(arguments.get("reward_funcs"))
        for key in ("train_dataset", "eval_dataset"):
            dataset = arguments.get(key)
            for split, data in (dataset.items() if isinstance(dataset, dict) else [(None, dataset)]):
                if data is not None:
                    check_grpo_dataset(data, funcs, name=key if split is None else f"{key}[{split!r}]")
        if getattr(arguments.get("args"), "beta", 0.0):
            refuse_second_model(arguments.get("model"), None, arguments.get("peft_config"),
                                trainer=GRPO.trainer, reference_off="GRPOConfig(beta=0.0) (no KL term)")
        if funcs:
            arguments["reward_funcs"] = [checked_reward(f) if callable(f) else f for f in funcs]
        super().__init__(**arguments)
        use_base_as_reference(self.model)
        self._clock = dict.fromkeys(TIME_KEYS, 0.0)
        self.keep_generation_cache = (keeps_cache_between_steps(activation_plan_of(self.model))
                                      if keep_generation_cache is None else bool(keep_generation_cache))
        if show_banner:
            reference = describe_reference(self) if self.beta else "none (beta = 0: no KL term)"
            cache = "kept between steps" if self.keep_generation_cache else "freed after each generation"
            print_banner(self, f"{GRPO.label} ({self.loss_type}, {self.num_generations} generations per prompt); "
                               f"completions from model.generate under FastLanguageModel.for_inference "
                               f"(KV cache {cache}); reference: {reference}")

    # ---- generation on the decode path, timed (TRL's hooks: trl_compat.GRPOHookPoints) ------------
    def generate_single_turn(self, *args: Any, **kwargs: Any):
        model = self.accelerator.unwrap_model(self.model)
        training = model.training
        FastLanguageModel.for_inference(model)
        start = time.perf_counter()
        try:
            with quiet_checkpointing_flag_deprecation():  # TRL reads transformers' deprecated flag here
                result = self.trl_generate_single_turn(*args, **kwargs)
            _synchronize(self)
        finally:
            if training:
                FastLanguageModel.for_training(model)
            if not self.keep_generation_cache:
                drop_cache(model)
        if training:
            self._clock["time/generation"] += time.perf_counter() - start
        return result

    def generate_and_score_completions(self, inputs: Any) -> Any:
        training = self.model.training
        start, generation = time.perf_counter(), self._clock["time/generation"]
        with quiet_checkpointing_flag_deprecation():  # TRL's scoring reads transformers' deprecated flag
            result = self.trl_generate_and_score_completions(inputs)
        _synchronize(self)
        if training:
            spent = time.perf_counter() - start
            self._clock["time/scoring"] += spent - (self._clock["time/generation"] - generation)
        return result

    def training_step(self, model, inputs, num_items_in_batch=None):
        _synchronize(self)
        start = time.perf_counter()
        before = self._clock["time/generation"] + self._clock["time/scoring"]
        output = super().training_step(model, inputs, num_items_in_batch)
        _synchronize(self)
        outside = self._clock["time/generation"] + self._clock["time/scoring"] - before
        self._clock["time/training"] += time.perf_counter() - start - outside
        if micro_steps(self) % self.current_gradient_accumulation_steps == 0:  # TRL counted this micro-step
            for key, seconds in self._clock.items():
                logged_metrics(self, "train")[key].append(seconds)
            self._clock = dict.fromkeys(TIME_KEYS, 0.0)
        return output

    # ---- the loss ------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            return super().compute_loss(model, inputs, return_outputs=True)  # TRL's message: not supported
        return self._loss(model, inputs)

    def _scoring_unsupported(self, compute_aux_loss: bool = False, extra: Optional[dict] = None) -> Optional[str]:
        """Why per-token log-probs cannot come from :func:`token_logprobs` here (a sentence), or None."""
        shared = shared_fallback_reason(self, "router_aux_loss_coef")
        if shared is not None or compute_aux_loss:
            return shared or "the model's mixture-of-experts router loss is on (router_aux_loss_coef)"
        if getattr(self.args, "cast_lm_head_to_fp32", False):
            return "GRPOConfig(cast_lm_head_to_fp32=True) is set"
        images = sorted(k for k, v in (extra or {}).items() if v is not None)
        if images:
            return f"the batch carries {images} (vision inputs)"
        return None

    def per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                      compute_entropy=False, compute_aux_loss=False, **extra):
        """TRL's scoring step (policy, old policy and reference log-probs of the completion tokens) through
        :func:`~notebookkit.train.token_logprobs.token_logprobs`: the chunked LM head on the last
        ``logits_to_keep`` positions, never ``[B, T, V]`` logits. Returns ``(logps, entropies, None)``
        like TRL; the reference is scored inside TRL's adapter context (adapters off, or its ``"ref"``
        adapter)."""
        reason = self._scoring_unsupported(compute_aux_loss, extra)
        if reason is not None:
            fall_back_once(self, reason)
            return self.trl_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra)
        scorer = self.accelerator.unwrap_model(model)
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
            with self.accelerator.autocast():
                scores = token_logprobs(scorer, ids, mask, labels=ids.masked_fill(mask == 0, -100),
                                        logits_to_keep=logits_to_keep, temperature=self.temperature,
                                        return_entropy=compute_entropy)
            logps.append(scores[0] if compute_entropy else scores)
            if compute_entropy:
                entropies.append(scores[1])
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None

    def _loss_unsupported(self, inputs: dict[str, Any]) -> Optional[str]:
        """Why this batch's loss cannot be :func:`~notebookkit.train.rl_losses.grpo_loss` (a sentence), or None."""
        if self.loss_type not in GRPO_LOSS_TYPES:
            return f"GRPOConfig(loss_type={self.loss_type!r}) is set; the fused losses are {list(GRPO_LOSS_TYPES)}"
        if self.importance_sampling_level != "token":
            return f"GRPOConfig(importance_sampling_level={self.importance_sampling_level!r}) is set (GSPO)"
        if self.off_policy_mask_threshold is not None:
            return "GRPOConfig(off_policy_mask_threshold=...) is set"
        if self.top_entropy_quantile < 1.0:
            return f"GRPOConfig(top_entropy_quantile={self.top_entropy_quantile}) is set"
        if entropy_bonus_enabled(self):
            return "an entropy bonus (GRPOConfig(entropy_coef=...) / use_adaptive_entropy) is set"
        if self.args.delta is not None:
            return f"GRPOConfig(delta={self.args.delta}) (two-sided clipping) is set"
        if self.use_vllm and self.vllm_importance_sampling_correction:
            return "vLLM's importance-sampling correction is on"
        extra = unsupported_inputs(inputs, set(_LOSS_INPUT_KEYS))
        if extra:
            return f"the batch carries {extra}, which the fused path does not pass to the model"
        return self._scoring_unsupported()

    def _loss(self, model: Any, inputs: dict[str, Any]) -> Any:
        """The GRPO loss of one micro-batch (and TRL's ``entropy`` / ``kl`` / ``clip_ratio/*`` metrics).

        TRL's prepared batch (prompt + completion ids and masks, advantages, the old and reference
        log-probs it scored after generating, ``num_items_in_batch``) goes to
        :meth:`per_token_logps_and_entropies` (chunked, :func:`token_logprobs`) and
        :func:`~notebookkit.train.rl_losses.grpo_loss` (``grpo`` / ``dapo`` / ``dr_grpo``, clipping,
        the k3 KL with ``beta > 0``). Another setting (:meth:`_loss_unsupported`) runs TRL's loss,
        with one warning; its log-probs still come from the chunked path where that applies.
        """
        reason = self._loss_unsupported(inputs)
        if reason is not None:
            fall_back_once(self, reason)
            return super().compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        per_token_logps, entropies, _ = self.per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True)
        training = mode == "train"
        loss, metrics = grpo_loss(
            per_token_logps, inputs["advantages"], mask,
            old_per_token_logps=inputs.get("old_per_token_logps"),
            ref_per_token_logps=inputs.get("ref_per_token_logps"),
            loss_type=self.loss_type, beta=self.beta, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
            max_completion_length=self.max_completion_length, num_items_in_batch=inputs["num_items_in_batch"],
            gradient_accumulation_steps=self.current_gradient_accumulation_steps if training else 1,
            steps_per_generation=self.args.steps_per_generation if training else 1,
            use_bias_correction_kl=self.args.use_bias_correction_kl,
        )
        logged = logged_metrics(self, mode)
        counted = mask.sum().clamp(min=1.0)
        logged["entropy"].append(((entropies * mask).sum() / counted).item())
        for key, value in metrics.items():
            logged[key].append(value.item())
        return loss
