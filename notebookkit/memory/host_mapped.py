"""A CUDA tensor whose storage is page-locked host memory: the GPU reads it in place, over the bus.

With unified virtual addressing (every 64-bit Linux and Windows CUDA build), memory allocated by
``cudaHostAlloc`` (what ``tensor.pin_memory()`` does) has one address that is valid on the host and
in every kernel. :func:`host_mapped_cuda_tensor` hands that address to PyTorch as a CUDA tensor
(through the ``__cuda_array_interface__`` protocol, which PyTorch accepts for any memory CUDA
registered). The result is a ``device="cuda"`` tensor to every caller — ``F.embedding``, CUDA
graphs, ``model.device`` — but it takes nothing from the GPU's memory: ``torch.cuda.memory_allocated``
does not count it, and each read crosses the host link (PCIe), so it suits a table that kernels
*gather* a few rows from (an input embedding), never one they stream whole (a weight in a GEMM).

The view holds a reference to the host tensor, so the pages live as long as the view does.
"""

from __future__ import annotations

import torch

__all__ = ["host_mapped_cuda_tensor", "is_host_mapped"]

#: integer stand-ins for element sizes the array-interface protocol has no float type for (bf16)
_SAME_SIZE_INT = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}


class _PinnedPages:
    """What ``torch.as_tensor`` reads the device address from; keeps the host tensor alive."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        size = host.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": _SAME_SIZE_INT[size],
            "data": (host.data_ptr(), False),
            "strides": tuple(s * size for s in host.stride()),
            "version": 3,
        }


def host_mapped_cuda_tensor(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A ``device`` view of the pinned CPU tensor ``host`` (same shape, dtype and values; no copy).

    Raises:
        ValueError: ``host`` is not a pinned CPU tensor, or ``device`` is not a CUDA device.
        RuntimeError: this CUDA setup cannot address host memory from the GPU (PyTorch's message).
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"host_mapped_cuda_tensor: {device} is not a CUDA device.")
    if host.device.type != "cpu" or not host.is_pinned():
        raise ValueError("host_mapped_cuda_tensor: the host tensor must be pinned CPU memory (tensor.pin_memory()).")
    if host.element_size() not in _SAME_SIZE_INT:
        raise ValueError(f"host_mapped_cuda_tensor: {host.dtype} has no same-size integer to map it through.")
    with torch.cuda.device(device):
        raw = torch.as_tensor(_PinnedPages(host), device=device)
    view = raw.view(host.dtype)  # same element size: a reinterpretation, no copy
    if view.data_ptr() != host.data_ptr():
        raise RuntimeError("host_mapped_cuda_tensor: PyTorch copied the host memory instead of mapping it.")
    return view


def is_host_mapped(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is a CUDA tensor outside every segment of PyTorch's caching allocator
    (as a host-mapped view is). Walks the allocator's snapshot: for checks and tests, not hot paths."""
    if tensor.device.type != "cuda":
        return False
    ptr = tensor.untyped_storage().data_ptr()
    for segment in torch.cuda.memory_snapshot():
        if segment["address"] <= ptr < segment["address"] + segment["total_size"]:
            return False
    return True
