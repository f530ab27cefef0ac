"""The largest LoRA rank a card can train, with the plan it needs, or why nothing fits.

For a model, base format, sequence length and card, everything in the step but the adapters is
fixed by the rank-free settings; the adapters grow linearly with the rank ``r``:

    adapters(r) = P_lora(r) * (4 + 4 + 8 + s)      fp32 weights, gradients, AdamW's two moments and
                                                   the compute-dtype casts; P_lora(r) = r * L * sum(in + out)

so the predicted peak of the best plan (:func:`~notebookkit.memory.planner.plan_activations`) grows
with ``r``, and the largest ``r <= max_rank`` that the planner fits is found by bisection. An untied
input embedding can live in host memory (``offload_embedding=True``, ``V * H * s`` bytes off the card):
both are tried, and the embedding stays on the card when that fits the same rank (no host lookups).

Worked example (checked by ``tests/memory/test_rank_fit.py``): Llama-3.1-70B's shape (H 8192, I 28672,
80 layers, 64 / 8 heads of 128, V 128256, untied), 2-bit base, bf16, sequence 2048, batch 1, LoRA on all
seven projections, a 24 GiB card, the margin on the step's bytes (``margin_of="step"``):

* 2-bit projections: ``80 * (2*8192*8192 + 2*8192*1024 + 3*8192*28672) = 68.45e9`` weights at
  ``0.25 + 4/64 = 0.3125`` bytes: 21.39e9 bytes = 19.92 GiB; LM head 16-bit ``128256 * 8192 * 2``
  = 1.96 GiB; the input embedding (1.96 GiB more) must go to host memory: 21.88 GiB of base;
* per rank: ``80 * (16384 + 9216 + 9216 + 16384 + 3 * 36864) = 12.94e6`` parameters, ``18`` bytes each:
  0.217 GiB;
* the rest at 2048 tokens (79 layers offloaded, the last recomputed): its input and two in flight
  (3 x 32 MiB), the loss buffers (3 x 32 MiB + a 512-row logits chunk, 125 MiB), the recomputed last
  layer's saved tensors (``2048 * (2 * 108544 + 4 * 66)`` bytes = 424.5 MiB, less its stored input) and
  the MLP's backward working set (``3 * 32 MiB + 112 MiB``, the in-tile kernels' fresh ``[N, H]``
  input gradient included) beyond the freed loss buffers, and the 400 MiB CUDA context: 1.07 GiB;
* ``24 - 0.08 * (24 - 21.88) = 23.83`` GiB usable: ``21.88 + 1.07 + 4 * 0.217 = 23.82`` fits,
  ``r = 5`` (24.04) does not. **r = 4**, predicted peak 23.82 GiB (23.43 GiB allocated, without the
  context). On an RTX 4090 (23.64 GiB): r = 2.
* NF4: the projections alone are ``68.45e9 * (0.5 + 1/64 + 4/16384) = 35.3e9`` bytes = 32.9 GiB:
  more than the card at any rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from notebookkit.base_formats import BaseFormat

from .base_weights import base_format_for, load_flags
from .estimate import MemoryEstimate, readable_bytes, lora_targets
from .planner import ActivationPlan, DoesNotFitError, plan_activations
from .shapes import model_shape
from .vision_shapes import is_vlm, text_shape, vlm_shape

__all__ = ["RankFit", "largest_lora_rank"]


@dataclass
class RankFit:
    """The answer of :func:`largest_lora_rank`.

    ``rank``: the largest LoRA rank that fits (0: none does); ``plan``: the activation plan at that
    rank, its ``estimate`` the predicted peak; ``offload_embedding``: whether the input embedding must
    live in host memory; ``reason``: when nothing fits, the planner's account of what to change, and
    ``smallest``: the estimate of the leanest step it tried (rank 1, every layer offloaded; recomputed for a
    mixture of experts).
    """

    rank: int
    plan: ActivationPlan | None
    offload_embedding: bool
    base_format: BaseFormat
    seq_len: int
    batch_size: int
    targets: int
    budget: str
    reason: str = ""
    smallest: MemoryEstimate | None = None

    @property
    def fits(self) -> bool:
        return self.rank > 0

    def __str__(self) -> str:
        what = f"{self.base_format.label} base, sequence {self.seq_len:,} x batch {self.batch_size}"
        if not self.fits:
            return f"{what}: does not fit {self.budget} at any LoRA rank.\n{self.reason}"
        est = self.plan.estimate
        where = "input embedding in host RAM (offload_embedding=True)" if self.offload_embedding else \
            "input embedding on the card"
        return (f"{what}: fits {self.budget} with LoRA r={self.rank} on {self.targets} projections "
                f"({est.inputs.get('optimizer')}, adapters {readable_bytes(est.adapters)}); {where}; "
                f"activations {self.plan.summary()}")


def largest_lora_rank(
    model_config: Any,
    max_memory: Any = None,
    *,
    seq_len: int = 2048,
    batch_size: int = 1,
    max_rank: int = 256,
    offload_embedding: bool | None = None,
    margin_of: str = "step",
    **plan_kwargs: Any,
) -> RankFit:
    """The largest LoRA rank (and the plan) that trains ``model_config`` within ``max_memory``.

    Args:
        model_config: anything :func:`~notebookkit.memory.planner.plan_activations` takes (a curated
            name such as ``"meta-llama/Llama-3.1-70B-Instruct"``, a config, a folder, a ``ModelShape``).
        max_memory: the card or cap: ``"24GiB"``, ``"rtx4090"``, bytes; default the free VRAM here.
        seq_len, batch_size: the micro-batch.
        max_rank: the largest rank considered.
        offload_embedding: ``None`` tries the input embedding on the card and in host memory (it stays on
            the card when that fits the same rank); ``True`` / ``False`` fixes it.
        margin_of: the planner's fragmentation margin on the step's bytes (``"step"``, the default here:
            the frozen base is allocated once) or on the whole budget (``"budget"``).
        **plan_kwargs: ``load_in_2bit=True`` (or ``load_in_4bit`` / ``load_in_ternary``), ``dtype``,
            ``target_modules``, ``optimizer``, ``card``, ``budget_bytes``, ``host_memory_bytes``, ...

    Example::

        >>> print(largest_lora_rank("meta-llama/Llama-3.1-70B-Instruct", "24GiB", load_in_2bit=True))
    """
    if max_rank < 1 or seq_len < 1 or batch_size < 1:
        raise ValueError(f"notebookkit.memory: max_rank, seq_len and batch_size must be >= 1 "
                         f"(got {max_rank}, {seq_len}, {batch_size}).")
    plan_kwargs.pop("lora_r", None)
    fmt = base_format_for(**{f: bool(plan_kwargs.get(f)) for f in load_flags()})
    shape = text_shape(vlm_shape(model_config)) if is_vlm(model_config) else model_shape(model_config)
    options = [False, True] if offload_embedding is None else [bool(offload_embedding)]
    if shape.tie_word_embeddings:
        options = [False]  # a tied table is the LM head: it stays on the card
    targets = len(lora_targets(plan_kwargs.get("target_modules")))

    def plan_at(rank: int, on_host: bool, explain: bool = False) -> ActivationPlan | DoesNotFitError:
        try:
            return plan_activations(model_config, max_memory, lora_r=rank, seq_len=seq_len, batch_size=batch_size,
                                    offload_embedding=on_host, margin_of=margin_of, explain=explain, **plan_kwargs)
        except DoesNotFitError as exc:
            return exc

    best: tuple[int, bool, ActivationPlan] | None = None
    for on_host in options:
        found = plan_at(1, on_host)
        if isinstance(found, DoesNotFitError):
            continue
        good, plan, bad = 1, found, max_rank + 1  # good fits, bad does not
        top = plan_at(max_rank, on_host)
        if not isinstance(top, DoesNotFitError):
            good, plan = max_rank, top
            bad = good + 1
        while bad - good > 1:
            middle = (good + bad) // 2
            tried = plan_at(middle, on_host)
            if isinstance(tried, DoesNotFitError):
                bad = middle
            else:
                good, plan = middle, tried
        if best is None or good > best[0]:
            best = (good, on_host, plan)
    if best is None:
        refusal = plan_at(1, options[-1], explain=True)  # the leanest setting: the planner says what to change
        assert isinstance(refusal, DoesNotFitError)
        budget = readable_bytes(refusal.budget_bytes) if refusal.budget_bytes else str(max_memory)
        return RankFit(0, None, options[-1], fmt, seq_len, batch_size, targets, budget,
                       reason=f"Even LoRA rank r=1 does not fit. {refusal}", smallest=refusal.estimate)
    rank, on_host, plan = best
    return RankFit(rank, plan, on_host, fmt, seq_len, batch_size, targets,
                   f"{readable_bytes(plan.budget_bytes)} ({plan.budget_source})")
