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
* time per optimizer step goes into the logs: ``time/generation`` (``model.generate``),
  ``time/scoring`` (decoding, reward functions, the old / reference log-probs) and ``time/training``
  (the loss's forward and backward), in seconds;
* the loss of a micro-batch is computed in one method, :meth:`FastGRPOTrainer._loss`. Today that is
  TRL's computation (per-token log-probs from TRL's chunked LM head on ``lm_head.weight``, no full
  logits); it is the seam where ``notebookkit.train.rl_losses`` takes over.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from .trainer_glue import built_once

__all__ = ["GRPOInputError", "check_grpo_dataset", "FastGRPOTrainer", "TIME_KEYS"]

#: the timing metrics FastGRPOTrainer logs (seconds per optimizer step)
TIME_KEYS = ("time/generation", "time/scoring", "time/training")


class GRPOInputError(ValueError):
    """A data set GRPO cannot train on; the message says what to change."""


def _is_turns(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, dict) for t in value)


def check_grpo_dataset(dataset: Any, reward_funcs: Iterable[Any] = (), *, name: str = "train_dataset") -> None:
    """Raise a readable error when GRPO cannot train on ``dataset`` with ``reward_funcs``.

    The data set needs a ``prompt`` column: a string the completion continues, or a list of chat
    turns ``{"role", "content"}`` (rendered with the chat template, generation prompt added). Its
    other columns go to the reward functions by name, so each function's parameters are checked
    against them (:func:`~notebookkit.train.rewards.check_reward_functions`).

    Raises:
        TypeError: not a ``datasets.Dataset`` / ``IterableDataset``.
        GRPOInputError: no rows, no ``prompt`` column, or prompts of the wrong form.
        RewardFunctionError: a reward function that needs a column the data set lacks.
    """
    from .rewards import check_reward_functions
    from .trainer_glue import first_row

    row, columns = first_row(dataset, name, "GRPOTrainer", GRPOInputError)
    if "prompt" not in columns:
        source = next((c for c in ("question", "query", "instruction", "input", "problem", "text") if c in columns), None)
        fix = (f"dataset = dataset.map(lambda row: {{'prompt': [{{'role': 'user', 'content': row[{source!r}]}}]}})"
               if source else "dataset = dataset.map(lambda row: {'prompt': [{'role': 'user', 'content': ...}]})")
        raise GRPOInputError(
            f"{name} has the columns {columns}; GRPOTrainer needs a 'prompt' column (missing: ['prompt']). Expected "
            "format, one row per prompt: 'prompt', the text the model continues (a string) or a list of chat turns "
            "[{'role': 'system', 'content': ...}, {'role': 'user', 'content': ...}]; any other column (for example "
            "'answer') is passed to the reward functions under its name. GRPO writes the completions itself, so no "
            f"answer column is trained on. Build the prompts, for example:\n  {fix}"
        )
    prompt = row["prompt"]
    if _is_turns(prompt):
        bad = [t for t in prompt if not {"role", "content"} <= set(t)]
        if bad:
            raise GRPOInputError(
                f"{name}[0]['prompt'] is a list of turns, but {bad[0]!r} has no 'role' and 'content'. Chat prompts are "
                "[{'role': 'user', 'content': 'the question'}] (a 'system' turn first if you like)."
            )
    elif not isinstance(prompt, str):
        raise GRPOInputError(
            f"{name}[0]['prompt'] is a {type(prompt).__name__} ({str(prompt)[:80]!r}); GRPOTrainer reads a string or a "
            "list of chat turns {'role', 'content'} there."
        )
    check_reward_functions(reward_funcs, columns)


def _as_list(reward_funcs: Any) -> list:
    if reward_funcs is None:
        return []
    return list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]


def _synchronize(trainer: Any) -> None:
    """Wait for queued GPU work, so the clock measures it (no-op on CPU)."""
    import torch

    device = getattr(trainer.accelerator, "device", None)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


