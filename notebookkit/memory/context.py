"""The longest sequence a training step can take within a memory budget, as the planner predicts it.

For a model, LoRA setting, batch size and budget (free VRAM, ``max_memory="16GB"`` or a card name
such as ``"t4"``), the predicted peak of the best activation plan grows with the sequence length
``T``: base weights and adapters are fixed, activations grow like ``T`` (like ``T**2`` for the
explicit soft-capped attention of Gemma 2). So the longest ``T`` that the planner can fit, in
multiples of ``step`` tokens, is found by bisection on :func:`plan_activations`::

    fits(T) = plan_activations(..., seq_len=T) does not raise DoesNotFitError
    T*      = max { T = k * step <= max_seq : fits(T) }

It is a prediction from the same memory model as the widgets and ``use_gradient_checkpointing="auto"``
(within a few percent of measured peaks on the H200 benchmark rows; the planner keeps an 8% margin).
``benchmarks/max_context.py`` measures the real answer on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .planner import ActivationPlan, DoesNotFitError, plan_activations
from .shapes import model_shape

DEFAULT_MAX_SEQ = 131072


@dataclass
class LongestSequence:
    """``seq_len``: the longest predicted to fit (0 if not even ``step`` tokens do); ``plan``: the plan
    at that length (``None`` when nothing fits); ``limit``: the upper end searched."""

    seq_len: int
    plan: ActivationPlan | None
    limit: int

    def __str__(self) -> str:
        if not self.seq_len:
            return "not even the shortest step fits this budget"
        capped = " (the search's upper limit)" if self.seq_len >= self.limit else ""
        return f"longest sequence {self.seq_len:,} tokens{capped}: {self.plan.summary()}"


def longest_sequence(
    model_config: Any,
    max_memory: Any = None,
    *,
    batch_size: int = 1,
    step: int = 256,
    max_seq: int | None = None,
    **plan_kwargs: Any,
) -> LongestSequence:
    """The longest ``seq_len`` (a multiple of ``step``) whose training step the planner fits in the budget.

    Args:
        model_config: anything :func:`plan_activations` accepts (a loaded model, a config, a curated
            hub name such as ``"meta-llama/Llama-3.1-8B-Instruct"``, a local folder).
        max_memory: the budget: ``"16GB"``, ``"24 GiB"``, a card name (``"t4"``, ``"l4"``, ``"a100-40gb"``)
            or bytes; default the free VRAM of this GPU.
        batch_size: rows per step.
        step: granularity of the answer in tokens.
        max_seq: the longest length to consider; default the model's ``max_position_embeddings``
            (or 131072 when the config does not say).
        **plan_kwargs: ``load_in_4bit``, ``dtype``, ``lora_r``, ``target_modules``, ``optimizer``, ...
            as for :func:`plan_activations`.

    Example::

        >>> print(longest_sequence("meta-llama/Llama-3.1-8B-Instruct", "16GB", load_in_4bit=True))
    """
    if step <= 0 or batch_size <= 0:
        raise ValueError(f"step ({step}) and batch_size ({batch_size}) must be positive.")
    plan_kwargs.pop("seq_len", None)
    if max_seq is None:
        max_seq = model_shape(model_config).max_position_embeddings or DEFAULT_MAX_SEQ
    limit = max_seq // step * step
    if limit < step:
        raise ValueError(f"max_seq={max_seq} is shorter than step={step}.")

    def plan_for(seq_len: int) -> ActivationPlan | None:
        try:
            return plan_activations(model_config, max_memory, batch_size=batch_size, seq_len=seq_len, explain=False,
                                    **plan_kwargs)
        except DoesNotFitError:
            return None

    best = plan_for(step)
    if best is None:
        return LongestSequence(0, None, limit)
    top = plan_for(limit)
    if top is not None:
        return LongestSequence(limit, top, limit)
    good, bad = step, limit  # good fits, bad does not
    while bad - good > step:
        middle = (good + bad) // 2 // step * step
        plan = plan_for(middle)
        if plan is None:
            bad = middle
        else:
            good, best = middle, plan
    return LongestSequence(good, best, limit)
