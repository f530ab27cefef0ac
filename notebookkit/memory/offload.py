"""Pinned host buffers for offloaded activations, reused across steps.

Offloaded checkpointing parks each offloaded layer's input (``N * H * s`` bytes) in host memory
during the forward and copies it back before that layer's backward. Allocating fresh pinned memory
every step is slow (``cudaHostAlloc`` is a synchronising driver call) and, with sequence lengths that
change from batch to batch, lets host memory creep up. :class:`PinnedBufferPool` instead keeps
byte buffers and hands out typed views of them:

- ``acquire(shape, dtype, stream)`` returns a view of a free buffer of at least that many bytes
  (the smallest that fits), or allocates a new one rounded up to ``granularity`` bytes;
- ``release(view, after=event)`` returns its buffer to the pool (the next step reuses it) while
  an asynchronous copy may still read it: the pool keeps the CUDA event recorded after that copy,
  and whoever gets the buffer next waits for it on the GPU (``stream.wait_event``, the host keeps
  queueing work) or, when it names no stream, on the host (``event.synchronize()``);
- before allocating, free buffers too small for the request are dropped, so the pool holds at
  most (layers in flight) x (largest request) bytes, and never grows across steps of equal shape;
- a new allocation that would pass ``max_bytes`` or leave less than ``reserve_bytes`` of host RAM
  available raises :class:`HostMemoryError` naming the sizes, before the machine starts swapping.

Buffers are pinned when CUDA is available (``pin=None``), plain host memory otherwise.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch

from .meters import HOST_RESERVE_BYTES

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

    def __init__(self, max_bytes: int | None = None, reserve_bytes: int = HOST_RESERVE_BYTES,
                 granularity: int = 2 * 2**20, pin: bool | None = None) -> None:
        self.max_bytes = max_bytes
        self.reserve_bytes = int(reserve_bytes)
        self.granularity = max(1, int(granularity))
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        # Free buffers, each with the event after which it may be written (None: right away).
        self._free: list[tuple[torch.Tensor, Any]] = []
        self._busy: dict[int, torch.Tensor] = {}  # data_ptr of a handed-out view -> its buffer
        self.allocations = 0
        self.peak_bytes = 0

    # ---- accounting ---------------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """Bytes of all buffers the pool holds (free and in use)."""
        return sum(b.numel() for b, _ in self._free) + sum(b.numel() for b in self._busy.values())

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

    def acquire(self, shape: Iterable[int], dtype: torch.dtype, stream: Any = None) -> torch.Tensor:
        """A host tensor of ``shape`` and ``dtype`` (contents undefined), backed by a pooled buffer.

        ``stream``: the CUDA stream that will write into it. A reused buffer may still be read by a
        copy released with ``after=event``; that stream then waits for the event on the GPU, so the
        host does not block. Without a stream (a host-side writer) the host waits for the event.
        """
        shape = tuple(int(s) for s in shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        fitting = [i for i, (b, _) in enumerate(self._free) if b.numel() >= nbytes]
        if fitting:
            buf, after = self._free.pop(min(fitting, key=lambda i: self._free[i][0].numel()))
            _wait(after, stream)
        else:
            # Drop free buffers too small to ever serve this size again, then allocate. A dropped
            # pinned buffer may still be read by a pending copy: PyTorch's pinned-memory allocator
            # records an event for every asynchronous copy and reuses the memory only after it.
            self._free = [(b, e) for b, e in self._free if b.numel() >= nbytes]
            size = max(self.granularity, math.ceil(nbytes / self.granularity) * self.granularity)
            self._check_room(size)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.allocations += 1
        view = buf[:nbytes].view(dtype).view(shape) if nbytes else buf[:0].view(dtype).view(shape)
        self._busy[view.data_ptr() if nbytes else id(view)] = buf
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return view

    def release(self, view: torch.Tensor, after: Any = None) -> None:
        """Give a tensor from :meth:`acquire` back to the pool.

        ``after``: a CUDA event recorded after the last asynchronous copy that reads or writes the
        tensor (None: nothing pending). The buffer is handed out again at once, but its next writer
        waits for that event (see :meth:`acquire`), so releasing never blocks the host.
        """
        key = view.data_ptr() if view.numel() else id(view)
        buf = self._busy.pop(key, None)
        if buf is None:
            raise ValueError("notebookkit: this tensor did not come from this PinnedBufferPool (or was released twice).")
        self._free.append((buf, after))

    def clear(self) -> None:
        """Drop all free buffers (buffers in use stay valid until released)."""
        self._free.clear()


def _wait(after: Any, stream: Optional[Any]) -> None:
    """Order a write into a reused buffer after the copy that last used it (``after``, an event)."""
    if after is None:
        return
    if stream is not None:
        stream.wait_event(after)  # on the GPU: the host goes on queueing work
    else:
        after.synchronize()  # a host-side writer has to wait on the host
