"""Model panel: which model, the format of its frozen weights, sequence length, dtype, card, and the live
VRAM estimate.

The estimate beside the controls is :func:`notebookkit.memory.estimate_training_memory` for the
current choices, broken into base weights, adapters + optimizer, activations, logits/loss and the
rest, with a fits / does-not-fit verdict for the detected GPU or a chosen card. It follows a
linked LoRA panel (rank, targets, checkpointing mode) and training panel (batch size, optimizer)
as they change: see :func:`link_estimate` and :class:`notebookkit.widgets.ConfigPanels`.

The weight formats offered are the rows of :mod:`notebookkit.base_formats` (16-bit, NF4, 2-bit,
ternary), each chosen by its ``from_pretrained`` flag. When the choice does not fit a GPU card, the
panel asks :func:`notebookkit.memory.largest_lora_rank` what each quantised format can train there
(the largest LoRA rank, whether the input embedding must live in host RAM, the activation plan) or
why it cannot: for a 70B on a 24 GiB card, 2-bit fits at a small rank with the embedding on the host
and NF4 does not. Plans here leave the planner's margin on the step's own bytes (``margin_of="step"``).

:func:`card_verdicts` gives the same verdict as text for one run on several cards (a T4, a 24 GB card) whatever
GPU this machine has: what the chat SFT notebook prints for its GPU run.
"""

from __future__ import annotations

import functools
import html
from dataclasses import dataclass
from typing import Any

import ipywidgets as W

from notebookkit.base_formats import BASE_FORMATS
from notebookkit.expert_chunks import decode_chunk_bytes
from notebookkit.memory.base_weights import base_format_for, load_flags
from notebookkit.memory.cards import GPUCard
from notebookkit.memory.context import longest_sequence
from notebookkit.memory.estimate import MemoryEstimate, estimate_training_memory
from notebookkit.memory.planner import DEFAULT_SAFETY_MARGIN, ActivationPlan, DoesNotFitError, plan_activations
from notebookkit.memory.rank_fit import RankFit, largest_lora_rank
from notebookkit.memory.vision_shapes import text_shape

from ._base import Panel, header, styled
from .cards import card_for, card_options
from .catalog import CATALOG, family_of, model_names, resolve_shape

GiB = 1024**3
MARGIN_OF = "step"  # the planner's fragmentation margin on the step's bytes (notebookkit.memory.planner)
#: the dtype choices; "auto" (the loader picks for the machine) stands for ``dtype=None``: a Dropdown whose value is
#: None shows no selection at all, so the widget holds the string and ``.value`` gives None back
DTYPES: list[tuple[str, Any]] = [("auto", "auto"), ("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float32")]
PART_COLOURS = {
    "base weights": "#4e79a7",
    "adapters + optimizer": "#f28e2b",
    "activations": "#59a14f",
    "logits / loss": "#e15759",
    "generation": "#b07aa1",
    "other": "#9c9c9c",
}


def _default_model() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return "meta-llama/Llama-3.2-1B-Instruct"
    except Exception:
        pass
    return "notebookkit/tiny-llama"


@dataclass
class ModelChoice:
    """Model settings, named as ``FastLanguageModel.from_pretrained`` takes them (plus the card)."""

    model_name: str = ""
    load_in_4bit: bool | None = None  # None: 4-bit unless load_in_2bit / load_in_ternary asks for another format
    max_seq_length: int = 2048
    dtype: str | None = None
    card: str = "auto"
    offload_embedding: bool = False
    load_in_2bit: bool = False
    load_in_ternary: bool = False

    def __post_init__(self) -> None:
        if not self.model_name:
            self.model_name = _default_model()
        if self.load_in_4bit is None:
            self.load_in_4bit = not any(getattr(self, f) for f in load_flags() if f != "load_in_4bit")
        self.base_format  # refuses two formats at once, with the message of the memory model

    @property
    def base_format(self) -> str:
        """The name of the format the flags ask for (:data:`notebookkit.base_formats.BASE_FORMATS`)."""
        return base_format_for(**self.format_flags()).name

    def format_flags(self) -> dict[str, bool]:
        """``from_pretrained``'s base-format flags, one per quantised format of the record."""
        return {f: bool(getattr(self, f)) for f in load_flags()}

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        kwargs = dict(model_name=self.model_name, max_seq_length=self.max_seq_length, dtype=self.dtype,
                      load_in_4bit=self.load_in_4bit)
        kwargs.update({f: True for f, on in self.format_flags().items() if on and f != "load_in_4bit"})
        if self.offload_embedding:
            kwargs["offload_embedding"] = True
        return kwargs


