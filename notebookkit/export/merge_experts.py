"""The merged stacked expert weights of a mixture-of-experts block (Qwen3-MoE, gpt-oss).

An experts module holds its ``E`` experts' projections stacked in one parameter a projection:
``W [E, out, in]`` (Qwen3-MoE) or its transpose ``[E, in, out]`` (gpt-oss, ``MoE.transposed``). PEFT's
LoRA on it (``LoraConfig(target_parameters=[...])``, a ``ParamWrapper`` a parameter, peft 0.21) keeps
``lora_A.weight [r E, in]`` and ``lora_B.weight [out, r E]``; expert ``e``'s factors are
``A_e = lora_A.reshape(E, r, in)[e]`` and ``B_e = lora_B.reshape(out, r, E)[:, :, e]``
(:func:`notebookkit.kernels.moe_experts.expert_lora`). PEFT's own merge
(``ParamWrapper.get_delta_weight``) adds, for each active adapter ``i`` with scaling ``s_i``,

    W'_e = W_e + s_i B_e A_e              stored [E, out, in]
    W'_e = W_e + s_i (B_e A_e)^T          stored [E, in, out]

i.e. the update in the parameter's own orientation. Here it runs in IEEE fp32 with one rounding to
the written dtype at the end, as :mod:`.merge` does for linear layers. Expert biases and the router
are not adapted and pass through.

:class:`StackedExperts` computes the whole stack (``full``) or one expert's rows in the linear
orientation (``expert_rows``: ``W_e[rows] + s B_e[rows] A_e``, ``[len(rows), in]``), which the
per-expert checkpoint layout (:mod:`.checkpoint_layout`) and the GGUF split of ``gate_up`` use, so no
export computes a whole stack to keep a slice of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from notebookkit.base_layers.nf4_experts import is_nf4_expert_param
from notebookkit.kernels.moe_experts import expert_lora
from notebookkit.memory.export import merge_working_bytes

from .active_adapters import active_adapter_names
from .ieee_fp32 import ieee_fp32_matmul

__all__ = ["StackedExperts", "experts_module", "stacked_experts"]

STACKED = ("gate_up_proj", "down_proj")


def _is_param_wrapper(module: nn.Module) -> bool:
    return hasattr(module, "parameter_name") and hasattr(module, "lora_A") and hasattr(module, "base_layer")


def experts_module(module: nn.Module) -> Optional[tuple[nn.Module, dict[str, nn.Module]]]:
    """``(the Hugging Face experts module, PEFT's ParamWrapper of each adapted parameter)`` when ``module``
    is a mixture-of-experts experts module (PEFT nests one ``ParamWrapper`` a parameter around it), else None."""
    wrappers: dict[str, nn.Module] = {}
    inner = module
    while _is_param_wrapper(inner):
        wrappers[inner.parameter_name] = inner
        inner = inner.base_layer
    weight = getattr(inner, "gate_up_proj", None)
    if is_nf4_expert_param(weight) or is_nf4_expert_param(getattr(inner, "down_proj", None)):
        raise NotImplementedError(
            "This model's expert weights are in NF4 (loaded with load_in_4bit=True); merged exports of NF4 experts "
            "are not written yet. Save the adapters (model.save_pretrained(folder)), reload them on a 16-bit base "
            "(FastLanguageModel.from_pretrained(folder, load_in_4bit=False)) and export that model.")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or not isinstance(getattr(inner, "down_proj", None), torch.Tensor):
        if wrappers:
            raise NotImplementedError(
                f"LoRA on the parameters {sorted(wrappers)} of a {type(inner).__name__}: the merge writes PEFT "
                "target_parameters adapters on a mixture of experts' stacked gate_up_proj / down_proj only. Save the "
                "adapters with save_method='lora' instead.")
        return None
    unknown = sorted(set(wrappers) - set(STACKED))
    if unknown:
        raise NotImplementedError(
            f"LoRA on the experts' {unknown}: the merge writes adapters on gate_up_proj and down_proj only. "
            "Save the adapters with save_method='lora' instead.")
    return inner, wrappers


def _adapters(wrapper: Optional[nn.Module], num_experts: int, name: str) -> list:
    """The :class:`~notebookkit.kernels.moe_experts.ExpertLoRA` of each active, unmerged adapter of ``wrapper``."""
    if wrapper is None:
        return []
    out = []
    for a in active_adapter_names(wrapper):
        if getattr(wrapper, "use_dora", {}).get(a, False) or getattr(wrapper, "lora_bias", {}).get(a, False):
            raise NotImplementedError(f"{name}: DoRA / LoRA bias on stacked experts is not merged; use plain LoRA.")
        out.append(expert_lora(wrapper.lora_A[a].weight, wrapper.lora_B[a].weight, num_experts, float(wrapper.scaling[a])))
    return out


@dataclass
class StackedExperts:
    """One stacked expert parameter and the adapters on it: ``weight`` as stored (``[E, out, in]``, or
    ``[E, in, out]`` when ``transposed``), ``adapters`` (``ExpertLoRA``: ``A [E, r, in]``, ``B [E, out, r]``, ``s``)."""

    weight: torch.Tensor
    adapters: list
    transposed: bool

    @property
    def num_experts(self) -> int:
        return int(self.weight.shape[0])

    @property
    def linear_shape(self) -> tuple[int, int]:
        """``(out, in)`` of one expert's projection."""
        a, b = int(self.weight.shape[1]), int(self.weight.shape[2])
        return (b, a) if self.transposed else (a, b)

    @property
    def rank(self) -> int:
        return sum(int(lora.A.shape[1]) for lora in self.adapters)

    def working_bytes(self, out_bytes: int) -> int:
        out_f, in_f = self.linear_shape
        return self.num_experts * merge_working_bytes(out_f, in_f, self.rank, out_bytes)

    def full(self, device: torch.device) -> torch.Tensor:
        """The merged stack in fp32, in the stored orientation: ``W + s B A`` per expert (its transpose when
        ``transposed``)."""
        merged = self.weight.detach().to(device=device, dtype=torch.float32, copy=True)
        with ieee_fp32_matmul():
            for lora in self.adapters:
                a = lora.A.detach().to(device=device, dtype=torch.float32)
                b = lora.B.detach().to(device=device, dtype=torch.float32)
                if self.transposed:  # [E, in, r] @ [E, r, out] = (B_e A_e)^T
                    merged.baddbmm_(a.transpose(1, 2), b.transpose(1, 2), alpha=lora.scaling)
                else:  # [E, out, r] @ [E, r, in]
                    merged.baddbmm_(b, a, alpha=lora.scaling)
        return merged

    def expert_rows(self, device: torch.device, e: int, rows: slice = slice(None)) -> torch.Tensor:
        """Expert ``e``'s merged projection rows ``rows`` in the linear orientation ``[out, in]``, fp32:
        ``W_e[rows] + s B_e[rows] A_e``."""
        w = self.weight[e].t() if self.transposed else self.weight[e]
        merged = w[rows].detach().to(device=device, dtype=torch.float32, copy=True)
        with ieee_fp32_matmul():
            for lora in self.adapters:
                a = lora.A[e].detach().to(device=device, dtype=torch.float32)
                b = lora.B[e][rows].detach().to(device=device, dtype=torch.float32)
                merged.addmm_(b, a, alpha=lora.scaling)
        return merged


def stacked_experts(module: nn.Module, transposed: bool) -> dict[str, StackedExperts]:
    """``{"gate_up_proj": ..., "down_proj": ...}`` of an experts module (PEFT-wrapped or not, see
    :func:`experts_module`); ``transposed``: the family stores ``[E, in, out]`` (``MoE.transposed``)."""
    found = experts_module(module)
    if found is None:
        raise ValueError(f"{type(module).__name__} is not a mixture-of-experts experts module")
    inner, wrappers = found
    return {name: StackedExperts(getattr(inner, name), _adapters(wrappers.get(name), int(getattr(inner, name).shape[0]), name),
                                 transposed) for name in STACKED}
