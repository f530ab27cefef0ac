"""``model.save_pretrained_merged``: the LoRA adapter alone, or the model with the adapter merged in.

``merged_16bit`` streams the merged weights (see :mod:`.merge`) into Hugging Face safetensors
shards (:mod:`.safetensors_stream`): one tensor is computed, written and dropped at a time, so host
memory holds at most one merged tensor and the GPU at most one tensor's fp32 working set on top of
the loaded model. A tensor is merged on the GPU when ``allocated + its working set`` stays under
``maximum_memory_usage`` x the card's memory (or the per-process cap, whichever is lower), else on
the CPU. Everything is written into a temporary folder beside the target and renamed at the end,
so a failed export never leaves a folder that looks complete.

The folder loads with ``transformers.AutoModelForCausalLM.from_pretrained``: ``config.json``
(without ``quantization_config``), the tokenizer with its chat template, and a
``generation_config.json`` whose ``eos_token_id`` holds the token that ends the assistant's turn.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from notebookkit.models.patching.checkpointing import release_host_buffers

from .checks import SAVE_METHODS, ExportError, check_output_folder, check_save_method, format_bytes, refuse_mixture_of_experts
from .checks import require_notebookkit_model
from .checkpoint_layout import checkpoint_layout
from .merge import base_model_of, plan_merged_tensors
from .merged_4bit import save_merged_4bit_forced
from .merged_folder import ExportResult, MergeDevice, folder_bytes, move_into_place, save_tokenizer, temporary_sibling
from .merged_folder import write_merged_folder

__all__ = ["save_pretrained_merged", "ExportResult", "SAVE_METHODS", "model_dtype", "MergeDevice"]


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its 16-bit weights' dtype, or the NF4 compute dtype."""
    base = base_model_of(model)
    for module in base.modules():
        weight = getattr(module, "weight", None)
        if weight is None:
            continue
        qs = getattr(weight, "quant_state", None)
        if qs is not None and qs.dtype is not None:
            return qs.dtype
    for p in base.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _written_dtype(model: nn.Module, dtype: Union[None, str, torch.dtype]) -> torch.dtype:
    if dtype is None:
        return model_dtype(model)
    if isinstance(dtype, str):
        names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                 "fp32": torch.float32, "float32": torch.float32}
        if dtype.lower() not in names:
            raise ExportError(f"dtype={dtype!r} is not one of 'bfloat16', 'float16', 'float32'.")
        return names[dtype.lower()]
    return dtype


def save_pretrained_merged(
    model: nn.Module,
    save_directory: Union[str, os.PathLike],
    tokenizer: Any = None,
    save_method: str = "merged_16bit",
    maximum_memory_usage: float = 0.75,
    max_shard_size: Union[int, str] = "5GB",
    temporary_location: Optional[Union[str, os.PathLike]] = None,
    dtype: Union[None, str, torch.dtype] = None,
    verbose: bool = True,
    **kwargs: Any,
) -> ExportResult:
    """Save the model for serving: the LoRA adapter alone, or merged into the base weights.

    Args:
        save_directory: the folder to write (created; an older export there is replaced at the end).
        tokenizer: saved beside the weights, with its chat template; its end-of-turn token goes into
            ``generation_config.json`` so generation stops at the end of the assistant's answer.
        save_method: ``"merged_16bit"`` (LoRA merged into 16-bit weights, loads with plain
            ``transformers``), ``"lora"`` (the adapter in PEFT's format) or ``"merged_4bit_forced"``
            (merged in fp32, then re-quantised to NF4 by notebookkit; loads in 4-bit with
            ``transformers`` + ``bitsandbytes``; warns with the measured rounding, see
            :mod:`notebookkit.export.merged_4bit`). ``"merged_4bit"`` is refused: the rounding is lossy.
        maximum_memory_usage: fraction of the GPU the export may fill (model included); a tensor
            whose merge would go over it is merged on the CPU instead.
        max_shard_size: largest safetensors shard, ``"5GB"`` as in Hugging Face.
        temporary_location: accepted for compatibility; the export streams tensor by tensor and
            needs no spill folder (the unfinished export lives beside ``save_directory``).
        dtype: dtype of the merged weights; default the model's compute dtype (bf16/fp16 on a
            GPU; fp32 for a model loaded in fp32 on a CPU). For ``merged_4bit_forced``: the compute
            dtype of the 4-bit layers and the dtype of the tensors left in 16-bit.

    Returns:
        an :class:`ExportResult` (folder, files, size on disk, seconds, GPU peak, where tensors merged).
    """
    base = require_notebookkit_model(model, "save_pretrained_merged")
    check_save_method(save_method)
    release_host_buffers(model)  # the merge wants host RAM, not offloading's pinned buffers of the last step
    if save_method == "lora":
        return _save_lora(model, base, save_directory, tokenizer)
    out_dtype = _written_dtype(model, dtype)
    if save_method == "merged_4bit_forced":
        refuse_mixture_of_experts(getattr(base.config, "model_type", None), "save_method='merged_4bit_forced'")
        return save_merged_4bit_forced(model, base, save_directory, tokenizer, out_dtype, maximum_memory_usage, max_shard_size, verbose)
    return _save_merged_16bit(model, base, save_directory, tokenizer, out_dtype, maximum_memory_usage, max_shard_size, verbose)


def _save_lora(model: nn.Module, base: nn.Module, save_directory, tokenizer) -> ExportResult:
    if not hasattr(model, "peft_config"):
        raise ExportError(
            "save_method='lora' saves LoRA adapters, but this model has none. Add them with "
            "model = FastLanguageModel.get_peft_model(model, r=16), or use save_method='merged_16bit'."
        )
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    target = check_output_folder(save_directory, adapter_bytes, "the LoRA adapter")
    start = time.perf_counter()
    tmp = temporary_sibling(target)
    try:
        model.save_pretrained(tmp)
        save_tokenizer(tokenizer, tmp)
        move_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files, size = folder_bytes(target)
    return ExportResult("lora", target, files, size, time.perf_counter() - start)


def _save_merged_16bit(model, base, save_directory, tokenizer, out_dtype, maximum_memory_usage, max_shard_size, verbose) -> ExportResult:
    plan = checkpoint_layout(plan_merged_tensors(model, out_dtype), base.config)
    result, shards = write_merged_folder(model, base, plan, save_directory, tokenizer, out_dtype, maximum_memory_usage,
                                                  max_shard_size, "merged_16bit", "the merged model")
    target, size = result.path, result.bytes_on_disk
    result.notes.append(f"{len(plan)} tensors in {shards} shard(s), {str(out_dtype).replace('torch.', '')}")
    if verbose:
        where = ", ".join(f"{n} on {d}" for d, n in result.merged_on.items())
        print(f"notebookkit: merged model written to {target} ({format_bytes(size)}, {shards} shard(s); merged {where})")
    return result