@dataclass
class EstimateResult:
    """What the panel shows: the estimate, the plan (for 'auto'), the budget and the verdict."""

    estimate: MemoryEstimate | None
    plan: ActivationPlan | None
    budget_bytes: int
    budget_label: str
    fits: bool
    message: str = ""
    what: str = "VRAM"  # "VRAM" for a GPU card, "memory" for a CPU run
    longest_seq: int | None = None  # GPU card, checkpointing "auto": the longest max_seq_length that fits
    formats: tuple[RankFit, ...] = ()  # the choice does not fit a GPU card: what each quantised format can train


@functools.lru_cache(maxsize=64)
def _longest_seq(shape: Any, card: GPUCard, limit: int, settings: tuple) -> int:
    """The planner's longest trainable sequence for these settings (cached: the sequence-length
    slider changes nothing here, so moving it stays instant)."""
    found = longest_sequence(shape, budget_bytes=card.memory_bytes, card=card, step=256, max_seq=limit,
                             margin_of=MARGIN_OF, **dict(settings))
    return found.seq_len


def compute_estimate(model: ModelChoice, lora: Any = None, training: Any = None) -> EstimateResult:
    """Run the memory model (and the planner for checkpointing 'auto') for panel choices.

    ``lora`` / ``training`` are :class:`LoRAChoice` / :class:`TrainingChoice` (or None for defaults).
    """
    card: GPUCard | None = card_for(model.card)
    if card is not None:
        budget, label = card.memory_bytes, card.name
    else:
        from notebookkit.memory.meters import host_memory

        hm = host_memory()
        budget, label = hm.available, f"free host RAM, CPU run ({hm.total / GiB:.0f} GiB total)"
    what = "VRAM" if card is not None else "memory"
    dtype = model.dtype or ("float32" if card is None else ("bfloat16" if card.bf16 else "float16"))
    r = getattr(lora, "r", 16)
    targets = list(getattr(lora, "target_modules", None) or []) if lora is not None else None
    mode = getattr(lora, "activation_mode", "auto") if lora is not None else "auto"
    batch = getattr(training, "per_device_train_batch_size", 2) if training is not None else 2
    optim = getattr(training, "optim", "adamw_8bit") if training is not None else "adamw_8bit"
    if str(optim) not in ("sgd", "adafactor") and "8bit" not in str(optim):
        optim = "adamw"
    kw = dict(
        **model.format_flags(), dtype=dtype, lora_r=int(r), target_modules=targets,
        optimizer=str(optim), batch_size=int(batch), seq_len=int(model.max_seq_length),
        lora_dropout=float(getattr(lora, "lora_dropout", 0.0) or 0.0),
        fp8_forward=bool(getattr(lora, "fp8_base_matmul", False)),
        method=str(getattr(training, "method", "sft") or "sft"),
        offload_embedding=bool(model.offload_embedding) and card is not None,
        cuda_context_bytes=400 * 2**20 if card is not None else 0,
        cublas_workspace_bytes=card.cublas_workspace_bytes if card is not None else 0,
        expert_chunk_bytes=decode_chunk_bytes(card.memory_bytes if card is not None else None),
    )
    try:
        shape = resolve_shape(model.model_name)
    except Exception as exc:
        return EstimateResult(None, None, budget, label, False, f"Cannot estimate {model.model_name!r}: {exc}", what)
    with_context = card is not None
    try:
        if mode == "auto":
            plan = plan_activations(shape, budget_bytes=budget, card=card, allow_offload=card is not None,
                                    margin_of=MARGIN_OF, **kw)
            est = plan.estimate
        else:
            plan = None
            est = estimate_training_memory(shape, activation_plan=mode, **kw)
    except DoesNotFitError as exc:
        formats = _format_fits(shape, card, _settings(kw)) if card is not None else ()
        return EstimateResult(exc.estimate, None, budget, label, False, str(exc).split("\n", 1)[-1], what,
                              formats=formats)
    except ValueError as exc:
        return EstimateResult(None, None, budget, label, False, str(exc), what)
    used = est.total if with_context else est.peak_allocated
    longest = None
    if mode == "auto" and card is not None:
        settings = tuple((k, v) for k, v in _settings(kw) if k != "seq_len")
        try:
            longest = _longest_seq(shape, card, text_shape(shape).max_position_embeddings or 131072, settings)
        except (ValueError, TypeError):  # a shape the planner cannot bisect: leave the line out
            longest = None
    fits = used <= budget
    formats = _format_fits(shape, card, _settings(kw)) if card is not None and not fits else ()
    return EstimateResult(est, plan, budget, label, fits, "", what, longest, formats)


