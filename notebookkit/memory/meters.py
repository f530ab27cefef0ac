"""Memory meters: what the GPU and the host hold right now, cheaply enough to read every step.

GPU figures come from PyTorch's caching allocator (``memory_allocated`` = live tensors,
``max_memory_allocated`` = their peak since the last reset, ``memory_reserved`` = what the
allocator holds) and from the driver (``mem_get_info`` = free and total on the card, which also
sees other processes and the CUDA context). Host figures come from ``/proc`` on Linux, from
``psutil`` when it is installed, and from ``resource`` as a last resort.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class GPUMemory:
    allocated: int
    peak_allocated: int
    reserved: int
    free: int
    total: int
    device: str


@dataclass(frozen=True)
class HostMemory:
    rss: int
    available: int
    total: int


def _cuda():
    try:
        import torch

        if torch.cuda.is_available():
            return torch
    except Exception:
        pass
    return None


def gpu_memory(device: int | None = None, *, with_driver: bool = True) -> GPUMemory | None:
    """Current GPU memory figures in bytes, or None without CUDA.

    ``with_driver=False`` skips ``mem_get_info`` (a driver call) for per-step use.
    """
    torch = _cuda()
    if torch is None:
        return None
    idx = torch.cuda.current_device() if device is None else device
    free = total = 0
    if with_driver:
        free, total = torch.cuda.mem_get_info(idx)
    return GPUMemory(
        allocated=int(torch.cuda.memory_allocated(idx)),
        peak_allocated=int(torch.cuda.max_memory_allocated(idx)),
        reserved=int(torch.cuda.memory_reserved(idx)),
        free=int(free),
        total=int(total),
        device=torch.cuda.get_device_name(idx),
    )


def reset_gpu_peak(device: int | None = None) -> None:
    """Start a new ``peak_allocated`` window (no-op without CUDA)."""
    torch = _cuda()
    if torch is not None:
        torch.cuda.reset_peak_memory_stats(device)


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, rest = line.split(":", 1)
                parts = rest.split()
                if parts:
                    out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def host_rss() -> int:
    """Resident memory of this process in bytes (:func:`process_memory`'s first figure)."""
    return process_memory()[0]


def process_memory(pid: int | str = "self") -> tuple[int, int]:
    """``(resident, anonymous)`` bytes of a process (``/proc/<pid>/statm``): all its resident pages, and those
    less the file-backed and shared ones. The second is what the system cannot take back under pressure, so
    it is what runs a T4 session (about 12.7 GB of host RAM) out of memory; a checkpoint read through
    ``mmap`` counts in the first only. Where ``/proc`` is missing, this process's are both its resident size
    (``psutil``, else the peak from ``resource``) and another process's are 0."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            fields = f.read().split()
        page = os.sysconf("SC_PAGE_SIZE")
        resident, shared = int(fields[1]) * page, int(fields[2]) * page
        return resident, resident - shared
    except (OSError, ValueError, IndexError):
        pass
    if pid != "self":
        return 0, 0  # the process has ended (or there is no /proc): nothing of it to count
    try:
        import psutil

        rss = int(psutil.Process().memory_info().rss)
    except Exception:
        import resource

        rss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return rss, rss


class HostMemorySampler:
    """Peak host memory over a ``with`` block, read every ``interval_s`` on a daemon thread: of this process,
    or with ``children`` the sum over its descendants (a notebook's kernel under papermill; needs ``psutil``).

    ``before``: resident bytes on entry; ``peak_rss`` / ``peak_anon``: the largest resident and anonymous sums
    seen (:func:`process_memory`), the exit included."""

    def __init__(self, interval_s: float = 0.1, children: bool = False) -> None:
        import threading

        self.interval_s, self.children = interval_s, children
        self.before = self.peak_rss = self.peak_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> tuple[int, int]:
        """``(resident, anonymous)`` bytes now."""
        if not self.children:
            return process_memory()
        import psutil

        rss = anon = 0
        for proc in psutil.Process().children(recursive=True):
            r, a = process_memory(proc.pid)
            rss, anon = rss + r, anon + a
        return rss, anon

    def sample(self) -> None:
        """Read now and raise the peaks."""
        rss, anon = self.read()
        self.peak_rss, self.peak_anon = max(self.peak_rss, rss), max(self.peak_anon, anon)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "HostMemorySampler":
        self.before = self.read()[0]
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


#: host RAM a new pinned buffer of offloading must leave available (``PinnedBufferPool``'s ``reserve_bytes``); the
#: planner's pinned-memory budget leaves it out too
HOST_RESERVE_BYTES = 2 * 1024**3


def host_memory() -> HostMemory:
    """Process RSS and the machine's available / total RAM in bytes."""
    info = _meminfo()
    if "MemAvailable" in info:
        available, total = info["MemAvailable"], info.get("MemTotal", 0)
    else:
        try:
            import psutil

            vm = psutil.virtual_memory()
            available, total = int(vm.available), int(vm.total)
        except Exception:
            available = total = 0
    return HostMemory(rss=host_rss(), available=int(available), total=int(total))
