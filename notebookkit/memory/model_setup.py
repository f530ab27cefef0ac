"""What a loaded model runs, as far as the memory model needs to know: the marks models/ leaves on it.

Four facts about a model set up by :mod:`notebookkit.models` change its memory use and cannot be
read off its config or its PEFT config:

* the activation plan it applies (per-layer keep / recompute / offload, or ``"none"``), recorded on
  the causal LM by ``apply_checkpointing``; for an ``"auto"`` plan also the batch it was sized for
  (tokens, the memory cap, padding, images), so a larger training batch re-plans before it runs;
* the FP8 forward, flagged on each frozen base linear by ``set_fp8_base_matmul`` (the fused path
  reads the flag on every call, so it lives on the linear: it holds for a plain, a 4-bit and a
  LoRA-wrapped projection alike, and after ``merge_and_unload``);
* whether the causal-LM forward is notebookkit's fused linear cross-entropy (no ``[N, V]`` logits),
  recorded by ``patch_lm_head`` and cleared by ``unpatch_model``;
* whether the input embedding's table lives in pinned host memory (``offload_embedding=True``),
  flagged on the embedding module by ``offload_input_embedding``;
* the static KV cache notebookkit's ``generate`` keeps between calls (an evaluation before training, GRPO),
  held by the decode state on the causal LM: it stays allocated while the model trains;
* a mixture of experts' decode chunk budget (:mod:`notebookkit.expert_chunks`) where its ``"auto"`` activation
  plan chose one (under a memory cap, the cap's rather than the card's), recorded on each experts module, which
  the kernels read on every forward.

Why the marks are read and written here: memory/ sits below models/ (data flows down), so memory must
not import models. Instead the layer that reads the marks owns them (their names are listed with every
other mark in :mod:`notebookkit.marks`), and models/ writes them through these functions; neither side
spells an attribute name, so renaming a mark cannot silently break the estimate. The marks stay on the modules they describe (not copied into a summary), so they
follow the model through ``copy.deepcopy``, PEFT wrapping and merging, and cannot drift from what the
model runs. Plain attribute reads: no torch import, nothing heavy.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Union

from notebookkit.marks import ACTIVATION_PLAN as _ACTIVATION_PLAN
from notebookkit.marks import AUTO_PLAN_SIZE as _AUTO_PLAN_SIZE
from notebookkit.marks import BASE_FORMAT as _BASE_FORMAT
from notebookkit.marks import EXPERT_CHUNK_BUDGET as _EXPERT_CHUNK_BUDGET
from notebookkit.marks import FP8_FORWARD as _FP8_FORWARD
from notebookkit.marks import FUSED_LM_HEAD as _FUSED_LM_HEAD
from notebookkit.marks import GENERATION_STATE as _GENERATION_STATE
from notebookkit.marks import HOST_EMBEDDING as _HOST_EMBEDDING


def _marks(module: Any) -> dict:
    return getattr(module, "__dict__", {})


def _set_flag(module: Any, name: str, on: bool) -> None:
    if on:
        object.__setattr__(module, name, True)
    else:
        _marks(module).pop(name, None)


def record_activation_plan(causal_lm: Any, modes: Optional[Sequence[str]]) -> None:
    """Record the per-layer modes ``causal_lm`` now runs (``None``: no checkpointing at all)."""
    object.__setattr__(causal_lm, _ACTIVATION_PLAN, "none" if modes is None else list(modes))


class PlannedBatch(NamedTuple):
    """The micro-batch an ``"auto"`` plan was sized for: ``tokens`` (rows x length), the memory cap,
    whether its rows were taken as padded (a padding mask: K/V repeated for SDPA on CUDA,
    :mod:`.grouped_kv`) and, for a vision-language model, its images."""

    tokens: int
    max_memory: Any = None
    padded: bool = False
    images: int = 0


def record_auto_plan_size(causal_lm: Any, tokens: Optional[int], max_memory: Any = None, padded: bool = False,
                          images: int = 0) -> None:
    """Record that the plan is ``"auto"``, sized for a :class:`PlannedBatch` (``tokens=None``: the plan
    was chosen by hand, nothing to re-plan)."""
    if tokens is None:
        _marks(causal_lm).pop(_AUTO_PLAN_SIZE, None)
    else:
        object.__setattr__(causal_lm, _AUTO_PLAN_SIZE, PlannedBatch(int(tokens), max_memory, bool(padded), int(images)))


def auto_plan_size(causal_lm: Any) -> Optional[PlannedBatch]:
    """The :class:`PlannedBatch` an ``"auto"`` plan was sized for, or ``None`` for a plan chosen by hand."""
    return _marks(causal_lm).get(_AUTO_PLAN_SIZE)


def held_decode_cache(causal_lm: Any) -> Optional[tuple[int, int]]:
    """``(rows, slots)`` of the static KV cache that notebookkit's ``generate`` keeps on ``causal_lm`` between
    calls (its decode state, which ``for_training`` keeps for GRPO), or ``None`` when none is held."""
    cache = getattr(_marks(causal_lm).get(_GENERATION_STATE), "cache", None)
    if cache is None:
        return None
    return int(cache.batch), int(cache.capacity)


def recorded_activation_plan(causal_lm: Any) -> Union[list[str], str, None]:
    """The per-layer modes recorded by :func:`record_activation_plan`, ``"none"``, or ``None`` when
    notebookkit never set up checkpointing on ``causal_lm``."""
    return _marks(causal_lm).get(_ACTIVATION_PLAN)


def set_fp8_forward(linear: Any, enabled: bool) -> None:
    """Flag (or unflag) the FP8 forward on one frozen base linear."""
    _set_flag(linear, _FP8_FORWARD, enabled)


def fp8_forward(linear: Any) -> bool:
    """Whether the FP8 forward is flagged on this base linear (:func:`set_fp8_forward`)."""
    return bool(_marks(linear).get(_FP8_FORWARD, False))


def record_fused_lm_head(causal_lm: Any, fused: bool) -> None:
    """Record whether ``causal_lm``'s forward computes its training loss with the fused cross-entropy."""
    _set_flag(causal_lm, _FUSED_LM_HEAD, fused)


