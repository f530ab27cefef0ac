"""CPU probes of what a training step really holds, to check the memory model against.

* :func:`saved_bytes_by_layer` runs one forward under ``torch.autograd.graph.saved_tensors_hooks``
  and sums, per decoder layer, the bytes of the unique storages saved for backward (parameters,
  buffers and storages already seen are not counted again; shared tables such as RoPE's cos/sin
  are charged to the first layer that saves them).
* :class:`LiveBytes` is a ``TorchDispatchMode`` that counts the bytes of every storage created
  while it is active and still alive (a finalizer on each storage), and their peak: the CPU
  stand-in for ``torch.cuda.max_memory_allocated`` over a step.
* :func:`cuda_dropout` makes a CPU dropout save what CUDA's saves (a boolean mask).
* :func:`cuda_like` makes a CPU run take the paths a CUDA run takes: the Triton kernels (under
  ``TRITON_INTERPRET=1``), grouped-query SDPA as CUDA runs it (K/V repeated to every query head with a
  mask, in fp32 or below compute capability 8.0; grouped, ``enable_gqa``, elsewhere), and, when measuring live memory, prompt release of the
  Triton interpreter's launch arguments (its argument copier is a recursive closure, a reference
  cycle that keeps every launch's tensors alive until Python's cycle collector runs; nothing like
  that happens on a GPU).
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections import Counter, defaultdict
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@contextlib.contextmanager
def cuda_like(release_launch_args: bool = False, capability: tuple[int, int] = (9, 0)) -> Iterator[None]:
    """Triton kernels and CUDA's grouped-query attention (of a card of ``capability``: K/V repeated for
    SDPA where CUDA's flash kernel cannot take them grouped, ``notebookkit.memory.grouped_kv``) for a
    CPU probe; ``release_launch_args`` also frees each interpreter launch's arguments right away
    (slower: a cycle collection per launch)."""
    import triton.runtime.interpreter as interpreter

    import notebookkit.models.patching.patch_attention as patch_attention
    from notebookkit.kernels.runtime import use_triton
    from notebookkit.memory.grouped_kv import sdpa_repeats_kv

    repeats_kv = patch_attention.repeats_kv

    def repeats_kv_on_cuda(q, masked):
        return sdpa_repeats_kv(on_cuda=True, masked=masked, capability=capability, dtype_bytes=q.element_size(),
                               head_dim=q.shape[-1])

    launch = interpreter.GridExecutor.__call__

    def launch_and_release(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            gc.collect(1)  # the cycle is young: generations 0-1 are enough, and fast

    patch_attention.repeats_kv = repeats_kv_on_cuda
    if release_launch_args:
        interpreter.GridExecutor.__call__ = launch_and_release
    try:
        with use_triton(True):
            yield
    finally:
        patch_attention.repeats_kv = repeats_kv
        interpreter.GridExecutor.__call__ = launch


@contextlib.contextmanager
def cuda_dropout() -> Iterator[None]:
    """Dropout as on CUDA: ATen's fused ``native_dropout``, which saves a boolean mask for backward (on a CPU
    tensor ``F.dropout`` multiplies by a mask in the input's dtype instead)."""
    dropout = F.dropout

    def native(input, p=0.5, training=True, inplace=False):
        return torch.native_dropout(input, p, training)[0] if training and 0.0 < p < 1.0 else input

    F.dropout = native
    try:
        yield
    finally:
        F.dropout = dropout


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(base.model.layers)


def saved_bytes_by_layer(model: torch.nn.Module, layers: Any = None, **inputs: Any) -> dict[Any, Counter]:
    """``{layer index or "other": Counter(dtype name -> bytes)}`` saved for backward by one forward.

    ``layers``: the modules to charge by index (default: the decoder layers).

    Runs the backward afterwards (the LoRA MLP refuses to leave a graph un-run twice, and it frees
    everything).
    """
    known = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    where: list[Any] = ["other"]
    hooks = []
    for i, layer in enumerate(decoder_layers(model) if layers is None else layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i)))
        hooks.append(layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, "other")))
    out: dict[Any, Counter] = defaultdict(Counter)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in known:
            known.add(ptr)
            out[where[0]][str(t.dtype).replace("torch.", "")] += storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**inputs).loss
    finally:
        for h in hooks:
            h.remove()
    loss.backward()
    return dict(out)


class LiveBytes(TorchDispatchMode):
    """Bytes of CPU storages created while active that are still alive, and their peak.

    Storages alive when the mode is created (weights, optimizer states, inputs) are never counted,
    even when an op returns a view of one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        gc.collect()
        self._external = []  # keeps the pre-existing storages' Python objects (and ids) stable
        self._seen: set[int] = set()
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                try:
                    storage = obj.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                self._external.append(storage)
                self._seen.add(id(storage))

    def _track(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(key)
        n = storage.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)

        def freed(key: int = key, n: int = n) -> None:
            self.live -= n
            self._seen.discard(key)

        weakref.finalize(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._track(t)
        return out
