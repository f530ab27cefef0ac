"""``save_method="merged_4bit_forced"``: the merged model re-quantised to NF4, in a folder that
``transformers`` + ``bitsandbytes`` load in 4-bit as it is (its ``config.json`` carries the
``quantization_config``: NF4, nested absmax, the model's compute dtype; nothing is quantised at load).

Every linear layer that transformers loads in 4-bit under that config (each ``nn.Linear`` except the
output head, matched by transformers' own ``should_convert_module``) is merged in fp32 exactly as for
``merged_16bit`` (``W + sum_i s_i B_i @ A_i``, NF4 decoded by notebookkit) and quantised by
:func:`notebookkit.export.nf4_quantize.quantize_nf4` on the device that merged it; every other tensor
is written in the 16-bit dtype. Tensors stream to safetensors shards one at a time, as for
``merged_16bit``.

Re-quantising rounds: each merged weight moves to its nearest NF4 level, ``|error| <= absmax / 2 x``
the gap between levels. The export measures it while quantising and says so in a warning:

* ``relative error`` = ``sqrt(sum (decoded - W')^2 / sum W'^2)`` over all quantised weights (and the
  worst single tensor), against the fp32 merge ``W'``;
* the same error over the adapted layers against the size of the LoRA update itself,
  ``||sum_i s_i B_i A_i||_F``, computed without an ``out x in`` buffer as
  ``||B A||_F^2 = sum((B^T B) * (A A^T))`` (``B = [s_1 B_1 ...]``, ``A = [A_1; ...]``, ``r x r`` products).
  A ratio near or above 1 means the rounding is as large as everything the fine-tune changed.

``merged_16bit`` is the lossless form; load it with ``load_in_4bit=True`` where 4-bit memory is needed.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from notebookkit.memory.export import nf4_merge_working_bytes

from .active_adapters import active_adapter_names
from .checks import format_bytes
from .merge import PlannedTensor, base_model_of, plan_merged_tensors
from .merged_folder import write_merged_folder
from .nf4_quantize import NF4Weight, nf4_tensor_shapes, quantize_nf4

__all__ = ["save_merged_4bit_forced", "quantization_config", "NF4Rounding", "lora_update_norms", "plan_4bit_tensors"]


def quantization_config(compute_dtype: torch.dtype, skip_modules: list[str]) -> dict:
    """The ``quantization_config`` of the folder (transformers' ``BitsAndBytesConfig``, as a dict)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=torch.uint8, llm_int8_skip_modules=skip_modules,
    ).to_dict()


def _skip_modules(base: nn.Module) -> list[str]:
    """Modules transformers keeps in 16-bit: the output head (by its module name) and ``_keep_in_fp32_modules``."""
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    names = [name for name, module in base.named_modules() if head is not None and module is head]
    return sorted(set(names + list(getattr(base, "_keep_in_fp32_modules", None) or [])))


def lora_update_norms(model: nn.Module) -> dict[str, float]:
    """``||sum_i s_i B_i A_i||_F^2`` of each adapted layer, by weight name (module docstring), float64."""
    norms: dict[str, float] = {}
    for name, module in base_model_of(model).named_modules():
        if not (hasattr(module, "base_layer") and hasattr(module, "lora_A")):
            continue
        adapters = active_adapter_names(module)
        if not adapters:
            continue
        a = torch.cat([module.lora_A[k].weight.detach().double().cpu() for k in adapters], 0)
        b = torch.cat([module.lora_B[k].weight.detach().double().cpu() * float(module.scaling[k]) for k in adapters], 1)
        norms[f"{name}.weight"] = float(((b.T @ b) * (a @ a.T)).sum())
    return norms


@dataclass
class NF4Rounding:
    """What re-quantising changed, summed over the weights as they were quantised."""

    update_norms: dict[str, float]  # ||s B A||^2 by weight name
    squared_error: float = 0.0
    squared_norm: float = 0.0
    adapted_error: float = 0.0  # squared error of the adapted layers
    adapted_update: float = 0.0  # ||s B A||^2 summed over them
    worst: tuple[float, str] = (0.0, "")
    tensors: int = 0
    per_tensor: dict[str, float] = field(default_factory=dict)  # relative error by weight name

    def add(self, name: str, q: NF4Weight) -> None:
        self.tensors += 1
        self.squared_error += q.squared_error
        self.squared_norm += q.squared_norm
        rel = math.sqrt(q.squared_error / q.squared_norm) if q.squared_norm > 0 else 0.0
        self.per_tensor[name] = rel
        if rel >= self.worst[0]:
            self.worst = (rel, name)
        if name in self.update_norms:
            self.adapted_error += q.squared_error
            self.adapted_update += self.update_norms[name]

    @property
    def relative_error(self) -> float:
        return math.sqrt(self.squared_error / self.squared_norm) if self.squared_norm > 0 else 0.0

    @property
    def error_over_update(self) -> Optional[float]:
        """Rounding error of the adapted layers over the size of their LoRA update (None without one)."""
        return math.sqrt(self.adapted_error / self.adapted_update) if self.adapted_update > 0 else None

    def message(self) -> str:
        text = (f"merged_4bit_forced: re-quantising the merged weights to NF4 changed them by {self.relative_error:.2%} "
                f"(relative error against the fp32 merge, over {self.tensors} quantised weights; worst "
                f"{self.worst[0]:.2%} in {self.worst[1]}).")
        ratio = self.error_over_update
        if ratio is not None:
            text += (f" On the adapted layers that rounding is {ratio:.2f}x the size of the LoRA update itself "
                     "(||s*B@A||; at 1 the rounding is as large as everything the fine-tune changed).")
        return text + (" save_method='merged_16bit' is the lossless choice; load that folder with load_in_4bit=True "
                       "where 4-bit memory is needed.")