def fused_lm_head(causal_lm: Any) -> bool:
    """Whether ``causal_lm`` runs notebookkit's fused LM head (:func:`record_fused_lm_head`)."""
    return bool(_marks(causal_lm).get(_FUSED_LM_HEAD, False))


def record_host_embedding(embedding: Any, on_host: bool) -> None:
    """Record whether the table of this input embedding module lives in host memory (the mark keeps the
    table's address, so a copy of the module, whose table is fresh GPU memory, does not inherit it)."""
    if on_host:
        object.__setattr__(embedding, _HOST_EMBEDDING, embedding.weight.data_ptr())
    else:
        _marks(embedding).pop(_HOST_EMBEDDING, None)


def host_embedding(embedding: Any) -> bool:
    """Whether this (frozen) input embedding's table is in host memory (:func:`record_host_embedding`).

    A copy of the module (``copy.deepcopy``, PEFT's ``modules_to_save``) carries the mark but not the
    table: its address differs, so it is not counted; nor is a trainable table."""
    weight = getattr(embedding, "weight", None)
    address = _marks(embedding).get(_HOST_EMBEDDING)
    if weight is None or address is None or getattr(weight, "requires_grad", False):
        return False
    return weight.data_ptr() == address


def record_base_format(causal_lm: Any, name: str) -> None:
    """The loader's note of the format of ``causal_lm``'s frozen projections (``notebookkit.base_formats``)."""
    object.__setattr__(causal_lm, _BASE_FORMAT, name)


def base_format_of(causal_lm: Any) -> Optional[str]:
    """The base format the loader recorded on ``causal_lm`` (``None``: not recorded; its config tells)."""
    return _marks(causal_lm).get(_BASE_FORMAT)


def record_expert_chunk_budget(experts: Any, budget: Optional[int]) -> None:
    """Record on a mixture of experts' experts module (Hugging Face's, unwrapped) the bytes of one chunk of NF4
    experts decoded at a time that its model's activation plan was sized for (``None``: no plan chose one, the
    kernels take the card's own, :func:`notebookkit.expert_chunks.chunk_budget`)."""
    if budget is None:
        _marks(experts).pop(_EXPERT_CHUNK_BUDGET, None)
    else:
        object.__setattr__(experts, _EXPERT_CHUNK_BUDGET, int(budget))


def recorded_expert_chunk_budget(experts: Any) -> Optional[int]:
    """The budget :func:`record_expert_chunk_budget` recorded on ``experts``, or ``None``."""
    return _marks(experts).get(_EXPERT_CHUNK_BUDGET)
