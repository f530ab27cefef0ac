"""Data-parallel training on the established engines: settings and helpers for ``torchrun`` and
``accelerate launch``.

notebookkit does not ship a distributed engine of its own. A script launched with
``torchrun --nproc_per_node N`` (or ``accelerate launch --num_processes N``) starts ``N`` copies of
itself; each reads ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` from the environment, loads the model on
its own device, and Hugging Face ``Trainer`` wraps it in PyTorch ``DistributedDataParallel`` (DDP).

The maths of one optimizer step with ``P`` processes, ``K`` accumulation micro-batches per process
and ``N`` label tokens in the whole global batch (all processes, all micro-batches)::

    process p, micro-batch k:  l_pk = (sum of token losses of that micro-batch) / N * P
    DDP all-reduce (mean):     g    = (1/P) * sum_p sum_k d l_pk / d theta
                                    = d/d theta [ (1/N) * sum over all N tokens of the token loss ]

which is exactly the gradient one process computes on the same global batch. ``N`` is gathered
across processes by ``Trainer`` (``average_tokens_across_devices=True``) and handed to the model as
``num_items_in_batch``; the factor ``P`` is applied by ``Trainer.compute_loss`` (and by TRL's
``SFTTrainer.compute_loss``) so DDP's mean becomes a sum. The gradients are all-reduced once per
optimizer step: ``Trainer`` runs the first ``K - 1`` micro-batches inside ``DDP.no_sync()``.

Layer placement (``device_map="balanced"``) is the other way past one card: one process, the
decoder layers spread over the visible GPUs, run one after another. It does not combine with DDP
in this toolkit (each DDP process owns one GPU), and :func:`local_device_map` says so.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "DistInfo",
    "dist_info",
    "ddp_backend",
    "ddp_training_args",
    "local_device_map",
    "seed_everything",
    "main_print",
]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in a launch (read from the launcher's environment variables).

    Attributes:
        rank: global index of this process, ``0 .. world_size - 1``.
        local_rank: index on this machine (the GPU it should use).
        world_size: number of processes in the launch (``1`` for a plain ``python`` run).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_distributed(self) -> bool:
        """True when launched with more than one process."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on the process that prints, saves and writes reports (rank 0)."""
        return self.rank == 0


def _env_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return default


def dist_info() -> DistInfo:
    """This process's rank, local rank and world size.

    ``torchrun`` and ``accelerate launch`` both set ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``; MPI
    launchers set their own names, which are read too. A plain ``python script.py`` is rank 0 of 1.
    """
    world = _env_int(("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"), 1)
    rank = _env_int(("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"), 0)
    local = _env_int(("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"), rank)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"inconsistent launch environment: RANK={rank}, WORLD_SIZE={world}")
    return DistInfo(rank=rank, local_rank=local, world_size=world)


def ddp_backend() -> str:
    """``"nccl"`` when CUDA GPUs are visible, else ``"gloo"`` (the CPU backend used in CI)."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def ddp_training_args() -> dict[str, Any]:
    """``TrainingArguments`` / ``SFTConfig`` fields that make DDP runs exact and lean.

    * ``ddp_backend``: ``nccl`` on GPUs, ``gloo`` on CPUs.
    * ``ddp_find_unused_parameters=False``: every LoRA weight gets a gradient on every step (the
      fused kernels return gradients for ``A`` and ``B`` of every adapted projection), so DDP need
      not search the graph for unused parameters; that search costs a graph walk per step.
    * ``average_tokens_across_devices=True``: the loss of each process is divided by the label
      tokens of the *global* batch (see the module docstring), so 2 processes x batch 2 train
      exactly like 1 process x batch 4.
    * ``use_cpu``: set when no GPU is visible, so the launch runs on CPU processes (gloo).
    """
    import torch

    cuda = torch.cuda.is_available()
    return {
        "ddp_backend": ddp_backend(),
        "ddp_find_unused_parameters": False,
        "average_tokens_across_devices": True,
        "use_cpu": not cuda,
    }


_PLACEMENT_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def local_device_map(device_map: Any = None, info: Optional[DistInfo] = None) -> Any:
    """The ``device_map`` to hand to ``FastLanguageModel.from_pretrained`` in this process.

    Under a multi-process launch on GPUs every process must load the whole model onto *its own*
    GPU (``{"": local_rank}``), and CUDA's current device is set to it, so kernels, pinned-memory
    copies and NCCL all use that GPU. Without GPUs the model stays on the CPU (``None``).

    In a single process the value given is returned unchanged, so ``"balanced"`` spreads the
    layers over all visible GPUs.

    Raises:
        ValueError: a layer-placement map (``"balanced"``, ``"auto"``, ...) in a multi-process launch.
    """
    import torch

    info = info or dist_info()
    if not info.is_distributed:
        return device_map
    if isinstance(device_map, str) and device_map in _PLACEMENT_MAPS:
        raise ValueError(
            f"device_map={device_map!r} spreads one model over all visible GPUs, but this is a launch of "
            f"{info.world_size} processes (data parallel), where each process holds a whole copy of the model "
            "on its own GPU. Either launch one process (`python notebooks/sft/chat_sft.py ... --device_map balanced`) "
            "for a model too large for one card, or drop device_map for data-parallel training."
        )
    if not torch.cuda.is_available():
        return device_map
    if info.local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"LOCAL_RANK={info.local_rank} but only {torch.cuda.device_count()} GPUs are visible: launch at most "
            f"{torch.cuda.device_count()} processes per machine (--nproc_per_node / --num_processes)."
        )
    torch.cuda.set_device(info.local_rank)
    return {"": info.local_rank} if device_map is None else device_map


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every GPU) the same way in every process."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def main_print(*args: Any, info: Optional[DistInfo] = None, **kwargs: Any) -> None:
    """``print`` on rank 0 only (other ranks stay quiet), flushed at once."""
    if (info or dist_info()).is_main:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)
