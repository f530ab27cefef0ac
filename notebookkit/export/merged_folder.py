"""The folder a merged export writes (``merged_16bit``, ``merged_4bit_forced``), and what an export returns.

:func:`write_merged_folder` streams a plan of tensors (:mod:`.merge`) into safetensors shards
(:mod:`.safetensors_stream`), tensor by tensor on the device :class:`MergeDevice` picks, then writes
``config.json`` (without ``quantization_config`` unless the form adds one, and without the low-bit base's
``notebookkit_base_format`` record: the merged weights are dense), ``generation_config.json``
(its ``eos_token_id`` holds the token that ends the assistant's turn) and the tokenizer. Everything
is written into a temporary folder beside the target and renamed at the end, so a failed export
never leaves a folder that looks complete.
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
from typing import Any, Optional

import torch
import torch.nn as nn

from .chat_turns import stop_ids
from .checks import ExportError, check_output_folder, format_bytes, parse_size
from .merge import PlannedTensor, merged_config
from .safetensors_stream import write_sharded_safetensors

__all__ = ["ExportResult", "MergeDevice", "write_merged_folder", "temporary_sibling", "move_into_place", "folder_bytes",
           "save_tokenizer"]


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


class MergeDevice:
    """Picks, tensor by tensor, where a merge runs: on its GPU while under the memory budget, else CPU."""

    def __init__(self, maximum_memory_usage: float) -> None:
        if not 0 < float(maximum_memory_usage) <= 1:
            raise ExportError(f"maximum_memory_usage={maximum_memory_usage} must be a fraction in (0, 1], e.g. 0.75.")
        self.fraction = float(maximum_memory_usage)
        self.counts: dict[str, int] = {}

    def budget(self, device: torch.device) -> int:
        """Bytes this export may have allocated on ``device``."""
        if device.index is None:  # "cuda" means the current device; the fraction getter wants an index
            device = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(device).total_memory
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # absent in older torch
        cap = float(getter(device)) if getter is not None else 1.0
        return int(total * min(self.fraction, cap))

    def pick(self, planned: PlannedTensor) -> torch.device:
        device = planned.source_device
        if device.type == "cuda":
            if torch.cuda.memory_allocated(device) + planned.working_bytes > self.budget(device):
                device = torch.device("cpu")
        self.counts[device.type] = self.counts.get(device.type, 0) + 1
        return device


def temporary_sibling(target: Path) -> Path:
    tmp = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    return tmp


def move_into_place(tmp: Path, target: Path) -> None:
    """Rename the finished folder onto ``target``, replacing an older export there."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def folder_bytes(folder: Path) -> tuple[list[Path], int]:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return files, sum(p.stat().st_size for p in files)


def _write_config(base: nn.Module, folder: Path, dtype: torch.dtype, tokenizer: Any, extra: Optional[dict] = None) -> None:
    config = merged_config(base)
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


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


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
    tmp = temporary_sibling(target)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            shards = write_sharded_safetensors(plan, tmp, shard_bytes, lambda p: p.make(chooser.pick(p)))
        _write_config(base, tmp, dtype, tokenizer, extra_config)
        save_tokenizer(tokenizer, tmp)
        move_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        model.train(was_training)
    files, size = folder_bytes(target)
    peak = max((torch.cuda.max_memory_allocated(d) for d in cuda_devices), default=None)
    result = ExportResult(form, target, files, size, time.perf_counter() - start, peak, dict(chooser.counts))
    return result, len(shards)
