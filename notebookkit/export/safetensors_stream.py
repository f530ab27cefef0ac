"""Sharded safetensors written tensor by tensor, so host memory holds one tensor at a time.

A safetensors file is ``u64 little-endian header length N``, then ``N`` bytes of JSON (padded with
spaces to a multiple of 8), then the raw tensor bytes back to back. The JSON maps each name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data section), plus
``"__metadata__": {"format": "pt"}``. Since every tensor's shape and dtype is known from the plan
before any is computed, the header of a shard is written first and the tensors are streamed after it.

Shards follow Hugging Face's layout: ``model.safetensors`` when everything fits in one shard, else
``model-00001-of-0000K.safetensors`` ... and ``model.safetensors.index.json`` whose ``weight_map``
names the shard of every tensor and whose ``metadata.total_size`` is the sum of tensor bytes.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .merge import PlannedTensor

__all__ = ["plan_shards", "write_sharded_safetensors", "SAFETENSORS_DTYPES"]

SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def plan_shards(tensors: Sequence[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Split the tensors, in order, into shards of at most ``max_shard_bytes`` (a larger tensor gets its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _header(shard: Sequence[PlannedTensor]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in shard:
        entries[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_tensor(fh, tensor: torch.Tensor, planned: PlannedTensor) -> None:
    if tuple(tensor.shape) != planned.shape or tensor.dtype != planned.dtype:
        raise RuntimeError(
            f"{planned.name}: computed {tuple(tensor.shape)} {tensor.dtype}, planned {planned.shape} {planned.dtype}"
        )
    host = tensor.detach().to("cpu").contiguous()
    fh.write(host.reshape(-1).view(torch.uint8).numpy().data)


def write_sharded_safetensors(
    tensors: Sequence[PlannedTensor],
    folder: os.PathLike,
    max_shard_bytes: int,
    compute: Callable[[PlannedTensor], torch.Tensor],
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> list[Path]:
    """Write ``tensors`` into ``folder`` as Hugging Face safetensors shards; returns the shard paths.

    ``compute(planned)`` produces each tensor when its turn comes; it is dropped once written.
    """
    folder = Path(folder)
    shards = plan_shards(tensors, max_shard_bytes)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    done, total = 0, len(tensors)
    paths = []
    for name, shard in zip(names, shards):
        path = folder / name
        with open(path, "wb") as fh:
            fh.write(_header(shard))
            for planned in shard:
                tensor = compute(planned)
                _write_tensor(fh, tensor, planned)
                del tensor
                done += 1
                if progress is not None:
                    progress(done, total, planned.name)
        paths.append(path)
    if n > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard},
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return paths