def _settings(kw: dict[str, Any]) -> tuple:
    """The estimate's keywords as a hashable key (for the caches)."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kw.items()))


@functools.lru_cache(maxsize=32)
def _format_fits(shape: Any, card: GPUCard, settings: tuple) -> tuple[RankFit, ...]:
    """For each quantised format of the record: the largest LoRA rank (and plan) the card trains with these
    settings, or why none does (:func:`notebookkit.memory.largest_lora_rank`; the embedding goes to host RAM
    when that is what it takes)."""
    kw = dict(settings)
    for flag in load_flags():
        kw.pop(flag, None)
    for dropped in ("lora_r", "seq_len", "batch_size", "offload_embedding"):
        kw.pop(dropped, None)
    seq, batch = dict(settings).get("seq_len", 2048), dict(settings).get("batch_size", 1)
    fits = []
    for fmt in BASE_FORMATS.values():
        if not fmt.quantised:
            continue
        try:
            fits.append(largest_lora_rank(shape, budget_bytes=card.memory_bytes, card=card, seq_len=seq,
                                          batch_size=batch, max_rank=256, **{fmt.load_flag: True}, **kw))
        except ValueError:  # a setting the planner refuses for this format: leave its line out
            continue
    return tuple(fits)


def _format_line(fit: RankFit) -> str:
    """One line of the per-format block: what fits, with the plan, or why not."""
    label = fit.base_format.label
    if not fit.fits:
        leanest = "every layer offloaded" if fit.smallest and "offload" in fit.smallest.plan else "every layer recomputed"
        need = f" (about {_size(fit.smallest.total)} at r=1, {leanest})" if fit.smallest else ""
        return f"{label}: does not fit at any LoRA rank{need}"
    plan = fit.plan
    counts = ", ".join(f"{v} {k}" for k, v in plan.counts().items() if v)
    host = "input embedding in host RAM (offload_embedding=True)" if fit.offload_embedding else "embedding on the card"
    return (f"{label}: fits with LoRA r≤{fit.rank} (fp32 adapters + {plan.estimate.inputs.get('optimizer')}), {host}, "
            f"activations {counts}, max_seq_length {fit.seq_len:,}: predicted {_size(plan.estimate.total)}")


def _size(nbytes: float) -> str:
    if nbytes >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def estimate_html(res: EstimateResult) -> str:
    """The estimate as HTML: headline with verdict, stacked bar, per-part table."""
    est = res.estimate
    if est is None:
        return (f"<div class='nbk-vram'><b>Estimated peak {res.what}: unknown</b><br>"
                f"<span class='nbk-vram-verdict nbk-unknown' style='color:#a00'>{html.escape(res.message)}</span></div>")
    parts = est.parts()
    other = parts.pop("temporaries")
    parts["other"] = other
    total = est.total
    verdict = "fits" if res.fits else "does not fit"
    colour = "#2e7d32" if res.fits else "#c62828"
    scale = max(total, res.budget_bytes)
    bar = "".join(
        f"<div title='{k}: {_size(v)}' style='display:inline-block;height:14px;"
        f"width:{100 * v / scale:.2f}%;background:{PART_COLOURS[k]}'></div>"
        for k, v in parts.items() if v > 0
    )
    budget_mark = f"{100 * res.budget_bytes / scale:.2f}%"
    rows = "".join(
        f"<tr><td><span style='display:inline-block;width:10px;height:10px;background:{PART_COLOURS[k]}'></span> "
        f"{k}</td><td style='text-align:right;padding-left:12px'>{_size(v)}</td></tr>"
        for k, v in parts.items()
    )
    c = est.plan_counts()
    plan_text = ", ".join(f"{v} {k}" for k, v in c.items() if v)
    if res.plan is not None:
        plan_text = f"auto plan: {plan_text}"
        if res.plan.step_overhead > 0.005:
            plan_text += f" (~{100 * res.plan.step_overhead:.0f}% slower than keeping all)"
    else:
        plan_text = f"activations: {plan_text}"
    extra = ""
    if res.message:
        extra = f"<div style='color:#a15c00;max-width:520px;margin-top:4px'>{html.escape(res.message)}</div>"
    if est.host_offload:
        extra += (f"<div style='color:#555'>pinned host memory (offloaded layer inputs, a host-side embedding): "
                  f"{_size(est.host_offload)}</div>")
    if res.formats:
        lines = "".join(f"<li class='nbk-format-fit'>{html.escape(_format_line(f))}</li>" for f in res.formats)
        extra += (f"<div class='nbk-vram-formats' style='color:#333;max-width:560px;margin-top:4px'>"
                  f"On {html.escape(res.budget_label)}, by weight format:<ul style='margin:2px 0'>{lines}</ul></div>")
    if res.longest_seq:
        extra += (f"<div class='nbk-vram-longest' style='color:#555'>longest max_seq_length that trains on this card "
                  f"with these settings: {res.longest_seq:,} tokens</div>")
    lora_params = est.inputs.get("lora_params", 0) + est.inputs.get("vision_lora_params", 0)
    params = est.inputs.get("model_params") or (est.shape.num_params if est.shape else 0)  # a VLM: both towers
    return (
        "<div class='nbk-vram' style='min-width:340px;max-width:560px'>"
        f"<div class='nbk-vram-headline'><b>Estimated peak {res.what}: {_size(total)}</b> of "
        f"{_size(res.budget_bytes)} ({html.escape(res.budget_label)}) — "
        f"<span class='nbk-vram-verdict {'nbk-fits' if res.fits else 'nbk-does-not-fit'}' "
        f"style='color:{colour};font-weight:600'>{verdict}</span></div>"
        f"<div style='position:relative;background:#eee;margin:6px 0;white-space:nowrap;font-size:0'>{bar}"
        f"<div style='position:absolute;top:-2px;left:{budget_mark};width:2px;height:18px;background:#000'></div></div>"
        f"<table style='font-size:0.9em'>{rows}"
        f"<tr><td><b>total</b></td><td style='text-align:right;padding-left:12px'><b>{_size(total)}</b></td></tr></table>"
        f"<div style='color:#555'>{est.shape.name if est.shape else ''}: "
        f"{_count(params)} params, LoRA {_count(lora_params)} trainable; "
        f"{plan_text}</div>{extra}</div>"
    )


@dataclass
class CardVerdict:
    """The model panel's verdict for one run on one GPU card, as one line of text (``str(verdict)``)."""

    card: str
    result: EstimateResult

    @property
    def fits(self) -> bool:
        return self.result.fits

    @property
    def total(self) -> int | None:
        """The predicted peak in bytes (None when the model could not be estimated)."""
        return self.result.estimate.total if self.result.estimate is not None else None

    def __str__(self) -> str:
        res, est = self.result, self.result.estimate
        if est is None:
            return f"{res.budget_label}: cannot estimate ({res.message})"
        plan = ", ".join(f"{v} {k}" for k, v in est.plan_counts().items() if v)
        line = (f"{res.budget_label}: {_size(est.total)} of {_size(res.budget_bytes)} — "
                f"{'fits' if res.fits else 'does not fit'} ({'auto plan' if res.plan else 'activations'}: {plan})")
        if not res.fits and est.total <= res.budget_bytes:
            line += (f"\n    under the card's size, but the planner keeps {DEFAULT_SAFETY_MARGIN:.0%} of what the step "
                     "adds to the base weights free for the allocator's fragmentation")
        if not res.fits:  # the planner's reasons: the parts, what takes the room, what to change
            line += "".join(f"\n    {text.strip()}" for text in res.message.splitlines() if text.strip())
        return line


