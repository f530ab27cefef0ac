"""The LoRA factors' compute-dtype copies of one forward pass, made together in one batch.

PEFT keeps the LoRA factors ``A``, ``B`` in fp32 (and under fp16 notebookkit keeps fp32 masters), while the fused
kernels compute in the compute dtype, so every pass casts them: a projection's ``B`` (and ``A`` when it runs
alone) with :meth:`~notebookkit.kernels.lora_projection.LoRAProjection.adapters`, a group's ``A`` into its
``A_cat`` with :func:`~notebookkit.kernels.lora_projection.adapter_group`. For a Llama layer that is eleven small
copy kernels a pass (q/k/v's ``A_cat`` and three ``B``, o's ``A`` and ``B``, gate/up's ``A_cat`` and two ``B``,
down's ``A`` and ``B``): 352 launches a step of an 8B model. Where a step is host-bound on a fast card (session 30's
mixture-of-experts steps on an H200; perhaps session 36's T4-emulation row), each launch costs the host its issue
time.

A model's pass needs the casts its previous pass made: the same factors (changed in place by the optimizer step)
into the same dtypes. So the first fused layer of a pass that has an adapter makes them all at once::

    copies = empty tensors of the factors' shapes in the compute dtype (a group's A: row blocks of its A_cat)
    _foreach_copy_(copies, factors)                             a few launches for all of them

and each projection view of the pass gets its copies ready-made (its ``_adapter_casts`` and ``_group_cast``,
the caches those functions read first). Nothing is taken on trust: a kept copy is used only where its factor is
the same tensor, at the same version, in the dtype asked for (the functions check each time), and any other cast
is made as before, one at a time, and joins the next pass's batch. A model that changed between passes (another
adapter, merged, other dtype) therefore gets correct casts at once and batched ones from its next pass.

The copies are kept through the step, as before: the memory model's ``P_lora * s`` of kept casts. When a pass
makes its batch, the previous pass's views give theirs back first (their caches are emptied), so the two sets are
never alive together; a backward of that pass still to run (two forwards before one backward) casts again what it
needs: slower, never wrong. A pass without adapters (a reference model run with the adapters disabled, DPO's and
GRPO's) starts no batch and leaves the plan to the next pass with adapters. Inside a CUDA graph capture nothing is
batched (the copies would only exist at replay).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch

__all__ = ["PassCasts", "pass_casts", "reuse_latest_copies"]

#: each pass owner's (a patched backbone) latest :class:`PassCasts`: what its next pass will batch
_latest: "weakref.WeakKeyDictionary[Any, PassCasts]" = weakref.WeakKeyDictionary()
#: the pass that made a batch last, whatever its owner: what views built outside any pass read (reuse_latest_copies)
_last_batch: Optional["weakref.ReferenceType[PassCasts]"] = None


class PassCasts:
    """The batched adapter copies of one forward pass of ``owner`` (module docstring): made at :meth:`start`,
    handed to the pass's views by :meth:`fill`."""

    def __init__(self, owner: Any) -> None:
        self.owner = weakref.ref(owner)
        self.views: list[list[Any]] = []  # the projection views this pass built, for the next pass's batch
        self.made: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # id(factor) -> (factor, version, copy)
        self.groups: dict[tuple[int, ...], tuple[tuple[torch.Tensor, ...], tuple[int, ...], torch.Tensor]] = {}
        self.started = False

    def start(self) -> None:
        """Make, in one batch, every copy the owner's previous pass with adapters made; this pass becomes the one
        the next pass batches from."""
        self.started = True
        owner = self.owner()
        previous = _latest.get(owner) if owner is not None else None
        if owner is not None:
            _latest[owner] = self
        if previous is None:
            return
        singles, groups = previous.plan()
        previous.release()  # its copies are freed before the new ones are made
        if not _capturing():
            self._make(singles, groups)
            global _last_batch
            _last_batch = weakref.ref(self)

    def plan(self) -> tuple[list[tuple[torch.Tensor, torch.dtype]], list[tuple[tuple[torch.Tensor, ...], torch.dtype]]]:
        """``(factors, groups)`` this pass cast: each factor with its dtype, each group's ``A`` factors with the
        dtype of its ``A_cat``, read from the caches of its views."""
        singles: dict[int, tuple[torch.Tensor, torch.dtype]] = {}
        groups: dict[tuple[int, ...], tuple[tuple[torch.Tensor, ...], torch.dtype]] = {}
        for proj in _projections(self.views):
            for name, (dtype, _version, _copy) in proj._adapter_casts.items():
                factor = proj.lora_A if name == "A" else proj.lora_B
                if factor is not None:
                    singles[id(factor)] = (factor, dtype)
            if proj._group_cast is not None:
                dtype, factors, _versions, _copy = proj._group_cast
                groups[tuple(map(id, factors))] = (tuple(factors), dtype)
        grouped = {i for key in groups for i in key}
        return [v for k, v in singles.items() if k not in grouped], list(groups.values())

    def release(self) -> None:
        """Empty the copy caches of this pass's views (a backward of this pass still to run casts again)."""
        for proj in _projections(self.views):
            proj._adapter_casts.clear()
            proj._group_cast = None
        self.views.clear()
        self.made.clear()
        self.groups.clear()

    def _make(self, singles: list[tuple[torch.Tensor, torch.dtype]],
              groups: list[tuple[tuple[torch.Tensor, ...], torch.dtype]]) -> None:
        """One ``_foreach_copy_`` per (device, source dtype, dtype) into new tensors; a group's factors into the
        row blocks of its ``A_cat``."""
        batches: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for factors, dtype in groups:
            first = factors[0]
            A_cat = torch.empty(sum(f.shape[0] for f in factors), first.shape[1], dtype=dtype, device=first.device)
            copies = list(A_cat.split([f.shape[0] for f in factors]))
            self.groups[tuple(map(id, factors))] = (factors, tuple(f._version for f in factors), A_cat)
            self._add(batches, factors, copies, dtype)
        for factor, dtype in singles:
            self._add(batches, (factor,), [torch.empty(factor.shape, dtype=dtype, device=factor.device)], dtype)
        for targets, sources in batches.values():
            torch._foreach_copy_(targets, sources)

    def _add(self, batches: dict, factors: tuple[torch.Tensor, ...], copies: list[torch.Tensor],
             dtype: torch.dtype) -> None:
        """Put ``factors`` and their ``copies`` in the batch of their (device, source dtype, dtype)."""
        targets, sources = batches.setdefault((factors[0].device, factors[0].dtype, dtype), ([], []))
        for factor, copy in zip(factors, copies):
            self.made[id(factor)] = (factor, factor._version, copy)
            targets.append(copy)
            sources.append(factor.detach())

    def fill(self, views: Optional[list[Any]]) -> None:
        """Give each projection of ``views`` (built in this pass) the copies made for its factors, and remember
        the views for the next pass's batch."""
        if not views:
            return
        projs = [v.projection for v in views]
        if not any(p.lora_A is not None for p in projs):
            return  # no adapter (disabled, merged, none yet): nothing to cast, and no batch started for it
        self.views.append(views)
        if not self.started:
            self.start()
        self.prefill(projs)

    def prefill(self, projs: list[Any]) -> None:
        """Give each of ``projs`` the copies this pass made for its factors: a kept copy only where its factor is
        the same tensor at the same version (a group's ``A_cat`` where the group's ``A`` are the same tensors)."""
        if not self.made:
            return
        for proj in projs:
            for name, factor in (("A", proj.lora_A), ("B", proj.lora_B)):
                kept = self.made.get(id(factor)) if factor is not None else None
                if kept is not None and kept[0] is factor and kept[1] == factor._version:
                    proj._adapter_casts[name] = (kept[2].dtype, kept[1], kept[2])
        for start in range(len(projs)):  # a group is a run of projections; its first one keeps the A_cat
            for stop in range(start + 2, len(projs) + 1):
                factors = tuple(p.lora_A for p in projs[start:stop])
                kept = self.groups.get(tuple(map(id, factors)))
                if kept is not None and all(a is b for a, b in zip(kept[0], factors)):
                    projs[start]._group_cast = (kept[2].dtype, factors, kept[1], kept[2])


