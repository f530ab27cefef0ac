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

import copy
import json
import os
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from .chat_turns import stop_ids
from .checks import ExportError, check_output_folder, format_bytes, parse_size, require_notebookkit_model
from .merge import PlannedTensor, base_model_of, plan_merged_tensors
from .safetensors_stream import write_sharded_safetensors

__all__ = ["save_pretrained_merged", "ExportResult", "SAVE_METHODS", "model_dtype", "MergeDevice"]

SAVE_METHODS = ("merged_16bit", "lora", "merged_4bit_forced")


@dataclass
class ExportResult:
    """What an export wrote: the form, the folder or file, its size, and how it went."""

    form: str
    path: Path
    files: list[Path] = field(default_factory=list)
    bytes_on_disk: int = 0
    seconds: float = 0.0
    gpu_peak_bytes: Optional[int] = None
    merged_on: dict[str, int] = field(default_factory=dict)  # device type -> tensors merged there
    notes: list[str] = field(default_factory=list)
    measurements: dict[str, Any] = field(default_factory=dict)  # e.g. merged_4bit_forced's measured rounding

    def __repr__(self) -> str:
        return f"ExportResult({self.form!r}, {str(self.path)!r}, {format_bytes(self.bytes_on_disk)}, {self.seconds:.1f} s)"


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


class MergeDevice:
    """Picks, tensor by tensor, where a merge runs: on its GPU while under the memory budget, else CPU."""

    def __init__(self, maximum_memory_usage: float) -> None:
        if not 0 < float(maximum_memory_usage) <= 1:
            raise ExportError(f"maximum_memory_usage={maximum_memory_usage} must be a fraction in (0, 1], e.g. 0.75.")
        self.fraction = float(maximum_memory_usage)
        self.counts: dict[str, int] = {}

    def budget(self, device: torch.device) -> int:
        """Bytes this export may have allocated on ``device``."""
        total = torch.cuda.get_device_properties(device).total_memory
        cap = 1.0
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if getter is not None:
            try:
                cap = float(getter(device))
            except Exception:  # noqa: BLE001 - older torch
                cap = 1.0
        return int(total * min(self.fraction, cap))

    def pick(self, planned: PlannedTensor) -> torch.device:
        device = planned.source_device
        if device.type == "cuda":
            if torch.cuda.memory_allocated(device) + planned.working_bytes > self.budget(device):
                device = torch.device("cpu")
        self.counts[device.type] = self.counts.get(device.type, 0) + 1
        return device


def _temporary_sibling(target: Path) -> Path:
    tmp = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    return tmp


def _move_into_place(tmp: Path, target: Path) -> None:
    """Rename the finished folder onto ``target``, replacing an older export there."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _folder_bytes(folder: Path) -> tuple[list[Path], int]:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return files, sum(p.stat().st_size for p in files)


def _write_config(base: nn.Module, folder: Path, dtype: torch.dtype, tokenizer: Any, extra: Optional[dict] = None) -> None:
    config = copy.deepcopy(base.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = dtype
    config.use_cache = True
    config.save_pretrained(folder)
    if extra:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **extra}, indent=2, sort_keys=True) + "\n")
    gen = copy.deepcopy(getattr(base, "generation_config", None))
    if gen is None:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_model_config(config)
    if tokenizer is not None:
        ids = stop_ids(tokenizer, gen)
        gen.eos_token_id = ids if len(ids) > 1 else ids[0]
        if tokenizer.pad_token_id is not None:
            gen.pad_token_id = tokenizer.pad_token_id
        if tokenizer.bos_token_id is not None:
            gen.bos_token_id = tokenizer.bos_token_id
    gen.use_cache = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen.save_pretrained(folder)


def _save_tokenizer(tokenizer: Any, folder: Path) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


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
    if save_method == "merged_4bit":
        raise ExportError(
            "save_method='merged_4bit' re-quantises the merged weights to 4-bit, which rounds part of the LoRA "
            "update away. Use save_method='merged_16bit' (lossless; load it with load_in_4bit=True for 4-bit "
            "memory), or save_method='merged_4bit_forced' if you need a 4-bit folder (it warns how much the "
            "rounding changed the weights)."
        )
    if save_method not in SAVE_METHODS:
        raise ExportError(f"save_method={save_method!r} is not one of {', '.join(repr(m) for m in SAVE_METHODS)}.")
    if save_method == "lora":
        return _save_lora(model, base, save_directory, tokenizer)
    out_dtype = _written_dtype(model, dtype)
    if save_method == "merged_4bit_forced":
        from .merged_4bit import save_merged_4bit_forced

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
    tmp = _temporary_sibling(target)
    try:
        model.save_pretrained(tmp)
        _save_tokenizer(tokenizer, tmp)
        _move_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files, size = _folder_bytes(target)
    return ExportResult("lora", target, files, size, time.perf_counter() - start)


def write_merged_folder(model: nn.Module, base: nn.Module, plan: list[PlannedTensor], save_directory: Any, tokenizer: Any,
                        dtype: torch.dtype, maximum_memory_usage: float, max_shard_size: Any, form: str, what: str,
                        extra_config: Optional[dict] = None) -> tuple[ExportResult, int]:
    """Stream ``plan`` into the safetensors shards of a new folder, with config (plus ``extra_config``
    entries), generation config and tokenizer, written beside the target and renamed at the end.
    Returns the result and the number of shards."""
    shard_bytes = parse_size(max_shard_size)
    chooser = MergeDevice(maximum_memory_usage)
    target = check_output_folder(save_directory, sum(t.nbytes for t in plan), what)
    cuda_devices = sorted({t.source_device for t in plan if t.source_device.type == "cuda"}, key=str)
    for dev in cuda_devices:
        torch.cuda.reset_peak_memory_stats(dev)
    start = time.perf_counter()
    tmp = _temporary_sibling(target)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            shards = write_sharded_safetensors(plan, tmp, shard_bytes, lambda p: p.make(chooser.pick(p)))
        _write_config(base, tmp, dtype, tokenizer, extra_config)
        _save_tokenizer(tokenizer, tmp)
        _move_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        model.train(was_training)
    files, size = _folder_bytes(target)
    peak = max((torch.cuda.max_memory_allocated(d) for d in cuda_devices), default=None)
    result = ExportResult(form, target, files, size, time.perf_counter() - start, peak, dict(chooser.counts))
    return result, len(shards)


def _save_merged_16bit(model, base, save_directory, tokenizer, out_dtype, maximum_memory_usage, max_shard_size, verbose) -> ExportResult:
    plan = plan_merged_tensors(model, out_dtype)
    result, shards = write_merged_folder(model, base, plan, save_directory, tokenizer, out_dtype, maximum_memory_usage,
                                                  max_shard_size, "merged_16bit", "the merged model")
    target, size = result.path, result.bytes_on_disk
    result.notes.append(f"{len(plan)} tensors in {shards} shard(s), {str(out_dtype).replace('torch.', '')}")
    if verbose:
        where = ", ".join(f"{n} on {d}" for d, n in result.merged_on.items())
        print(f"notebookkit: merged model written to {target} ({format_bytes(size)}, {shards} shard(s); merged {where})")
    return result