class CardVerdicts(list):
    """One run's :class:`CardVerdict` on each card; ``str()`` is the run's settings, then a line a card."""

    def __str__(self) -> str:
        first = next((v.result.estimate for v in self if v.result.estimate is not None), None)
        if first is None:  # the model itself cannot be estimated: the same reason for every card
            return f"Memory estimate: {self[0].result.message}" if self else "Memory estimate: no card given"
        return "\n".join([first.table().split("\n", 1)[0] + ":"] + [f"  {v}" for v in self])


def card_verdicts(model_name: str, cards: tuple[str, ...] = ("t4", "l4"), *, load_in_4bit: bool = True,
                  max_seq_length: int = 2048, dtype: str | None = None, r: int = 16,
                  use_gradient_checkpointing: Any = "auto", batch_size: int = 1,
                  optim: str = "adamw_8bit") -> CardVerdicts:
    """Will this run train on a T4, on a 24 GB card? The model panel's verdict (:func:`compute_estimate`: the
    memory model, and the activation planner for checkpointing ``"auto"``) for one run on each card of ``cards``
    (names as :func:`notebookkit.memory.parse_card` reads them), whatever GPU this machine has or lacks.

    ``dtype=None`` is each card's own (float16 on a T4, bfloat16 where the card has it); ``optim`` defaults to
    the training panel's choice on a GPU. ``print()`` the result for a line a card::

        print(card_verdicts("unsloth/gpt-oss-20b-BF16", r=8, max_seq_length=1024))
    """
    from .lora_panel import LoRAChoice
    from .training_panel import TrainingChoice

    lora = LoRAChoice(r=int(r), lora_alpha=int(r), use_gradient_checkpointing=use_gradient_checkpointing)
    training = TrainingChoice(per_device_train_batch_size=int(batch_size), optim=optim)
    return CardVerdicts(
        CardVerdict(card, compute_estimate(ModelChoice(model_name=model_name, load_in_4bit=load_in_4bit, card=card,
                                                       max_seq_length=int(max_seq_length), dtype=dtype),
                                           lora, training))
        for card in cards)