class _QuantizedWeight:
    """The serialised tensors of one NF4 weight, computed when the first is asked for, dropped after the last."""

    def __init__(self, planned: PlannedTensor, compute_dtype: torch.dtype, rounding: NF4Rounding) -> None:
        self.planned, self.compute_dtype, self.rounding = planned, compute_dtype, rounding
        self.parts: Optional[dict[str, torch.Tensor]] = None

    def part(self, key: str, device: torch.device) -> torch.Tensor:
        if self.parts is None:
            q = quantize_nf4(self.planned.make(device), dtype=self.compute_dtype)
            self.rounding.add(self.planned.name, q)
            self.parts = q.state_dict(self.planned.name)
        tensor = self.parts.pop(key)
        if not self.parts:
            self.parts = None
        return tensor


def _to_dtype(planned: PlannedTensor, dtype: torch.dtype) -> PlannedTensor:
    if not planned.dtype.is_floating_point or planned.dtype == dtype:
        return planned
    make = planned.make
    return PlannedTensor(planned.name, planned.shape, dtype, lambda device: make(device).to(dtype), planned.source_device,
                         planned.working_bytes, planned.linear_rank)


def plan_4bit_tensors(model: nn.Module, compute_dtype: torch.dtype, rounding: NF4Rounding) -> list[PlannedTensor]:
    """The tensors of the 4-bit folder, in order: each quantised weight as its six bitsandbytes tensors."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = _skip_modules(base_model_of(model))
    plan: list[PlannedTensor] = []
    for planned in plan_merged_tensors(model, torch.float32):
        module_name = planned.name.rsplit(".", 1)[0]
        if planned.linear_rank is None or not should_convert_module(module_name, skip):
            plan.append(_to_dtype(planned, compute_dtype))
            continue
        group = _QuantizedWeight(planned, compute_dtype, rounding)
        out_f, in_f = planned.shape
        for i, (name, (shape, dtype)) in enumerate(nf4_tensor_shapes(planned.shape, planned.name).items()):
            work = nf4_merge_working_bytes(out_f, in_f, planned.linear_rank) if i == 0 else 0
            plan.append(PlannedTensor(name, shape, dtype, lambda device, key=name, g=group: g.part(key, device),
                                      planned.source_device, work))
    return plan


def save_merged_4bit_forced(model: nn.Module, base: nn.Module, save_directory: Any, tokenizer: Any, compute_dtype: torch.dtype,
                            maximum_memory_usage: float, max_shard_size: Any, verbose: bool):
    """Write the NF4 folder (module docstring); returns an ``ExportResult`` whose ``measurements`` hold the rounding."""
    rounding = NF4Rounding(lora_update_norms(model))
    plan = plan_4bit_tensors(model, compute_dtype, rounding)
    extra = {"quantization_config": quantization_config(compute_dtype, _skip_modules(base))}
    result, shards = write_merged_folder(model, base, plan, save_directory, tokenizer, compute_dtype, maximum_memory_usage,
                                            max_shard_size, "merged_4bit_forced", "the 4-bit merged model", extra)
    target, size = result.path, result.bytes_on_disk
    message = rounding.message()
    result.notes.append(message)
    result.measurements = {"nf4_relative_error": rounding.relative_error, "nf4_worst_relative_error": rounding.worst[0],
                           "nf4_worst_tensor": rounding.worst[1], "nf4_error_over_lora_update": rounding.error_over_update,
                           "nf4_quantised_weights": rounding.tensors}
    warnings.warn(message, UserWarning, stacklevel=3)
    if verbose:
        print(f"notebookkit: 4-bit merged model written to {target} ({format_bytes(size)}, {shards} shard(s))")
    return result
