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
    """Resident memory of this process in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


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
