"""The merged plan in the family's own checkpoint layout: stacked experts written one expert at a time.

transformers holds a mixture of experts' projections stacked (``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``), but some families' checkpoints store each expert as its own linear
layers, and transformers stacks them while loading (Qwen3-MoE: ``MoE.saved_per_expert`` names them).
The merged folder is written as the family's checkpoints are, so that transformers (4.x included),
vLLM and llama.cpp's converter read it as they read the published model. For expert ``e`` and
``gate_up``'s halves ``[gate; up]`` (concatenated, gate first: ``MoE.activation == "swiglu"``)::

    experts.{e}.<gate>.weight = W'_e[:I]      [I, H]
    experts.{e}.<up>.weight   = W'_e[I:]      [I, H]
    experts.{e}.<down>.weight = W'_e          [H, I]

each computed on its own (``StackedExperts.expert_rows``: ``W_e[rows] + s B_e[rows] A_e``), so the
export holds one expert's slice at a time. Families that store the stack (gpt-oss) keep the plan as it is.
"""

from __future__ import annotations

from typing import Any

import torch

from notebookkit.memory.export import merge_working_bytes

from .merge import PlannedTensor

__all__ = ["checkpoint_layout"]


def _per_expert(planned: PlannedTensor, prefix: str, names: list[tuple[str, slice]]) -> list[PlannedTensor]:
    stack = planned.experts
    out_f, in_f = stack.linear_shape
    out_bytes = torch.empty((), dtype=planned.dtype).element_size()
    plan = []
    for e in range(stack.num_experts):
        for name, rows in names:
            n_rows = len(range(out_f)[rows])

            def make(device, e=e, rows=rows, dtype=planned.dtype):
                return stack.expert_rows(device, e, rows).to(dtype)

            plan.append(PlannedTensor(f"{prefix}{e}.{name}.weight", (n_rows, in_f), planned.dtype, make, planned.source_device,
                                      merge_working_bytes(n_rows, in_f, stack.rank, out_bytes), planned.linear_rank))
    return plan


def checkpoint_layout(plan: list[PlannedTensor], config: Any) -> list[PlannedTensor]:
    """``plan`` (:func:`notebookkit.export.merge.plan_merged_tensors`) with each stacked expert weight of a
    family whose checkpoints store experts one by one replaced by its per-expert tensors (module docstring)."""
    from notebookkit.families import for_model_type

    family = for_model_type(getattr(config, "model_type", None))
    moe = family.moe if family is not None else None
    if moe is None or not moe.saved_per_expert:
        return plan
    if moe.activation != "swiglu":
        raise NotImplementedError(f"{family.name}: per-expert checkpoints with interleaved gate/up halves are not written.")
    gate, up, down = moe.saved_per_expert
    out: list[PlannedTensor] = []
    for planned in plan:
        if planned.experts is None:
            out.append(planned)
            continue
        prefix, pname = planned.name.rsplit(".", 1)
        half = planned.experts.linear_shape[0] // 2
        names = {"gate_up_proj": [(gate, slice(0, half)), (up, slice(half, None))], "down_proj": [(down, slice(None))]}[pname]
        out.extend(_per_expert(planned, prefix + ".", names))
    return out