def reuse_latest_copies(views: Optional[list[Any]]) -> None:
    """Give projection views built outside any forward pass the copies the latest batch made for their factors.

    Hugging Face's checkpointing of a vision tower's blocks runs their forward again in the backward, after the
    pass has ended: without this, each adapted linear there casts its factors again, one launch each (a
    Qwen2.5-VL-7B tower, about 290 a step). Only while autograd records (a recompute; never a decode step, whose
    captured graphs must not read copies that the next pass frees) and outside a graph capture; the copies are
    checked as in :meth:`PassCasts.prefill`, so a view of another model, or of an adapter changed since, casts as
    before."""
    casts = _last_batch() if _last_batch is not None else None
    if casts is None or not views or not torch.is_grad_enabled() or _capturing():
        return
    casts.prefill([v.projection for v in views])


def pass_casts(forward: Any) -> Optional[PassCasts]:
    """The :class:`PassCasts` of ``forward`` (a ``forward_state.ForwardPass``), made at its first call; ``None``
    for a pass without an owner."""
    if forward.owner is None:
        return None
    if forward.casts is None:
        forward.casts = PassCasts(forward.owner)
    return forward.casts


def _projections(view_lists: Iterable[list[Any]]) -> Iterable[Any]:
    for views in view_lists:
        for view in views:
            yield view.projection


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
