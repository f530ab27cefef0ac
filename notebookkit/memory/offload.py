"""Pinned host buffers for offloaded activations, reused across steps.

Offloaded checkpointing parks each offloaded layer's input (``N * H * s`` bytes) in host memory
during the forward and copies it back before that layer's backward. Allocating fresh pinned memory
every step is slow (``cudaHostAlloc`` is a synchronising driver call) and, with sequence lengths that
change from batch to batch, lets host memory creep up. :class:`PinnedBufferPool` instead keeps
byte buffers and hands out typed views of them:

- ``acquire(shape, dtype)`` returns a view of a free buffer of at least that many bytes (the
  smallest that fits), or allocates a new one rounded up to ``granularity`` bytes;
- ``release(view)`` returns its buffer to the pool (the next step reuses it);
- before allocating, free buffers too small for the request are dropped, so the pool holds at
  most (layers in flight) x (largest request) bytes, and never grows across steps of equal shape;
- a new allocation that would pass ``max_bytes`` or leave less than ``reserve_bytes`` of host RAM
  available raises :class:`HostMemoryError` naming the sizes, before the machine starts swapping.

Buffers are pinned when CUDA is available (``pin=None``), plain host memory otherwise.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

GiB = 1024**3


class HostMemoryError(MemoryError):
    """Offloading would need more host memory than is allowed or available."""


class PinnedBufferPool:
    """A pool of (pinned) host byte buffers, handed out as typed views.

    Args:
        max_bytes: cap on the bytes the pool may hold (None: no cap besides available RAM).
        reserve_bytes: host RAM that must stay available after a new allocation (default 2 GiB).
        granularity: allocations are rounded up to a multiple of this many bytes (default 2 MiB),
            so slightly different sequence lengths share buffers.
        pin: page-lock the buffers (default: when CUDA is available).
    """

    def __init__(self, max_bytes: int | None = None, reserve_bytes: int = 2 * GiB,
                 granularity: int = 2 * 2**20, pin: bool | None = None) -> None:
        self.max_bytes = max_bytes
        self.reserve_bytes = int(reserve_bytes)
        self.granularity = max(1, int(granularity))
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        self._free: list[torch.Tensor] = []
        self._busy: dict[int, torch.Tensor] = {}  # data_ptr of a handed-out view -> its buffer
        self.allocations = 0
        self.peak_bytes = 0

    # ---- accounting ---------------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """Bytes of all buffers the pool holds (free and in use)."""
        return sum(b.numel() for b in self._free) + sum(b.numel() for b in self._busy.values())

    @property
    def in_use_bytes(self) -> int:
        return sum(b.numel() for b in self._busy.values())

    def __len__(self) -> int:
        return len(self._free) + len(self._busy)

    # ---- buffers ------------------------------------------------------------------------------
    def _check_room(self, nbytes: int) -> None:
        held = self.held_bytes
        if self.max_bytes is not None and held + nbytes > self.max_bytes:
            raise HostMemoryError(
                f"notebookkit: offloading needs {(held + nbytes) / GiB:.2f} GiB of pinned host memory, more than the "
                f"{self.max_bytes / GiB:.2f} GiB allowed. Offload fewer layers (a larger max_memory), or lower "
                "batch_size / max_seq_length."
            )
        from .meters import host_memory

        available = host_memory().available
        if available and available - nbytes < self.reserve_bytes:
            raise HostMemoryError(
                f"notebookkit: offloading one more layer input needs {nbytes / 2**20:.0f} MiB of host memory but only "
                f"{available / GiB:.2f} GiB is available (keeping {self.reserve_bytes / GiB:.1f} GiB free). "
                "Offload fewer layers (use_gradient_checkpointing=True recomputes without host memory), free host RAM, "
                "or lower batch_size / max_seq_length."
            )

    def acquire(self, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape`` and ``dtype`` (contents undefined), backed by a pooled buffer."""
        shape = tuple(int(s) for s in shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        fitting = [b for b in self._free if b.numel() >= nbytes]
        if fitting:
            buf = min(fitting, key=lambda b: b.numel())
            self._free.remove(buf)
        else:
            # Drop free buffers too small to ever serve this size again, then allocate.
            self._free = [b for b in self._free if b.numel() >= nbytes]
            size = max(self.granularity, math.ceil(nbytes / self.granularity) * self.granularity)
            self._check_room(size)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.allocations += 1
        view = buf[:nbytes].view(dtype).view(shape) if nbytes else buf[:0].view(dtype).view(shape)
        self._busy[view.data_ptr() if nbytes else id(view)] = buf
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return view

    def release(self, view: torch.Tensor) -> None:
        """Give a tensor from :meth:`acquire` back to the pool."""
        key = view.data_ptr() if view.numel() else id(view)
        buf = self._busy.pop(key, None)
        if buf is None:
            raise ValueError("notebookkit: this tensor did not come from this PinnedBufferPool (or was released twice).")
        self._free.append(buf)

    def clear(self) -> None:
        """Drop all free buffers (buffers in use stay valid until released)."""
        self._free.clear()
