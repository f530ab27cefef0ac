"""Activation planner: per decoder layer, keep / recompute / offload, fastest plan that fits.

Each decoder layer's saved activations can be

- ``keep``: stored on the GPU (no extra work),
- ``recompute``: only the layer input is stored; backward reruns the layer's forward first,
- ``offload``: the layer input goes to pinned host memory during the forward and comes back
  before that layer's backward, which then recomputes as above.

Memory per layer: ``keep > recompute > offload = 0`` (see :mod:`notebookkit.memory.estimate`);
extra time per layer: ``0 < recompute < offload``. With ``t_f`` the forward time of one layer,
``b = N * H * s`` the bytes of its input and ``B`` the host link bandwidth:

    recompute  = t_f - t_down
    offload    = recompute + max(0, b/B - 0.7 * t_f) + max(0, b/B - 0.7 * 3 * t_f) + 50 us

(the copy out overlaps the next layer's forward, the copy back the backward of later layers).
``t_f = N * (2 * P_layer + 2 * P_lora_layer + 2 * T * dq) / rate`` with the card's matmul rate;
``t_down = N * 2 * H * I / rate`` is the down projection, which the recompute skips unless a
post-MLP norm (Gemma 2/3) reads the MLP output (``t_down = 0`` there).

Parked MLP outputs (``offload_mlp``): an offloaded layer may also leave its MLP's gate/up outputs in pinned
host memory, which saves the recompute's gate and up GEMMs (``t_gu = 4 N H I / rate``) for ``2 N I s``
more bytes over the host link; :func:`parked_mlp_fraction` says what share of the offloaded layers the
link carries behind the forward (all of them on a T4, about two thirds on an H200), and a plan with that
share parked (as many as the pinned host memory holds, spread evenly) is weighed beside the plain one,
for the largest ``m`` that fits and for everything offloaded (a parked offload can cost less than a
recompute). ``"auto"`` weighs them (``park_mlps=True``, the default). Its estimate counts the prefetched
tile of ``e, g`` on the GPU, and its fit leaves room for two layers' ``e, g`` beside the allocated peak: freed
blocks whose copies to the host may still be running, which the caching allocator cannot hand out yet (under a
15 GiB cap the parked plans' reserve reached the cap, 1.4-1.6 GiB over their allocated peak, the plain plan's
0.9 GiB; with the room, 14.5 GiB reserved for 13.0 allocated).

All layers of a model have the same shape, so a plan is fixed by how many layers keep (k) and
recompute (m); the rest offload. For a vision-language model, any checkpointed decoder layer also
checkpoints the vision blocks (Hugging Face's flag reaches them), which adds the tower's forward
once: ``patches * 2 * P_vision_linear / rate``. For every k (from L down) the largest m that fits is found; the
plan with the least extra time wins, ties going to more kept layers. Layouts (``layout=``):

- ``"front"`` (the default): offloaded layers first (their copies back have the most backward work to hide
  behind), then recomputed, then kept layers;
- ``"spread"``: where at least two layers are kept, the offloaded ones spread evenly among the others up to
  the last two kept layers (:func:`spread_offloaded`). Each one's copies to the host then ride behind the
  forwards of the layers up to the next offloaded one, not only behind its own, so the link carries more
  parked layers (the H200 at 4096 tokens under a 15 GiB cap: all 16 offloaded layers of the plan instead of 9
  one after the other, 14.8 ms of extra work predicted instead of 26.0, about 3% of the step); the two kept
  layers at the end outlast the last copies. Not yet measured on a GPU, so not the default
  (``benchmarks/run.py``'s ``notebookkit-spread`` row).
A mixture of experts is planned without offloading (its layers recompute instead); its ``P_layer`` counts
the ``k`` experts a token runs, and its recompute reruns the whole layer.

The budget is free VRAM by default (``torch.cuda.mem_get_info`` plus what this process's
allocator already holds, compared against the predicted allocator peak; at most the allocator's cap
when ``torch.cuda.set_per_process_memory_fraction`` set one), or a user cap:
``max_memory="16GB"``, ``"15 GiB"``, a card name (``"t4"``, ``"a100-40gb"``), or bytes; a cap or
card is the whole card, so the CUDA context counts against it. A safety margin
(``DEFAULT_SAFETY_MARGIN``, 8%) is left for allocator fragmentation: the estimate predicts
``torch.cuda.max_memory_allocated``, and the caching allocator reserves more than that (on the
8B NF4 benchmark row, 35.4 GiB reserved for a 33.3 GiB allocated peak: 6.4% more). With
``margin_of="step"`` the margin is that fraction of what the step adds to the frozen base weights,
``margin * (budget - base_weights)``: the base is allocated once at load and never freed, so the
fragmentation comes from the step's own allocations (on that 8B row, 2.1 GiB of excess for about 28 GiB
beyond the base: 7.5%, inside the margin). It matters where the base fills most of the card (a 70B
at 2-bit on 24 GiB: a margin of 1.9 GiB of the whole card, 0.17 GiB of the step); it is a prediction
until a GPU run measures it. Offloading also needs pinned host memory, checked against available RAM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from notebookkit.base_formats import BASE_FORMATS
from notebookkit.expert_chunks import decode_chunk_bytes, process_card_bytes
from notebookkit.training_methods import TRAINING_METHODS

from .base_weights import base_format_for, load_flags
from .cards import GPUCard, detect_card, parse_card, parse_memory
from .estimate import (LAYERS_AFTER_COPIES, MODES, OFFLOADING, MemoryEstimate, bytes_of_dtype,
                       estimate_training_memory, lora_param_count, lora_targets, parked_mlp_bytes, readable_bytes)
from .meters import HOST_RESERVE_BYTES
from .moe import expert_lora_param_count, expert_lora_ranks
from .shapes import KNOWN_MODELS, ModelShape, model_shape

GiB = 1024**3
DEFAULT_SAFETY_MARGIN = 0.08  # allocator fragmentation: reserved exceeds the allocated peak by ~6%


class DoesNotFitError(ValueError):
    """The training step does not fit in the memory budget even with every layer offloaded."""

    def __init__(self, message: str, estimate: MemoryEstimate | None = None, budget_bytes: int | None = None):
        super().__init__(message)
        self.estimate = estimate
        self.budget_bytes = budget_bytes


@dataclass
class ActivationPlan:
    """Per-layer activation modes and what they cost.

    ``modes[i]`` is ``"keep"``, ``"recompute"``, ``"offload"`` or (parked where the host link keeps up)
    ``"offload_mlp"`` for decoder layer ``i``.
    ``estimate`` is the memory estimate of this plan; ``budget_bytes`` what it had to fit in;
    ``host_bytes`` the pinned host memory the offloaded layers need; ``step_overhead`` the
    predicted extra step time as a fraction of a step with every layer kept.
    """

    modes: tuple[str, ...]
    budget_bytes: int
    budget_source: str
    estimate: MemoryEstimate
    host_bytes: int = 0
    step_overhead: float = 0.0
    extra_seconds: float = 0.0
    card: GPUCard | None = None
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.modes)

    def __iter__(self):
        return iter(self.modes)

    def __getitem__(self, i: int) -> str:
        return self.modes[i]

    def counts(self) -> dict[str, int]:
        return {m: self.modes.count(m) for m in MODES}

    @property
    def mode(self) -> str:
        """One word for the whole plan: ``"none"`` (all kept), ``"recompute"`` (no offloading) or
        ``"offload"`` (some layers offloaded). Per-layer modes are in :attr:`modes`."""
        c = self.counts()
        if c["offload"] or c["offload_mlp"]:
            return "offload"
        return "recompute" if c["recompute"] else "none"

    def layers(self, mode: str) -> list[int]:
        """Indices of the layers in ``mode``."""
        return [i for i, m in enumerate(self.modes) if m == mode]

    def summary(self) -> str:
        c = self.counts()
        parts = ", ".join(f"{v} {k}" for k, v in c.items() if v)
        used = self.estimate.peak_allocated if "free VRAM" in self.budget_source else self.estimate.total
        text = (
            f"{parts} of {len(self.modes)} layers; predicted peak {readable_bytes(used)} of "
            f"{readable_bytes(self.budget_bytes)} ({self.budget_source})"
        )
        if self.step_overhead:
            text += f"; about {100 * self.step_overhead:.0f}% slower than keeping everything"
        if self.host_bytes:
            text += f"; {readable_bytes(self.host_bytes)} pinned host memory"
        return text

    def __str__(self) -> str:
        return "ActivationPlan: " + self.summary()

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))


def _resolve_budget(
    budget_bytes: int | None, max_memory: Any, card: Any
) -> tuple[int, bool, str, GPUCard | None]:
    """(bytes, compare against total incl. CUDA context?, description, card for the cost model)."""
    card_obj: GPUCard | None = None
    if isinstance(card, GPUCard):
        card_obj = card
    elif card is not None and card != "auto":
        card_obj = parse_card(str(card))
    if budget_bytes is not None:
        return int(budget_bytes), True, f"budget {readable_bytes(budget_bytes)}", card_obj or detect_card()
    if max_memory is not None:
        if isinstance(max_memory, str):
            try:
                c = parse_card(max_memory)
                return c.memory_bytes, True, c.name, card_obj or c
            except ValueError:
                pass
        b = parse_memory(max_memory)
        return b, True, f"max_memory={max_memory!r}", card_obj or detect_card()
    if card_obj is not None:
        return card_obj.memory_bytes, True, card_obj.name, card_obj
    try:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            held = torch.cuda.memory_reserved()
            detected = detect_card()
            name = detected.name if detected else "GPU"
            capped = _per_process_cap(torch, total)
            if capped is not None and capped < free + held:
                return capped, False, f"this process's cap of {capped / 2**30:.2f} GiB on {name} " \
                                      "(torch.cuda.set_per_process_memory_fraction)", detected
            return int(free + held), False, f"free VRAM on {name}", detected
    except Exception:
        pass
    from .meters import host_memory

    return int(host_memory().available), False, "free host RAM (no GPU)", None


def _per_process_cap(torch: Any, total: int) -> int | None:
    """Bytes this process's caching allocator may reserve when a memory fraction below 1 is set, else None.

    ``torch.cuda.set_per_process_memory_fraction`` caps the allocator (an emulated smaller card, or a
    GPU shared between processes); ``mem_get_info`` does not see it. Older torch has no getter: None.
    """
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None:
        return None
    fraction = float(getter())
    return int(fraction * total) if fraction < 1.0 else None


def _expert_chunk_bytes(planned_for: int | None) -> int:
    """The NF4 experts' decode chunk budget of a plan (:func:`~notebookkit.expert_chunks.decode_chunk_bytes`):
    of ``planned_for``, the bytes of a cap, a named card or a budget the caller gave, else of this process's share
    of its GPU (the kernels' own rule when no plan recorded one), else the least."""
    if planned_for is not None:
        return decode_chunk_bytes(planned_for)
    try:
        import torch

        on_gpu = torch.cuda.is_available()
    except ImportError:
        on_gpu = False
    return decode_chunk_bytes(process_card_bytes("cuda") if on_gpu else None)


def _card_rates(kw: dict[str, Any], card: GPUCard | None) -> tuple[float, float]:
    """``(matmul FLOP/s, host link bytes/s)`` of ``card`` for this setup: a quantised base runs at 0.8 of the
    card's rate (dequantisation before (NF4) or inside (2-bit, ternary) each matmul)."""
    rate = (card.tflops if card else 1.0) * 1e12 * (0.8 if _quantised(kw) else 1.0)
    return rate, (card.pcie_gbps if card else 10.0) * 1e9


def _layer_costs(shape: ModelShape, kw: dict[str, Any], card: GPUCard | None) -> tuple[float, float, float]:
    """(forward seconds of one layer, extra seconds to recompute it, extra seconds to offload it)."""
    N = kw.get("batch_size", 1) * kw.get("seq_len", 2048)
    T = kw.get("seq_len", 2048)
    r = kw.get("lora_r", 16)
    s = bytes_of_dtype(kw.get("dtype", "bfloat16"))
    lora_layer = lora_param_count(shape, r, kw.get("target_modules"), kw.get("target_parameters")) / shape.num_layers
    if shape.num_experts:  # a token runs k of the E experts (and their adapters)
        ranks = expert_lora_ranks(shape, r, lora_targets(kw.get("target_modules")), kw.get("target_parameters"))
        experts = expert_lora_param_count(shape, ranks)
        lora_layer -= experts / shape.num_layers * (1 - shape.experts_per_token / shape.num_experts)
    flops = N * (2 * shape.active_linear_params_per_layer + 2 * lora_layer + 2 * T * shape.q_dim)
    rate, bw = _card_rates(kw, card)
    t_f = flops / rate
    copy = N * shape.hidden_size * s / bw
    # The recompute skips the down projection where nothing reads the MLP output (no post-MLP norm); a
    # mixture of experts reruns its whole layer (torch's checkpoint).
    recompute = t_f if shape.sandwich_norms or shape.num_experts else t_f - N * 2 * shape.hidden_size * shape.intermediate_size / rate
    offload = recompute + max(0.0, copy - 0.7 * t_f) + max(0.0, copy - 0.7 * 3 * t_f) + 50e-6
    return t_f, recompute, offload


def parked_mlp_fraction(shape: ModelShape, kw: dict[str, Any], card: GPUCard | None,
                        spacing: float = 1.0) -> tuple[float, float]:
    """``(f, seconds)``: the share of offloaded layers that should also park their MLP's gate/up outputs in
    host memory (``"offload_mlp"``), and the recompute seconds each one saves.

    A parked layer's copy to the host, ``c_mlp = 2 N I s / B``, rides the side stream with the layer inputs
    (``c_in = N H s / B``) behind the forward; it saves the gate and up GEMMs of the recompute,
    ``t_gu = 4 N H I / rate``. A parked layer's forward waits for the copies of the parked layer two before it
    (checkpointing's host pacing), so with the offloaded layers ``spacing`` layers apart (1: one after the other;
    ``(L - 2) / offloaded`` spread among kept layers, :func:`spread_offloaded`) and the parked ones spread evenly
    over them, the copies keep up while ``c_in + f c_mlp <= spacing * t_f``: ``f = (spacing t_f - c_in) / c_mlp``
    within ``[0, 1]``. Past that the forward would wait on the link ``c_mlp`` for each more parked layer to save
    its ``t_gu``, a loss wherever ``f < 1`` (``t_f`` is about ``1.5 t_gu`` or more, so ``f < 1`` means
    ``c_mlp > t_gu``). 0 where no layer defers its MLP (a post-MLP norm reads its output, LoRA dropout, a mixture
    of experts). On a T4 every offloaded layer parks; on an H200 about two thirds of a run of offloaded layers,
    and all of them spread one in two layers.
    """
    from .estimate import mlp_deferred

    if not mlp_deferred(shape, kw.get("lora_dropout", 0.0)) or not shape.intermediate_size:
        return 0.0, 0.0
    N = kw.get("batch_size", 1) * kw.get("seq_len", 2048)
    s = bytes_of_dtype(kw.get("dtype", "bfloat16"))
    t_f, _, _ = _layer_costs(shape, kw, card)
    rate, bw = _card_rates(kw, card)
    c_in, c_mlp = N * shape.hidden_size * s / bw, 2 * N * shape.intermediate_size * s / bw
    f = min(1.0, max(0.0, (spacing * t_f - c_in) / c_mlp))
    return f, 4 * N * shape.hidden_size * shape.intermediate_size / rate


def park_offloaded_mlps(modes: Sequence[str], fraction: float, most: int | None = None) -> tuple[str, ...]:
    """``modes`` with ``fraction`` of its offloaded layers (at most ``most``) turned into ``"offload_mlp"``,
    spread evenly over them so that no run of parked copies outpaces the forward; the last layer, whose
    input stays on the GPU, never parks."""
    last = len(modes) - 1
    offloaded = [i for i, m in enumerate(modes) if m == "offload" and i != last]
    count = min(int(fraction * len(offloaded) + 1e-9), len(offloaded) if most is None else max(0, most))
    out = list(modes)
    for j, i in enumerate(offloaded):
        if (j + 1) * count // len(offloaded) > j * count // len(offloaded):
            out[i] = "offload_mlp"
    return tuple(out)


#: kept layers a spread plan leaves at its end: their forwards cover the last offloaded layer's copies to the host
SPREAD_TAIL = LAYERS_AFTER_COPIES


def spread_offloaded(modes: Sequence[str]) -> tuple[str, ...]:
    """``modes`` with its offloaded layers spread evenly among the others, the last ``SPREAD_TAIL`` kept.

    Offloaded first (``_modes``), the copies to the host of a run of offloaded layers have only their own
    forwards to hide behind; spread, each has the forwards of the layers up to the next offloaded one
    (``g = span / offloaded`` layers). The order of the other layers (recompute before keep) is kept. A plan
    with fewer than ``SPREAD_TAIL`` kept layers, or nothing offloaded, is returned as it is."""
    L = len(modes)
    offloaded = [m for m in modes if m in OFFLOADING]
    others = [m for m in modes if m not in OFFLOADING]
    if not offloaded or others.count("keep") < SPREAD_TAIL:
        return tuple(modes)
    span = L - SPREAD_TAIL
    n = len(offloaded)
    at = {(2 * i * span + n) // (2 * n) for i in range(n)}  # round(i * span / n): the first at layer 0
    out, o, r = [], iter(offloaded), iter(others)
    for i in range(L):
        out.append(next(o) if i in at else next(r))
    return tuple(out)


def _vision_recompute_seconds(shape: Any, kw: dict[str, Any], card: GPUCard | None) -> float:
    """Extra seconds when the plan checkpoints anything: Hugging Face's checkpointing then reaches the
    vision blocks too (with adapters there), and their forward runs again in backward:
    ``patches * 2 * P_vision_linear / rate``. 0 for a text model or a frozen tower."""
    from .vision_shapes import VLMShape

    if not isinstance(shape, VLMShape) or not kw.get("finetune_vision_layers", True):
        return 0.0
    method = TRAINING_METHODS.get(kw.get("method", "sft"))  # an unknown one: the estimate says so
    rows = kw.get("batch_size", 1) * (method.rows_per_example if method is not None else 1)
    size = kw.get("image_size") if kw.get("image_size") is not None else (shape.default_image_size or 448)
    patches = rows * kw.get("images_per_row", 1) * shape.image_grid(size)[0]
    return patches * 2 * shape.vision.linear_params / _card_rates(kw, card)[0]


def _quantised(kw: dict[str, Any]) -> bool:
    """Whether the estimate's keywords ask for a quantised base (any ``load_in_*`` flag of the record)."""
    return any(kw.get(flag) for flag in load_flags())


#: how a plan orders its layers (module docstring)
LAYOUTS = ("front", "spread")


def _modes(L: int, keep: int, recompute: int, layout: str = "front") -> tuple[str, ...]:
    """``keep`` kept, ``recompute`` recomputed and the other layers offloaded, in ``layout``: offloaded first, or
    spread among the others where at least ``SPREAD_TAIL`` layers are kept (:func:`spread_offloaded`)."""
    off = L - keep - recompute
    front = ("offload",) * off + ("recompute",) * recompute + ("keep",) * keep
    return spread_offloaded(front) if layout == "spread" else front


def offload_spacing(modes: Sequence[str]) -> float:
    """Layers per offloaded layer over the span they are spread on (:func:`spread_offloaded`): the forwards that
    each one's copies to the host ride behind. 1 for offloaded layers one after the other."""
    at = [i for i, m in enumerate(modes) if m in OFFLOADING]
    spread = len(at) > 1 and at[-1] - at[0] >= len(at)  # not one run of layers
    return (len(modes) - SPREAD_TAIL) / len(at) if spread else 1.0


def plan_activations(
    model_config: Any,
    max_memory: Any = None,
    *,
    budget_bytes: int | None = None,
    card: Any = None,
    host_memory_bytes: int | None = None,
    safety_margin: float | None = None,
    allow_offload: bool | None = None,
    margin_of: str = "budget",
    park_mlps: bool = True,
    layout: str = "front",
    explain: bool = True,
    **estimate_kwargs: Any,
) -> ActivationPlan:
    """Choose keep / recompute / offload per decoder layer: the fastest plan within the budget.

    Args:
        model_config: anything :func:`estimate_training_memory` accepts (config, dict, name, folder),
            or a loaded (PEFT) model: its 4-bit setting, dtype and LoRA config are then read from it.
        max_memory: a cap such as ``"16GB"``, ``"15 GiB"``, a card name (``"t4"``, ``"l4"``,
            ``"a100-40gb"``, ``"h100"``) or bytes. Default: the free VRAM of this GPU.
        budget_bytes: the cap in bytes (same as an int ``max_memory``).
        card: the card for the speed model (and the budget when no cap is given); default: detected.
        host_memory_bytes: pinned host memory offloading may use; default 80% of the available RAM above the
            2 GiB the offload pool leaves free (:data:`~notebookkit.memory.meters.HOST_RESERVE_BYTES`).
        safety_margin: fraction of the budget left free for allocator fragmentation
            (default ``DEFAULT_SAFETY_MARGIN``).
        allow_offload: default True on a GPU or a named card, False when planning for the CPU; always False
            for a mixture of experts (its layers recompute instead: offloading them is not written yet).
        margin_of: ``"budget"`` (the margin is a fraction of the whole budget) or ``"step"`` (of the budget
            less the frozen base weights, which are allocated once: module docstring).
        park_mlps: also weigh plans whose offloaded layers park their MLPs' gate/up outputs (``"offload_mlp"``,
            module docstring). On by default, so ``"auto"`` parks where the host link keeps up; False plans
            without (the caching allocator's reserve, 22.2 GiB for a 7.9 GiB allocated peak on the H200 before
            the host kept two parked layers behind the GPU, measured 10.4 GiB against plain offload's 9.7 after).
        layout: ``"front"`` (offloaded layers first) or ``"spread"`` (among the kept ones), module docstring.
        explain: False raises :class:`DoesNotFitError` without working out what to change (searches that
            probe many settings: :func:`~notebookkit.memory.largest_lora_rank`, :func:`~notebookkit.memory.longest_sequence`).
        **estimate_kwargs: ``load_in_4bit``, ``dtype``, ``lora_r``, ``target_modules``, ``optimizer``,
            ``batch_size``, ``seq_len``, ``fused_loss``, ... as for :func:`estimate_training_memory`.

    Returns:
        :class:`ActivationPlan`; ``plan.modes`` is a tuple of per-layer modes and ``plan.estimate``
        its memory estimate. Raises :class:`DoesNotFitError` saying what to change when even
        offloading every layer does not fit.
    """
    estimate_kwargs.pop("activation_plan", None)
    chunk_given = estimate_kwargs.get("expert_chunk_bytes")
    workspace_given = "cublas_workspace_bytes" in estimate_kwargs
    if hasattr(model_config, "parameters") and hasattr(model_config, "config"):  # a loaded model
        from .estimate import estimate_kwargs_from_model

        estimate_kwargs = {**estimate_kwargs_from_model(model_config), **estimate_kwargs}
    from .vision_shapes import is_vlm, text_shape, vlm_shape

    shape: Any = vlm_shape(model_config) if is_vlm(model_config) else model_shape(model_config)
    text = text_shape(shape)  # the decoder layers are what the plan is for
    budget, with_context, source, card_obj = _resolve_budget(budget_bytes, max_memory, card)
    if card_obj is not None and not workspace_given:  # the card planned for, whichever card the model is on
        estimate_kwargs["cublas_workspace_bytes"] = card_obj.cublas_workspace_bytes
    if allow_offload is None:
        allow_offload = card_obj is not None or "no GPU" not in source
    if text.num_experts:  # a mixture of experts recomputes what would be offloaded (checkpointing's rule)
        allow_offload = False
        given = budget_bytes is not None or max_memory is not None or card not in (None, "auto")
        estimate_kwargs["expert_chunk_bytes"] = chunk_given or _expert_chunk_bytes(budget if given else None)
    if safety_margin is None:
        safety_margin = DEFAULT_SAFETY_MARGIN
    if margin_of not in ("budget", "step"):
        raise ValueError(f"notebookkit.memory: margin_of={margin_of!r}; use 'budget' or 'step'.")
    if layout not in LAYOUTS:
        raise ValueError(f"notebookkit.memory: layout={layout!r}; use one of {', '.join(map(repr, LAYOUTS))}.")
    L = text.num_layers

    def usable_for(est: MemoryEstimate) -> int:
        """What a step may fill: the budget less the margin (on the budget, or on what the step adds to the base)."""
        if margin_of == "step":
            return int(budget - safety_margin * max(0, budget - est.base_weights))
        return int(budget * (1.0 - safety_margin))
    if host_memory_bytes is None:
        from .meters import host_memory

        host_memory_bytes = int(0.8 * max(0, host_memory().available - HOST_RESERVE_BYTES))

    def used(est: MemoryEstimate) -> int:
        return est.total if with_context else est.peak_allocated

    def fits(est: MemoryEstimate) -> bool:
        return used(est) <= usable_for(est)

    t_f, c_rec, c_off = _layer_costs(text, estimate_kwargs, card_obj)
    c_vision = _vision_recompute_seconds(shape, estimate_kwargs, card_obj)
    step = 3 * L * t_f + 3 * c_vision

    def est_for(k: int, m: int) -> MemoryEstimate:
        return estimate_training_memory(shape, activation_plan=_modes(L, k, m, layout), **estimate_kwargs)

    saved = parked_mlp_fraction(text, estimate_kwargs, card_obj)[1] if allow_offload and park_mlps else 0.0
    parks = saved > 0  # the layers defer their MLPs: a parked one saves its gate/up GEMMs
    parked_host = parked_mlp_bytes(text, estimate_kwargs.get("batch_size", 1) * estimate_kwargs.get("seq_len", 2048),
                                   bytes_of_dtype(estimate_kwargs.get("dtype", "bfloat16")))[0] if parks else 0

    def plan_cost(k: int, m: int) -> float:
        return m * c_rec + (L - k - m) * c_off + (c_vision if k < L else 0.0)

    def parked_variant(k: int, m: int, unparked: MemoryEstimate) -> tuple[float, tuple[str, ...], MemoryEstimate] | None:
        """The plan ``(k, m)`` (estimated as ``unparked``) with the host link's share of its offloaded layers
        parking their MLPs (as many as the pinned host memory left over holds), if it fits."""
        if not parks or L - k - m <= 1:
            return None
        laid_out = _modes(L, k, m, layout)
        share = parked_mlp_fraction(text, estimate_kwargs, card_obj, offload_spacing(laid_out))[0]
        modes = park_offloaded_mlps(laid_out, share,
                                    most=max(0, host_memory_bytes - unparked.host_offload) // max(parked_host, 1))
        if "offload_mlp" not in modes:
            return None
        est = estimate_training_memory(shape, activation_plan=modes, **estimate_kwargs)
        # The blocks of the two parked layers whose copies to the host may still run (the host pacing's depth):
        # freed, but the caching allocator cannot hand them out until the side stream passes them.
        if used(est) + 2 * parked_host > usable_for(est) or est.host_offload > host_memory_bytes:
            return None
        return plan_cost(k, m) - modes.count("offload_mlp") * saved, modes, est

    best: tuple[float, tuple[str, ...], MemoryEstimate] | None = None
    host_blocked: MemoryEstimate | None = None
    for k in range(L, -1, -1):
        lowest_m = 0 if allow_offload else L - k
        # For a given k the memory grows with m, except that m = L - k (nothing offloaded) has no input in
        # flight: when neither end fits, no m does, and the scan of this k is skipped.
        if lowest_m < L - k - 1 and not fits(est_for(k, lowest_m)) and not fits(est_for(k, L - k)):
            continue
        for m in range(L - k, lowest_m - 1, -1):
            est = est_for(k, m)
            if not fits(est):
                continue
            if est.host_offload > host_memory_bytes:
                host_blocked = host_blocked or est
                break
            candidates = [(plan_cost(k, m), _modes(L, k, m, layout), est), parked_variant(k, m, est)]
            if parks and m > lowest_m:  # a parked offload can cost less than a recompute: all offloaded
                candidates.append(parked_variant(k, lowest_m, est_for(k, lowest_m)))
            for candidate in candidates:
                if candidate is not None and (best is None or candidate[0] < best[0] - 1e-12):
                    best = candidate
            break
        if best is not None and best[0] == 0.0:
            break
    if best is None:
        worst = est_for(0, 0 if allow_offload else L)
        message = _explain(shape, worst, usable_for, budget, source, with_context, estimate_kwargs, allow_offload,
                           host_blocked, host_memory_bytes) if explain else f"{shape.name} does not fit {readable_bytes(budget)}"
        raise DoesNotFitError(message, estimate=worst, budget_bytes=budget)
    cost, modes, est = best
    plan = ActivationPlan(
        modes=modes, budget_bytes=budget, budget_source=source, estimate=est,
        host_bytes=est.host_offload, step_overhead=cost / step if step else 0.0, extra_seconds=cost,
        card=card_obj,
    )
    return plan


def _explain(
    shape: Any, worst: MemoryEstimate, usable_for: Any, budget: int, source: str, with_context: bool,
    kw: dict[str, Any], allow_offload: bool, host_blocked: MemoryEstimate | None, host_bytes: int,
) -> str:
    """The does-not-fit message: what the step needs and the changes that would fit (each checked with the
    estimate). ``shape`` is a :class:`ModelShape` or a vision-language :class:`VLMShape`, whose decoder
    (``text_shape``) has the layer numbers and whose smaller alternatives are vision-language models too."""
    from .vision_shapes import KNOWN_VLMS, text_shape

    decoder = text_shape(shape)
    vlm = decoder is not shape
    need = worst.total if with_context else worst.peak_allocated
    mode = "every layer offloaded" if allow_offload else "every layer recomputed"
    lines = [
        f"notebookkit: {shape.name} does not fit in {readable_bytes(budget)} ({source}) even with {mode}: "
        f"the step needs about {readable_bytes(need)} (usable after a {readable_bytes(budget - usable_for(worst))} margin for "
        f"fragmentation: {readable_bytes(usable_for(worst))}).",
        "  " + ", ".join(f"{k} {readable_bytes(v)}" for k, v in worst.parts().items()),
    ]
    if decoder.num_experts:
        experts = sum(v for k, v in worst.details.items() if k.startswith("base weights: experts"))
        nf4 = any(k.startswith("base weights: experts (NF4)") for k in worst.details)
        held = ("in NF4 (load_in_4bit)" if nf4 else
                "in the compute dtype (load_in_4bit=True would hold them in NF4, about a quarter)")
        lines.append(f"  Its {decoder.num_experts} experts a layer take {readable_bytes(experts)} {held}, "
                     "and its layers recompute rather than offload.")
    if host_blocked is not None:
        lines.append(
            f"  A plan that offloads would fit on the GPU but needs {readable_bytes(host_blocked.host_offload)} of pinned host "
            f"memory and only {readable_bytes(host_bytes)} is available: free host RAM or lower batch_size / seq_len."
        )
    fixes: list[str] = []
    plan = "offload" if allow_offload else "recompute"


    def fits(**change: Any) -> MemoryEstimate | None:
        args = dict(kw, **change)
        try:
            e = estimate_training_memory(shape, activation_plan=plan, **args)
        except ValueError:
            return None
        return e if (e.total if with_context else e.peak_allocated) <= usable_for(e) else None

    single: list[tuple[str, dict[str, Any]]] = []
    fmt = base_format_for(**{f: bool(kw.get(f)) for f in load_flags()})
    off = {f: False for f in load_flags()}
    width = decoder.hidden_size  # bytes per weight of a typical projection, to order the formats
    smaller_formats = [f for f in BASE_FORMATS.values()
                       if f.quantised and f.bytes_per_weight(width) < fmt.bytes_per_weight(width, 2)
                       and (not vlm or f.load_flag == "load_in_4bit")]  # FastVisionModel: 16-bit and NF4 bases
    if smaller_formats:  # one step down: the format of fewer bytes per weight nearest to this one
        down = max(smaller_formats, key=lambda f: f.bytes_per_weight(width))
        single.append((f"{down.load_flag}=True ({down.label} base)", dict(off, **{down.load_flag: True})))
    if not kw.get("offload_embedding") and not decoder.tie_word_embeddings:
        single.append(("offload_embedding=True (input embedding in host RAM)", {"offload_embedding": True}))
    if kw.get("batch_size", 1) > 1:
        single.append(("batch_size=1 with more gradient_accumulation_steps", {"batch_size": 1}))
    if "8bit" not in str(kw.get("optimizer", "adamw")):
        single.append(("optimizer='adamw_8bit'", {"optimizer": "adamw_8bit"}))
    for text, change in single:
        e = fits(**change)
        if e:
            fixes.append(f"{text} (about {readable_bytes(e.total if with_context else e.peak_allocated)})")
    # the largest smaller LoRA rank that fits (memory grows with the rank), with the embedding on the host if need be
    rank = int(kw.get("lora_r", 16))
    with_host = [({}, "")]
    if not kw.get("offload_embedding") and not decoder.tie_word_embeddings:
        with_host.append(({"offload_embedding": True}, "offload_embedding=True with "))
    for extra, prefix in with_host:
        if rank <= 1 or not fits(**extra, lora_r=1):
            continue
        good, bad = 1, rank
        while bad - good > 1:
            middle = (good + bad) // 2
            good, bad = (middle, bad) if fits(**extra, lora_r=middle) else (good, middle)
        e = fits(**extra, lora_r=good)
        fixes.append(f"{prefix}LoRA rank r={good} (about {readable_bytes(e.total if with_context else e.peak_allocated)})")
        break
    # the shortest sequence that fits once every cheap change above is made
    combo: dict[str, Any] = {}
    for _, change in single:
        combo.update(change)
    seq = kw.get("seq_len", 2048)
    lo, hi = 0, seq if not fixes else 0
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if fits(**dict(combo, seq_len=mid)):
            lo = mid
        else:
            hi = mid
    if 64 <= lo < seq:
        how = ", ".join(f"{k}={v!r}" for k, v in combo.items() if v or k not in off)  # format flags that turn on
        fixes.append(f"max_seq_length <= {lo // 32 * 32}" + (f" together with {how}" if how else ""))
    smaller = []
    seen: set[tuple] = set()
    for name, other in (KNOWN_VLMS if vlm else KNOWN_MODELS).items():
        key = (other.num_params, other.model_type)
        if key in seen:
            continue
        seen.add(key)
        if other.num_params < shape.num_params:
            try:
                smaller_base = kw if fmt.quantised else dict(kw, load_in_4bit=True)
                e = estimate_training_memory(other, activation_plan=plan, **smaller_base)
            except ValueError:
                continue
            if (e.total if with_context else e.peak_allocated) <= usable_for(e):
                smaller.append((other.num_params, name))
    if smaller:
        smaller.sort(reverse=True)
        fixes.append("a smaller model, e.g. " + ", ".join(n for _, n in smaller[:3])
                     + f" ({fmt.label if fmt.quantised else 'in 4-bit'})")
    else:
        fixes.append("a smaller model")
    if "no GPU" not in source and with_context:
        fixes.append("a card with more memory")
    lines.append("What to change: " + "; or ".join(fixes) + ".")
    return "\n".join(lines)