@built_once(__name__, "FastGRPOTrainer")
def _fast_grpo_trainer_class() -> type:
    from trl import GRPOTrainer

    from ..models.fast_language_model import FastLanguageModel
    from .reference import describe_reference, refuse_second_model, use_base_as_reference
    from .rewards import checked_reward
    from .adapter_dtype import keep_fp32_adapters_under_fp16
    from .trainer_glue import bind_trainer_arguments, print_banner

    class FastGRPOTrainer(GRPOTrainer):
        """TRL's ``GRPOTrainer`` for a model from ``FastLanguageModel``: same arguments, same use.

        ``FastGRPOTrainer(model=model, reward_funcs=[format_reward, correctness_reward],
        args=GRPOConfig(...), train_dataset=prompts, processing_class=tokenizer)``. Checks the data
        set and reward functions first, wraps the reward functions to report failures by row,
        generates under ``for_inference``, and logs ``time/generation``, ``time/scoring`` and
        ``time/training`` per optimizer step. Plus:

        Args:
            show_banner: print one line saying how completions are generated and what the reference is.
        """

        def __init__(self, *args: Any, show_banner: bool = True, **kwargs: Any) -> None:
            arguments = bind_trainer_arguments(GRPOTrainer, args, kwargs)
            funcs = _as_list(arguments.get("reward_funcs"))
            for key in ("train_dataset", "eval_dataset"):
                dataset = arguments.get(key)
                for split, data in (dataset.items() if isinstance(dataset, dict) else [(None, dataset)]):
                    if data is not None:
                        check_grpo_dataset(data, funcs, name=key if split is None else f"{key}[{split!r}]")
            if getattr(arguments.get("args"), "beta", 0.0):
                refuse_second_model(arguments.get("model"), None, arguments.get("peft_config"),
                                    trainer="FastGRPOTrainer", reference_off="GRPOConfig(beta=0.0) (no KL term)")
            if funcs:
                arguments["reward_funcs"] = [checked_reward(f) if callable(f) else f for f in funcs]
            super().__init__(**arguments)
            keep_fp32_adapters_under_fp16(self)  # TRL casts a quantised model's adapters to bf16 even for fp16
            use_base_as_reference(self.model)
            self._clock = dict.fromkeys(TIME_KEYS, 0.0)
            if show_banner:
                reference = describe_reference(self) if self.beta else "none (beta = 0: no KL term)"
                print_banner(self, f"GRPO ({self.loss_type}, {self.num_generations} generations per prompt); "
                                   f"completions from model.generate under FastLanguageModel.for_inference; "
                                   f"reference: {reference}")

        # ---- generation on the decode path, timed ------------------------------------------------
        def _generate_single_turn(self, *args: Any, **kwargs: Any):
            model = self.accelerator.unwrap_model(self.model)
            training = model.training
            FastLanguageModel.for_inference(model)
            start = time.perf_counter()
            try:
                result = super()._generate_single_turn(*args, **kwargs)
                _synchronize(self)
            finally:
                if training:
                    FastLanguageModel.for_training(model)
            if training:
                self._clock["time/generation"] += time.perf_counter() - start
            return result

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            training = self.model.training
            start, generation = time.perf_counter(), self._clock["time/generation"]
            result = super()._generate_and_score_completions(inputs)
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
            if self._step % self.current_gradient_accumulation_steps == 0:  # TRL counted this micro-step
                for key, seconds in self._clock.items():
                    self._metrics["train"][key].append(seconds)
                self._clock = dict.fromkeys(TIME_KEYS, 0.0)
            return output

        # ---- the loss ------------------------------------------------------------------------------
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if return_outputs:
                return super().compute_loss(model, inputs, return_outputs=True)  # TRL's message: not supported
            return self._loss(model, inputs)

        def _loss(self, model: Any, inputs: dict[str, Any]) -> Any:
            """The GRPO loss of one micro-batch (and its ``kl`` / ``entropy`` / ``clip_ratio`` metrics): TRL's
            computation today.

            The seam for notebookkit's chunked log-prob loss (``notebookkit.train.rl_losses``): the
            policy's per-token log-probs of the completion tokens, the clipped surrogate with the
            group advantages, and the k3 KL to the reference log-probs in ``inputs`` when beta > 0.
            """
            return super().compute_loss(model, inputs)

    return FastGRPOTrainer


def __getattr__(name: str) -> Any:
    if name == "FastGRPOTrainer":  # built on first use: importing TRL takes seconds
        return _fast_grpo_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