class ModelPanel(Panel):
    """Widgets to choose the model, with a live VRAM estimate.

    Keyword arguments override the defaults (headless runs), e.g.
    ``ModelPanel(model_name="Qwen/Qwen3-4B", load_in_4bit=True, max_seq_length=4096, card="t4")``.
    """

    def __init__(self, **overrides: Any) -> None:
        super().__init__()
        v = self._starting_value(ModelChoice, overrides)
        st = {"description_width": "120px"}
        fam = family_of(v.model_name)
        self.family = styled(W.Dropdown(options=["All"] + list(CATALOG), value=fam or "All", description="family",
                                        style=st), "nbk-family")
        self.model_name = styled(
            W.Combobox(value=v.model_name, options=model_names(fam), ensure_option=False, description="model",
                       placeholder="hub name or local folder", continuous_update=False, style=st,
                       layout=W.Layout(width="460px")),
            "nbk-model-name",
        )
        self.weights = styled(W.Dropdown(options=[(f.label, f.name) for f in BASE_FORMATS.values()],
                                         value=v.base_format, description="weights", style=st), "nbk-weights")
        self.max_seq_length = styled(
            W.BoundedIntText(value=int(v.max_seq_length), min=16, max=1 << 20, step=256, description="max_seq_length",
                             style=st, layout=W.Layout(width="260px")), "nbk-max-seq-length")
        dvals = [d for _, d in DTYPES]
        dtype = "auto" if v.dtype is None else str(v.dtype).replace("torch.", "")
        self.dtype = styled(W.Dropdown(options=DTYPES if dtype in dvals else DTYPES + [(dtype, dtype)],
                                       value=dtype, description="dtype", style=st), "nbk-dtype")
        opts = card_options()
        if v.card not in [o[1] for o in opts]:
            from notebookkit.memory.cards import parse_card

            c = parse_card(v.card)
            opts.append((c.label(), v.card))
        self.card = styled(W.Dropdown(options=opts, value=v.card, description="GPU card", style=st,
                                      layout=W.Layout(width="460px")), "nbk-card")
        self.offload_embedding = styled(
            W.Checkbox(value=bool(v.offload_embedding), indent=False,
                       description="input embedding in host RAM (untied models: ~1 GiB less VRAM for 7-8B)"),
            "nbk-offload-embedding")
        self.estimate = styled(W.HTML("", layout=W.Layout(margin="0 0 0 24px")), "nbk-vram-estimate")
        self._controls = [self.model_name, self.weights, self.max_seq_length, self.dtype, self.card,
                          self.offload_embedding]
        self.widget = styled(
            W.VBox([
                header("Model", "what to fine-tune and where"),
                W.HBox([W.VBox([self.family, self.model_name, self.weights, self.offload_embedding,
                                self.max_seq_length, self.dtype, self.card]), self.estimate]),
            ]),
            "nbk-panel", "nbk-model-panel",
        )
        self.family.observe(self._family_changed, names="value")
        self._lora_source: Panel | None = None
        self._training_source: Panel | None = None
        self.last_result: EstimateResult | None = None
        self._wire()
        self.on_change(lambda _p: self.refresh())
        self.refresh()

    def _family_changed(self, change: dict) -> None:
        fam = change["new"]
        self.model_name.options = model_names(None if fam == "All" else fam)
        names = self.model_name.options
        if fam != "All" and names and self.model_name.value not in names:
            self.model_name.value = names[0]

    def link(self, lora: Panel | None = None, training: Panel | None = None) -> None:
        """Follow ``lora`` and ``training`` panels: their changes update this panel's estimate."""
        if lora is not None:
            self._lora_source = lora
            lora.on_change(lambda _p: self.refresh())
        if training is not None:
            self._training_source = training
            training.on_change(lambda _p: self.refresh())
        self.refresh()

    def refresh(self) -> EstimateResult:
        """Recompute the estimate for the current choices (called automatically on changes)."""
        lora = self._lora_source.value if self._lora_source is not None else None
        training = self._training_source.value if self._training_source is not None else None
        res = compute_estimate(self.value, lora, training)
        self.last_result = res
        self.estimate.value = estimate_html(res)
        return res

    @property
    def estimate_text(self) -> str:
        """The estimate as plain text (what the HTML shows, without markup)."""
        import re

        return html.unescape(re.sub(r"<[^>]+>", " ", self.estimate.value)).replace("  ", " ").strip()

    @property
    def value(self) -> ModelChoice:
        return ModelChoice(
            model_name=str(self.model_name.value).strip() or _default_model(),
            **{f: BASE_FORMATS[self.weights.value].load_flag == f for f in load_flags()},
            max_seq_length=int(self.max_seq_length.value),
            dtype=None if self.dtype.value == "auto" else self.dtype.value,
            card=str(self.card.value),
            offload_embedding=bool(self.offload_embedding.value),
        )
