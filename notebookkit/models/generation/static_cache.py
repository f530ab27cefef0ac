"""The static KV cache of generation: one pre-allocated key and value buffer per decoder layer.

For a model with ``n_layers`` layers, ``Hkv`` key/value heads of size ``D`` and a cache of
``capacity`` slots for ``batch`` rows, layer ``i`` owns::

    keys[i], values[i]   [batch, Hkv, capacity, D]   (zeros at allocation)

Slot ``t`` of a row holds the key and value of the token at column ``t`` of the left-padded batch
(:func:`~notebookkit.models.generation.cached_forward.cached_forward` writes slot ``t`` at step ``t``).
Nothing is ever reallocated while the cache lives: a prompt of ``P`` tokens plus ``N`` new ones uses
slots ``0 .. P + N - 1`` of the first rows, so a captured CUDA graph keeps reading and writing the
same memory (:mod:`.graph_runner`), and a later, smaller request reuses the same buffers.

Bytes: ``2 * n_layers * batch * Hkv * capacity * D * itemsize`` (:func:`kv_cache_bytes`).

The decode step (one token a row, the slot a device tensor) writes with :meth:`StaticKVCache.write_rotated`:
the keys' RoPE and both writes in one kernel (:mod:`notebookkit.kernels.rope_cache_write`); the prompt
rotates with :func:`~notebookkit.kernels.rope.apply_rope` and writes with :meth:`StaticKVCache.write`.

The buffers start as zeros rather than ``torch.empty``: slots no query may see are still read by the
attention (masked to probability 0), and ``0 * NaN`` from uninitialised memory would be ``NaN``.
"""

from __future__ import annotations

from typing import Union

import torch

from notebookkit.base_layers.kernel_ops import require

__all__ = ["StaticKVCache", "kv_cache_bytes"]


def kv_cache_bytes(n_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype) -> int:
    """Bytes of a :class:`StaticKVCache` of that shape: keys and values of every layer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * n_layers * batch * kv_heads * capacity * head_dim * itemsize


class StaticKVCache:
    """Pre-allocated keys and values ``[batch, kv_heads, capacity, head_dim]`` for ``n_layers`` layers.

    Args:
        n_layers: number of decoder layers.
        batch: rows the cache holds (a request may use fewer: the first rows).
        kv_heads: key/value heads per layer.
        head_dim: size of one head.
        capacity: slots per row (prompt plus new tokens must fit).
        dtype, device: of the model's hidden states.
    """

    def __init__(self, n_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: Union[str, torch.device]) -> None:
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.batch, self.kv_heads, self.capacity, self.head_dim = batch, kv_heads, capacity, head_dim
        self.dtype, self.device = dtype, torch.device(device)

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        """Bytes held by the keys and values of every layer (0 once released)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def fits(self, batch: int, length: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a request of ``batch`` rows and ``length`` slots can use this cache as it is."""
        return (self.n_layers > 0 and batch <= self.batch and length <= self.capacity and dtype == self.dtype
                and torch.device(device) == self.device)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, start_slot: Union[int, torch.Tensor]) -> None:
        """Store ``key``/``value`` ``[B, kv_heads, T, head_dim]`` of ``layer`` at slots ``start_slot ..
        start_slot + T - 1`` of the first ``B`` rows.

        ``start_slot`` is a Python int (prefill) or a one-element device tensor (the captured decode
        step, where the slot lives on the device and advances inside the graph; then ``T == 1``).
        """
        batch, _, length, _ = key.shape
        keys, values = self.keys[layer][:batch], self.values[layer][:batch]
        if isinstance(start_slot, torch.Tensor):
            slots = start_slot.reshape(1) if length == 1 else start_slot.reshape(1) + torch.arange(
                length, device=start_slot.device)
            keys.index_copy_(2, slots, key)
            values.index_copy_(2, slots, value)
        else:
            keys[:, :, start_slot:start_slot + length].copy_(key)
            values[:, :, start_slot:start_slot + length].copy_(value)

    def write_rotated(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """The decode step's RoPE and cache write of ``layer`` in one kernel; returns the rotated ``query``.

        ``query`` ``[B, Hq, 1, D]``, ``key``/``value`` ``[B, kv_heads, 1, D]`` (keys not yet rotated), ``cos``/
        ``sin`` ``[B, 1, D]`` (the step's table rows), ``slot`` a one-element device tensor: the rotated keys and
        the values land in slot ``slot`` of the first ``B`` rows
        (:func:`notebookkit.kernels.rope_cache_write.rope_cache_write`, read on the device: graph-safe).
        """
        rope_cache_write = require("rope_cache_write", "rope_cache_write")
        return rope_cache_write(query, key, value, cos, sin, self.keys[layer], self.values[layer], slot)

    def read(self, layer: int, batch: int, kv_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the keys and values of ``layer``: the first ``batch`` rows, slots ``0 .. kv_length - 1``."""
        return self.keys[layer][:batch, :, :kv_length], self.values[layer][:batch, :, :kv_length]

    def release(self) -> None:
        """Drop the buffers (the memory returns to PyTorch's allocator once nothing else holds them)."""
        self.keys, self.values = [], []
        self.batch = self.capacity = 0

    def __repr__(self) -> str:
        return (f"StaticKVCache({self.n_layers} layers, batch {self.batch}, {self.kv_heads} kv heads x {self.head_dim}, "
                f"{self.capacity} slots, {self.dtype}, {self.device}, {self.nbytes / 2**20:.1f} MiB)")
