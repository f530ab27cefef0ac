"""Gradient checkpointing modes: ``False``, ``True`` (recompute), ``"offload"`` and ``"auto"``.

* recompute: each decoder layer keeps only its input; its activations are recomputed in the
  backward pass. A layer's saved activations (many ``[B, T, H]``- and ``[B, T, I]``-sized
  tensors) shrink to its ``[B, T, H]`` input.
* offload: like recompute, but the kept input of every layer but the last is copied to pinned host
  memory on a side CUDA stream while the next layers compute, and copied back (prefetched one layer
  ahead) during the backward pass. Device activation memory is then about one layer's worth.
  On a CPU there is no device memory to save: it degrades to plain recompute, and the banner says so.
* offload_mlp (a per-layer mode of a plan, or the whole model's): offload, and the fused MLP's gate/up
  outputs ``e, g`` (``2 N I`` values a layer) go to pinned host memory too. The backward takes them back
  (prefetched one layer ahead, beside the input) instead of recomputing the gate and up GEMMs: a third of
  a Llama layer's recompute work, for ``2 N I s`` bytes each way over the host link. A layer whose MLP
  output a post-MLP norm reads (Gemma 2/3), or a mixture of experts, offloads without parking. A parked
  layer's forward waits for the copies of the parked layer two before it (on the GPU, so at most one
  layer's ``e, g`` are in flight to the host beside its own; on the host too, below). On a CPU the input stays and ``e, g`` are kept
  as they are. ``"offload_mlp"`` by name parks every offloaded layer; a per-layer plan may park some
  (:func:`notebookkit.memory.planner.park_offloaded_mlps`, the share the host link carries:
  :func:`~notebookkit.memory.planner.parked_mlp_fraction`), and ``"auto"``'s plans do where the host link keeps up.
  Where host RAM runs short for a parked copy, parking stops for the rest of the run with one warning and the
  layers compute ``e, g`` again; the exports and a re-plan give the pinned buffers back (:func:`release_host_buffers`).

  The allocator's reserve: a parked tile is freed while a copy on the side stream (forward) or the backward's
  kernels (backward) may still read it, so the caching allocator holds its block until the GPU has passed that
  point (``record_stream``); a host that queues every layer ahead of the GPU finds no block free and reserves
  fresh ones, about ``2 N I s`` bytes a parked layer. So the host keeps two parked layers behind the GPU: before
  a parked layer's forward it waits for the copies of the parked layer two before it
  (:func:`_pace_parked_copies`), and after a parked layer's backward for the backward of the parked layer two
  above (:func:`_pace_parked_backward`); it still queues a layer while the GPU runs the one before. Measured on the
  H200 (8B NF4, 2 x 4096, every layer parked): 10.4 GiB reserved for a 7.9 GiB allocated peak (22.2 GiB before the
  pacing; plain offload 9.7 GiB). Under a 15 GiB cap (fp16, 4096 x 1) the reserve of a parked plan still reached
  the cap, so the planner fits parked plans with room for two layers' ``e, g`` (then 14.5 GiB reserved for 13.0 allocated).
* auto: asks ``notebookkit.memory.planner`` for the fastest per-layer plan (keep / recompute /
  offload / offload_mlp) that fits in free VRAM; without a GPU it picks no checkpointing (host memory is not the
  constraint, and recomputing costs time). A per-layer list of modes can also be passed directly.

``"unsloth"`` is accepted as an alias of ``"offload"`` so ported notebooks run unchanged.

The backward of an offloaded layer ``y = f(x; θ)``: restore ``x`` on the device, recompute
``y = f(x)`` with grad enabled (same RNG state as the forward), then back-propagate ``dL/dy``,
which accumulates ``dL/dθ`` into the parameters and yields ``dL/dx`` for the layer below.
Recompute and offload share that autograd function (recompute keeps ``x`` on the device).

The recomputed ``y`` is only back-propagated through, never read. Where the MLP output enters the
residual sum directly (``y = h + mlp(norm(h))``: Llama, Mistral, Qwen, Gemma 1; not Gemma 2/3,
whose post-MLP norm reads it), the backward of ``+`` and of the fused MLP need no value of it, so
the recompute names the MLP as one whose output it does not read
(:func:`notebookkit.models.patching.forward_state.resumed`), and the MLP skips its down projection: about a
quarter of the matmul work of a recomputed Llama layer.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from notebookkit import compat
from notebookkit.marks import CHECKPOINTING_GUARD
from notebookkit.memory.estimate import MODES as LAYER_MODES, OFFLOADING
from notebookkit.memory.grouped_kv import sdpa_repeats_kv
from notebookkit.memory.model_setup import (
    auto_plan_size,
    record_activation_plan,
    record_auto_plan_size,
    recorded_activation_plan,
)
from notebookkit.memory.offload import HostMemoryError, PinnedBufferPool

from . import forward_state
from .patch_moe import record_chunk_budgets
from ..common.architectures import lookup
from ..common.decoder_layers import decoder_layers as _decoder_layers

Mode = Union[bool, str]
_MODES = {False: "none", None: "none", "none": "none", True: "recompute", "recompute": "recompute",
          "true": "recompute", "offload": "offload", "unsloth": "offload", "offload_mlp": "offload_mlp",
          "auto": "auto"}


def normalize_mode(value: Mode) -> str:
    """Map user values (``False``, ``True``, ``"offload"``, ``"unsloth"``, ``"auto"``) to a mode name."""
    key = value.lower() if isinstance(value, str) else value
    if key not in _MODES:
        raise ValueError(
            f"use_gradient_checkpointing={value!r} is not one of False, True, 'offload' (alias 'unsloth'), "
            "'offload_mlp' or 'auto'."
        )
    return _MODES[key]


def auto_plan(
    model: nn.Module, seq_len: Optional[int] = None, batch_size: Optional[int] = None, max_memory: Any = None,
    padded: bool = False, images_per_row: Optional[int] = None, layout: str = "front",
) -> tuple[list[str] | str, str]:
    """(per-layer modes or a mode name, why) for ``"auto"``.

    On a GPU, ``notebookkit.memory.planner.plan_activations`` picks keep / recompute / offload per
    layer: the fastest plan predicted to fit in free VRAM, or in ``max_memory`` (``"16GB"``, a card
    name such as ``"t4"``, or bytes) when given, for ``batch_size`` rows (default 1) of ``seq_len``
    tokens (``padded``: with a padding mask; ``images_per_row`` for a vision-language model), its layers in
    ``layout`` (the planner's ``"front"`` or ``"spread"``). Without a GPU it is no checkpointing. A mixture of
    experts' plan counts its NF4 experts decoded in chunks of the budget planned for (a cap's, a named card's or
    this card's, :mod:`notebookkit.expert_chunks`): the kernels then decode with that one.
    """
    device = _model_device(model)
    if device.type != "cuda":
        return "none", "auto on CPU: no checkpointing (host memory is not the limit; recompute costs time)", None
    from notebookkit.memory.planner import DoesNotFitError

    try:
        from notebookkit.memory.planner import plan_activations

        kwargs: dict[str, Any] = {"seq_len": int(seq_len)} if seq_len else {}
        if batch_size:
            kwargs["batch_size"] = int(batch_size)
        if images_per_row is not None:
            kwargs["images_per_row"] = int(images_per_row)
        kwargs["kv_repeated"], kwargs["padded"] = kv_repeated(model, padded), padded
        plan = plan_activations(model, max_memory=max_memory, layout=layout, **kwargs)
        return list(plan.modes), f"auto: {plan.summary()}", plan.estimate.inputs.get("expert_chunk_bytes")
    except DoesNotFitError:
        raise
    except Exception as exc:  # noqa: BLE001 - fall back to the safe choice
        return "recompute", f"auto: memory planner failed ({type(exc).__name__}: {exc}); using recompute", None


def kv_repeated(model: nn.Module, padded: bool) -> bool:
    """Whether this model's attention repeats grouped K/V for SDPA on its device for a batch with
    (``padded``) or without a padding mask: the rule of :mod:`notebookkit.memory.grouped_kv`."""
    device = _model_device(model)
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if device.type != "cuda" or not heads:
        return False
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    dtype_bytes = embeddings.weight.element_size() if embeddings is not None else 2
    return sdpa_repeats_kv(on_cuda=True, masked=padded, capability=torch.cuda.get_device_capability(device),
                           dtype_bytes=dtype_bytes, head_dim=head_dim,
                           grouped=(getattr(text, "num_key_value_heads", None) or heads) < heads)


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


#: the sequence length the planner assumes when the model has no ``max_seq_length`` (estimate's default)
DEFAULT_PLAN_SEQ_LEN = 2048

_side_streams: dict[int, Any] = {}


def _side_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]


# Each checkpointed model's offload state (its pinned buffer pool), weakly keyed by the causal LM so that it goes
# with the model: what release_host_buffers empties.
_offload_states: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def release_host_buffers(model: nn.Module) -> int:
    """Give back the pinned host memory the offloaded layers of ``model`` keep between training steps.

    The pool (:class:`~notebookkit.memory.offload.PinnedBufferPool`) keeps the buffers of every offloaded layer's
    input (``N H s``) and every parked layer's MLP outputs (``2 N I s``: 4.5 GiB for Llama-3.1-8B at 4,096 tokens
    on a T4's plan) for the next step. A notebook host has little RAM (a T4 session about 12.7 GB), and an export
    wants it back: the exports and a re-plan drop the pool's free buffers and hand PyTorch's cached page-locked blocks
    back to the system (:func:`notebookkit.compat.empty_pinned_host_cache`); a later training step allocates them
    again, once. ``for_inference`` (GRPO's generation, every step) and the same plan applied again (TRL turns
    checkpointing off and on around each generation and scoring forward) keep them: allocating pinned memory
    again each step would cost a synchronising driver call a buffer. Returns the bytes dropped.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    pool = _offload_states.get(base, {}).get("pool")
    if not pool:  # none built (no offloaded layer ran, or no CUDA), or False: the pool could not be built
        return 0
    freed = pool.held_bytes - pool.in_use_bytes
    pool.clear()
    compat.empty_pinned_host_cache()
    return freed


def _pool(state: dict):
    pool = state.get("pool")
    if pool is None:
        try:
            pool = PinnedBufferPool()
        except Exception:  # noqa: BLE001 - plain pinned allocations then
            pool = False
        state["pool"] = pool
    # Not `pool or None`: a pool holding no buffers yet has len() 0, so it would never be used.
    return None if pool is False else pool


def _recorded_event(stream) -> torch.cuda.Event:
    """An event recorded on ``stream`` now: it completes once the work queued there so far is done."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


class _HostCopy:
    """One layer input parked in pinned host memory, with the events ordering the copies.

    Nothing here blocks the host, so the CPU keeps queueing kernels ahead of the GPU. All copies
    of a device run in order on its side stream; ``stored`` completes after the copy to the host,
    ``ready`` after the copy back. A pooled buffer goes back to the pool with the event of the last
    copy that used it, and the pool makes the stream of the buffer's next writer wait for that
    event on the GPU (:meth:`PinnedBufferPool.acquire`).
    """

    def __init__(self, x: torch.Tensor, state: dict) -> None:
        self.device = x.device
        self.host: Optional[torch.Tensor] = None
        self.stored: Optional[torch.cuda.Event] = None
        self.back: Optional[torch.Tensor] = None
        self.ready: Optional[torch.cuda.Event] = None
        self.parked: Optional[_ParkedMLP] = None  # the same layer's MLP outputs, prefetched with this input
        self.pool = _pool(state)
        stream = _side_stream(x.device)
        if self.pool is not None:
            self.host = self.pool.acquire(x.shape, x.dtype, stream=stream)
        else:
            self.host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            self.host.copy_(x, non_blocking=True)
            self.stored = _recorded_event(stream)
        x.record_stream(stream)

    def prefetch(self) -> None:
        if self.parked is not None:
            self.parked.prefetch()
        if self.back is not None or self.host is None:
            return
        stream = _side_stream(self.device)
        with torch.cuda.stream(stream):
            self.back = self.host.to(self.device, non_blocking=True)
            self.ready = _recorded_event(stream)

    def fetch(self) -> torch.Tensor:
        self.prefetch()
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.ready)
        self.back.record_stream(current)
        out, self.back = self.back, None
        self._release(self.ready)  # the buffer's next writer waits for the copy back, on the GPU
        return out

    def _release(self, after: Optional[torch.cuda.Event]) -> None:
        """Hand the host buffer back; ``after``: the event of the last copy that used it."""
        host, self.host = self.host, None
        if host is None:
            return
        if self.pool is not None:
            self.pool.release(host, after=after)
        elif after is not None:
            # No pool (it could not be built: rare). This plain pinned tensor is freed here, so
            # this path keeps the old host wait for its copies rather than leaning on how
            # PyTorch's pinned allocator defers reusing freed memory.
            after.synchronize()

    def __del__(self) -> None:  # graph dropped without a backward (e.g. forward under grad, no loss)
        try:
            # The copy back (when prefetched) runs after the copy to the host on the same stream.
            self._release(self.ready if self.ready is not None else self.stored)
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass


class _ParkedMLP:
    """One layer's fused-MLP gate/up outputs between its first forward and its backward
    (``kernels.lora_mlp.ParkedTiles``, module docstring): on CUDA each tile's ``e`` and ``g`` are
    :class:`_HostCopy` s in pinned host memory; on a CPU they are kept as they are."""

    def __init__(self, state: dict, to_host: bool) -> None:
        self.state = state
        self.to_host = to_host
        self.tiles: list = []

    def put(self, e: torch.Tensor, g: torch.Tensor) -> None:
        """Keep a tile's ``e, g``; where host RAM runs short for their pinned copies, parking stops for the rest
        of the run (said once) and the backward computes the tiles not kept again (``take`` returns None)."""
        if not self.to_host:
            self.tiles.append((e, g))
            return
        if self.state.get("parking_stopped"):
            return
        copies: list[_HostCopy] = []
        try:
            for t in (e, g):
                copies.append(_HostCopy(t, self.state))
        except HostMemoryError as err:  # an e copied already goes back to the pool as it is dropped (its __del__)
            self.state["parking_stopped"] = True
            warnings.warn(f"{err} Parking the MLPs' gate/up outputs in host memory stops here: the layers compute them "
                          "again in the backward instead (the same gradients, a little slower).", stacklevel=2)
            return
        self.tiles.append(tuple(copies))

    @property
    def stored(self) -> Optional[torch.cuda.Event]:
        """The event after the last copy to the host (copies run in order on one side stream)."""
        last = self.tiles[-1][1] if self.tiles else None
        return last.stored if isinstance(last, _HostCopy) else None

    def prefetch(self) -> None:
        """Start copying the first tile back (the others follow as the backward takes them)."""
        if self.tiles and isinstance(self.tiles[0][0], _HostCopy):
            for copy in self.tiles[0]:
                copy.prefetch()

    def take(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        if not self.tiles:
            return None
        e, g = self.tiles.pop(0)
        if isinstance(e, _HostCopy):
            e, g = e.fetch(), g.fetch()
            self.prefetch()  # the next tile's copy overlaps this tile's backward
        return e, g


def _pace_parked_copies(state: dict, parked: _ParkedMLP, stream: Any) -> None:
    """Before a parked layer's forward: wait for the copies to the host of the parked layer two before it,
    on the GPU (``stream`` waits: one layer's ``e, g`` at most in flight beside this layer's own, however far
    the host link falls behind) and on the host (the allocator's reserve, module docstring)."""
    recent = state.setdefault("parked", [])  # the last two parked layers' stores, oldest first
    before = recent[0]() if len(recent) == 2 else None
    if before is not None and before.stored is not None:
        stream.wait_event(before.stored)
        before.stored.synchronize()
    recent[:] = recent[-1:] + [weakref.ref(parked)]


def _pace_parked_backward(state: dict, done: torch.cuda.Event) -> None:
    """After a parked layer's backward (``done`` recorded on its stream): the host waits for the backward of
    the parked layer two above, whose tiles' blocks are then free (the allocator's reserve, module docstring)."""
    recent = state.setdefault("parked_backward", [])  # the last two parked layers' ends, oldest first
    if len(recent) == 2:
        recent.pop(0).synchronize()
    recent.append(done)


def mlp_output_only_summed(base: nn.Module) -> bool:
    """Whether each decoder layer's MLP output goes straight into the residual sum (no post-MLP norm)."""
    spec = lookup(getattr(base, "config", None))
    return spec is not None and not spec.sandwich_norm


class _OffloadedLayer(torch.autograd.Function):
    """Run a layer without keeping activations; keep its input on the host (or on the device)."""

    @staticmethod
    def forward(ctx, run: Callable[[torch.Tensor], Any], state: dict, keep_on_device: bool, info: dict,
                unused_in_recompute: Optional[nn.Module], park_mlp: bool, x: torch.Tensor, _anchor: torch.Tensor):
        ctx.run = run
        ctx.forward_pass = forward_state.current()  # the recompute resumes it: this forward's LoRA views
        ctx.unused_in_recompute = unused_in_recompute
        ctx.state = state
        ctx.rng_cpu = torch.get_rng_state()
        ctx.rng_cuda = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        to_host = x.is_cuda and not keep_on_device
        ctx.parked = _ParkedMLP(state, to_host) if park_mlp and (to_host or not x.is_cuda) else None
        if ctx.parked is not None and x.is_cuda:
            _pace_parked_copies(state, ctx.parked, torch.cuda.current_stream(x.device))
        with torch.no_grad(), forward_state.parking(ctx.parked):
            out = run(x)
        hidden = out[0] if isinstance(out, (tuple, list)) else out
        info["rest"] = tuple(out[1:]) if isinstance(out, (tuple, list)) else None
        if not to_host:
            ctx.save_for_backward(x)
            ctx.host = None
        else:
            ctx.host = _HostCopy(x, state)
            ctx.host.parked = ctx.parked
            chain = state.setdefault("chain", [])
            chain[:] = [r for r in chain if r() is not None]  # drop copies of graphs already freed
            chain.append(weakref.ref(ctx.host))
        return hidden

    @staticmethod
    def backward(ctx, grad_hidden: torch.Tensor):
        if ctx.host is None:
            (x,) = ctx.saved_tensors
        else:
            chain = ctx.state.get("chain", [])
            hosts = [r() for r in chain]
            if ctx.host in hosts:
                i = hosts.index(ctx.host)
                if i > 0 and hosts[i - 1] is not None:
                    hosts[i - 1].prefetch()  # overlap the previous layer's copies with this layer's backward
                chain.pop(i)
            if ctx.parked is not None:
                ctx.parked.prefetch()  # (already running when the layer above prefetched it)
            x = ctx.host.fetch()
            ctx.host = None
        # The first layer's input (the frozen embeddings' output) needs no gradient: its q/k/v input gradient is
        # then not computed, as in a kept layer.
        x = x.detach().requires_grad_(ctx.needs_input_grad[6])
        devices = [x.device] if x.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.rng_cpu)
            if ctx.rng_cuda is not None:
                torch.cuda.set_rng_state(ctx.rng_cuda, x.device)
            with torch.enable_grad(), forward_state.resumed(ctx.forward_pass, ctx.unused_in_recompute), \
                    forward_state.parking(ctx.parked):
                out = ctx.run(x)
        parked, ctx.parked = ctx.parked, None  # the MLP's backward below holds it until it has taken every tile
        hidden = out[0] if isinstance(out, (tuple, list)) else out
        if hidden.requires_grad:  # else nothing in the layer trains and its input needs no gradient
            torch.autograd.backward(hidden, grad_hidden)
        if parked is not None and x.is_cuda:  # its tiles' blocks are free once this layer's backward has run
            _pace_parked_backward(ctx.state, _recorded_event(torch.cuda.current_stream(x.device)))
        return None, None, None, None, None, None, x.grad, None


def offload_checkpoint(
    function: Callable[..., Any],
    *args: Any,
    keep_on_device: bool = False,
    state: Optional[dict] = None,
    unused_in_recompute: Optional[nn.Module] = None,
    park_mlp: bool = False,
    **kwargs: Any,
):
    """Checkpoint function for one decoder layer; its input (first positional arg) goes to pinned
    host memory unless ``keep_on_device``. ``unused_in_recompute``: a module whose output the
    backward's recompute of the layer does not read (:func:`forward_state.unread_output`);
    ``park_mlp``: its fused MLP's gate/up outputs go to the host too (``"offload_mlp"``, module docstring)."""
    x, rest = args[0], args[1:]
    run = functools.partial(_call_first, function, rest, kwargs)
    anchor = torch.empty(0, requires_grad=True)
    info: dict = {}
    hidden = _OffloadedLayer.apply(run, state if state is not None else {}, keep_on_device, info, unused_in_recompute,
                                   park_mlp, x, anchor)
    # Decoder layers of recent transformers return a tensor; older ones a tuple (hidden, ...).
    return hidden if info.get("rest") is None else (hidden, *info["rest"])


def _call_first(function, rest, kwargs, x):
    return function(x, *rest, **kwargs)


def checkpoint_in_pass(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """torch's non-reentrant checkpoint of one layer (a mixture of experts' recompute), whose recompute re-enters
    the forward pass of the layer's first forward (:func:`forward_state.resumed`), as :func:`offload_checkpoint`'s
    does: it reuses what the pass shares (LoRA casts, the boolean attention masks) instead of making its own."""
    forward = forward_state.current()

    def run(*a: Any, **k: Any) -> Any:
        with forward_state.resumed(forward):
            return function(*a, **k)

    return checkpoint(run, *args, use_reentrant=False, **kwargs)


def _is_checkpointing(base: nn.Module) -> bool:
    return compat.is_checkpointing(base)


def apply_checkpointing(
    model: nn.Module,
    value: Mode,
    banner=None,
    seq_len: Optional[int] = None,
    batch_size: Optional[int] = None,
    max_memory: Any = None,
    padded: Optional[bool] = None,
    images_per_row: Optional[int] = None,
) -> str:
    """Configure gradient checkpointing on ``model`` (PEFT-wrapped or not); returns the mode applied.

    ``value`` is ``False``/``True``/``"offload"``/``"unsloth"``/``"offload_mlp"``/``"auto"``, or a per-layer
    list of ``"keep"``/``"recompute"``/``"offload"``/``"offload_mlp"`` (as ``notebookkit.memory`` plans it). ``seq_len`` and
    ``batch_size`` size the ``"auto"`` plan (default: the model's ``max_seq_length``, batch 1), with
    padded rows when ``padded`` (default: when the batch has more than one row: collators pad) and
    ``images_per_row`` images (a vision-language model; default 1); ``max_memory`` caps it (default:
    free VRAM). Calling it again re-plans in place.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = _decoder_layers(base)
    why = ""
    if isinstance(value, (list, tuple)):
        modes = [str(m) for m in value]
    else:
        mode = normalize_mode(value)
        if mode == "auto":
            seq_len = seq_len or getattr(base, "max_seq_length", None)
            padded = (batch_size or 1) > 1 if padded is None else padded
            planned, why, chunk_budget = auto_plan(base, seq_len, batch_size, max_memory, padded, images_per_row)
            modes = planned if isinstance(planned, list) else [{"none": "keep"}.get(planned, planned)] * len(layers)
            record_auto_plan_size(base, (seq_len or DEFAULT_PLAN_SEQ_LEN) * (batch_size or 1), max_memory, padded,
                                  (batch_size or 1) * (1 if images_per_row is None else images_per_row))
            record_chunk_budgets(base, layers, chunk_budget)  # the experts decode in the chunks the plan counted
        else:
            modes = [{"none": "keep"}.get(mode, mode)] * len(layers)
            record_auto_plan_size(base, None)
            record_chunk_budgets(base, layers, None)  # a mode chosen by hand: the card's own chunks
    if len(modes) != len(layers):
        raise ValueError(f"activation plan has {len(modes)} entries but the model has {len(layers)} decoder layers.")
    bad = set(modes) - set(LAYER_MODES)
    if bad:
        raise ValueError(f"unknown activation modes {sorted(bad)}; use one of {', '.join(map(repr, LAYER_MODES))}.")
    skip_mlp_output = mlp_output_only_summed(base)
    if "offload_mlp" in modes and not skip_mlp_output:
        modes = ["offload" if m == "offload_mlp" else m for m in modes]
        why = ("a post-MLP norm reads each MLP's output, so the recompute computes gate/up anyway: "
               "offload_mlp offloads the layer inputs only")
    if "offload" in modes and _model_device(base).type != "cuda":
        modes = ["recompute" if m == "offload" else m for m in modes]
        why = "offload needs a CUDA device; on CPU it is plain recompute"
    if "offload_mlp" in modes and _model_device(base).type != "cuda":
        why = "on CPU the layer inputs and the MLPs' gate/up outputs stay in memory (no copies)"
    # A mixture of experts: the routers' logits leave each layer through Hugging Face's output hooks (the
    # load-balancing loss), so a layer's first forward must keep its graph: torch's non-reentrant checkpoint
    # does, notebookkit's offload_checkpoint (which runs it under no_grad) would drop the aux loss's gradient.
    spec = lookup(getattr(base, "config", None))
    moe = spec is not None and spec.moe is not None
    if moe and any(m in OFFLOADING for m in modes):
        modes = ["recompute" if m in OFFLOADING else m for m in modes]
        why = ("a mixture of experts recomputes with torch's checkpoint (the routers' logits keep their gradient "
               "for the load-balancing loss); offloading its layers is not written yet (#36)")

    # The same plan again (TRL's gradient_checkpointing_disable/enable around each generation and scoring forward,
    # trl.models.utils, re-applied by the guard below) keeps its offload state and pinned buffers; a new plan gives
    # them back. Freeing them there cost GRPO's training half 18 cudaHostAlloc + 16 cudaFreeHost a step (0.52 s of
    # its 0.77 s at 1B on an H100, session 43).
    same_plan = recorded_activation_plan(base) == modes and base in _offload_states
    if not same_plan:
        release_host_buffers(base)
    if all(m == "keep" for m in modes) or not layers:
        if _is_checkpointing(base):
            compat.checkpointing_switches(base)[0]()
        record_activation_plan(base, None)
        _guard_trainer_override(base)  # TRL's default gradient_checkpointing=True must not turn it back on
        if banner is not None:
            banner.feature("checkpointing", False, why or "use_gradient_checkpointing=False")
        return "none"

    compat.enable_gradient_checkpointing(base, functools.partial(checkpoint, use_reentrant=False))
    state: dict = _offload_states[base] if same_plan else {}
    _offload_states[base] = state
    last_offload = max((i for i, m in enumerate(modes) if m in OFFLOADING), default=-1)
    for i, (layer, m) in enumerate(zip(layers, modes)):
        layer.gradient_checkpointing = m != "keep"
        if m == "keep":
            continue
        if moe:
            compat.set_layer_checkpoint_function(layer, checkpoint_in_pass)
            continue
        # Recompute keeps the input on the device; so does the last offloaded layer (its input is
        # needed first in the backward pass).
        keep = m == "recompute" or i == len(layers) - 1 or (i == last_offload and all(x in OFFLOADING for x in modes))
        compat.set_layer_checkpoint_function(layer, functools.partial(
            offload_checkpoint, keep_on_device=keep, state=state,
            unused_in_recompute=getattr(layer, "mlp", None) if skip_mlp_output else None,
            park_mlp=m == "offload_mlp",
        ))
    mode = "offload_mlp" if "offload_mlp" in modes else "offload" if "offload" in modes else "recompute"
    record_activation_plan(base, modes)
    _guard_trainer_override(base)
    if getattr(base.config, "use_cache", False):
        base.config.use_cache = False
    if banner is not None:
        counts = plan_counts(modes)
        text = {
            "recompute": "recompute: layer inputs kept, activations recomputed in backward",
            "offload": "offload: layer inputs in pinned host memory via a side CUDA stream",
            "offload_mlp": "offload: layer inputs and the MLPs' gate/up outputs in pinned host memory via a side "
                           "CUDA stream (their GEMMs not recomputed)",
        }[mode]
        banner.feature("checkpointing", True, f"{text} [{counts}]" + (f" ({why})" if why else ""))
    return mode


def plan_counts(modes: list[str]) -> str:
    """``"27 keep, 1 recompute"``: how many layers run each mode."""
    return ", ".join(f"{modes.count(k)} {k}" for k in LAYER_MODES if modes.count(k))


def _guard_trainer_override(base: nn.Module) -> None:
    """Keep notebookkit's checkpointing mode when a trainer calls ``gradient_checkpointing_enable``.

    ``transformers.Trainer`` (and TRL, whose configs default to ``gradient_checkpointing=True``)
    re-enable checkpointing with their own function at the start of training, which would silently
    replace offloading by plain recompute, or recompute every layer that the plan keeps (on a CPU,
    "auto" keeps all of them: recomputing only costs time there). The instance methods below
    re-apply our mode instead; ``FastLanguageModel.for_training(model, True)`` changes it.
    """
    if CHECKPOINTING_GUARD in base.__dict__:
        return
    object.__setattr__(base, CHECKPOINTING_GUARD, True)
    # a closure over `base` kept in its own __dict__ would be a cycle
    from notebookkit.base_layers.rebinding import WeakBoundMethod

    for name in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
        if hasattr(base, name):
            object.__setattr__(base, name, WeakBoundMethod(_reapply_checkpointing, base))


def _reapply_checkpointing(base: nn.Module, *args: Any, **kwargs: Any) -> None:
    """``gradient_checkpointing_enable`` of a model notebookkit configured: re-apply its own mode."""
    size = auto_plan_size(base)
    apply_checkpointing(base, recorded_activation_plan(base) or "none")
    if size is not None:  # still the "auto" plan: a larger batch re-plans (fit_plan_to_batch)
        record_auto_plan_size(base, *size)


def fit_plan_to_batch(causal_lm: nn.Module, rows: int, seq_len: int, attention_mask: Any = None,
                      images: int = 0, explicit_mask: bool = False) -> None:
    """Re-plan an ``"auto"`` activation plan when a training batch needs more than it was sized for.

    ``get_peft_model`` plans for ``planning_batch_size`` rows (default 1) of ``max_seq_length`` tokens (one
    image per row for a vision-language model); a trainer then runs its own batch (GRPO: prompts x
    generations rows of prompt + completion; a vision notebook: several images). The first training
    forward of a batch with more tokens, more ``images``, or padding where the plan assumed none (a
    padding mask makes SDPA save K/V repeated to every query head on CUDA, :mod:`notebookkit.memory.grouped_kv`)
    plans again under the same cap, before any layer runs, and says so when the per-layer modes change.
    Grow-only: the new plan covers the larger of the old and the new batch. A plan chosen by hand
    (``True``, ``"offload"``, a per-layer list) is never changed. ``explicit_mask``: the decoder gets a
    mask whatever ``attention_mask`` holds (Gemma 3's image tokens attend both ways).
    """
    size = auto_plan_size(causal_lm)
    if size is None:
        return
    # the padding check reads the mask on the host: only until a padded batch has been planned for
    padded = size.padded or explicit_mask or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
                                              and not bool(attention_mask.all()))
    if rows * seq_len <= size.tokens and padded == size.padded and images <= size.images:
        return
    seq = max(seq_len, -(-size.tokens // rows))
    per_row = -(-max(images, size.images) // rows)
    before = recorded_activation_plan(causal_lm)
    apply_checkpointing(causal_lm, "auto", seq_len=seq, batch_size=rows, max_memory=size.max_memory, padded=padded,
                        images_per_row=per_row)
    after = recorded_activation_plan(causal_lm)
    if after != before:
        counts = plan_counts(after) if isinstance(after, list) else "no checkpointing"
        what = f"{rows} x {seq} tokens" + (", padded" if padded else "") + (f", {images} images" if images else "")
        print(f"notebookkit: activation plan re-made for training batches of {what} (it was sized for "
              f"{size.tokens} tokens" + (f" and {size.images} images" if images else "") + f"): {counts}")
