"""LoRA panel: rank, alpha, target modules, dropout, bias, gradient checkpointing mode.

``LoRAPanel().value`` is a :class:`LoRAChoice` whose :meth:`~LoRAChoice.peft_kwargs` go straight
into ``FastLanguageModel.get_peft_model(model, **kwargs)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import ipywidgets as W

from notebookkit.memory.shapes import PROJECTIONS

from ._base import Panel, header, styled

CHECKPOINTING_OPTIONS: list[tuple[str, Any]] = [
    ("auto: plan per layer for the card", "auto"),
    ("off: keep all activations (fastest, most memory)", False),
    ("recompute every layer", True),
    ("recompute + offload inputs to CPU (least memory)", "offload"),
]
_CKPT_VALUES = [v for _, v in CHECKPOINTING_OPTIONS]


def _ckpt_value(v: Any) -> Any:
    if isinstance(v, str) and v.lower() == "unsloth":
        return "offload"
    if isinstance(v, str) and v.lower() in ("true", "recompute"):
        return True
    if isinstance(v, str) and v.lower() in ("false", "keep", "none"):
        return False
    if v not in _CKPT_VALUES:
        raise ValueError(
            f"notebookkit: use_gradient_checkpointing={v!r} is not one of 'auto', True, False, 'offload' ('unsloth')."
        )
    return v


@dataclass
class LoRAChoice:
    """LoRA settings, named as ``get_peft_model`` takes them."""

    r: int = 16
    lora_alpha: int = 16
    target_modules: list[str] = field(default_factory=lambda: list(PROJECTIONS))
    lora_dropout: float = 0.0
    bias: str = "none"
    use_gradient_checkpointing: Any = "auto"
    random_state: int = 3407
    fp8_base_matmul: bool = False

    @property
    def fast_path(self) -> bool:
        """True when the fused LoRA kernels apply (no dropout, no bias training)."""
        return self.lora_dropout == 0 and self.bias == "none"

    @property
    def activation_mode(self) -> str:
        """The checkpointing choice in the memory model's words."""
        v = self.use_gradient_checkpointing
        return {True: "recompute", False: "keep"}.get(v, v) if not isinstance(v, str) else v

    def peft_kwargs(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        return d


def fast_path_note(choice: LoRAChoice) -> str:
    """Why a choice leaves the fused fast path, or '' if it does not."""
    reasons = []
    if choice.lora_dropout > 0:
        reasons.append(f"lora_dropout={choice.lora_dropout:g} (each adapter stores a dropped copy of its input)")
    if choice.bias != "none":
        reasons.append(f"bias={choice.bias!r} (trains bias vectors the fused kernels do not update)")
    if not reasons:
        return ""
    return (
        "Leaves the fast path: " + "; ".join(reasons)
        + ". Those layers run the plain PEFT code: slower and more memory. Use dropout 0 and bias 'none' for the fused kernels."
    )


def fp8_available() -> tuple[bool, str]:
    """Whether this runtime's GPU can run the FP8 forward, and a sentence saying why (for the panel)."""
    import torch

    if not torch.cuda.is_available():
        return False, ("The FP8 forward needs an NVIDIA GPU with FP8 tensor cores (L4, RTX 4090, L40S, H100, H200); "
                       "this runtime has none, so it stays off.")
    from notebookkit.kernels.fp8_matmul import fp8_supported

    return fp8_supported("cuda")


class LoRAPanel(Panel):
    """Widgets for the LoRA adapter settings. Keyword arguments override the defaults (headless runs).

    ``LoRAPanel(r=8, use_gradient_checkpointing="auto").value.peft_kwargs()``
    """

    def __init__(self, **overrides: Any) -> None:
        super().__init__()
        v = self._starting_value(LoRAChoice, overrides)
        targets = [str(t) for t in (v.target_modules or [])]
        bad = [t for t in targets if t not in PROJECTIONS]
        if bad:
            raise ValueError(f"notebookkit: unknown target modules {bad}; choose from {list(PROJECTIONS)}.")
        ckpt = _ckpt_value(v.use_gradient_checkpointing)
        self.rank = styled(
            W.IntSlider(value=int(v.r), min=1, max=max(256, int(v.r)), step=1, description="LoRA rank r",
                        continuous_update=False, style={"description_width": "120px"},
                        layout=W.Layout(width="420px")),
            "nbk-rank-slider",
        )
        self.alpha = styled(
            W.IntSlider(value=int(v.lora_alpha), min=1, max=max(512, int(v.lora_alpha)), step=1,
                        description="lora_alpha", continuous_update=False, style={"description_width": "120px"},
                        layout=W.Layout(width="420px")),
            "nbk-alpha-slider",
        )
        self.targets = {
            name: styled(W.Checkbox(value=name in targets, description=name, indent=False,
                                    layout=W.Layout(width="110px")), "nbk-target", f"nbk-target-{name}")
            for name in PROJECTIONS
        }
        self.dropout = styled(
            W.FloatSlider(value=float(v.lora_dropout), min=0.0, max=0.5, step=0.05, description="lora_dropout",
                          continuous_update=False, style={"description_width": "120px"},
                          layout=W.Layout(width="420px")),
            "nbk-dropout-slider",
        )
        self.bias = styled(W.Dropdown(options=["none", "all", "lora_only"], value=v.bias, description="bias",
                                      style={"description_width": "120px"}), "nbk-bias")
        self.checkpointing = styled(
            W.Dropdown(options=CHECKPOINTING_OPTIONS, value=ckpt, description="checkpointing",
                       style={"description_width": "120px"}, layout=W.Layout(width="460px")),
            "nbk-checkpointing",
        )
        fp8_ok, fp8_why = fp8_available()
        # asked for (e.g. a notebook copied from an H100 run) where it cannot run: say so in the note
        self._fp8_refused = fp8_why if (v.fp8_base_matmul and not fp8_ok) else ""
        self.fp8 = styled(
            W.Checkbox(value=bool(v.fp8_base_matmul) and fp8_ok, disabled=not fp8_ok, indent=False,
                       description="FP8 forward matmuls (Ada / Hopper GPUs)",
                       tooltip=fp8_why, layout=W.Layout(width="560px")),
            "nbk-fp8",
        )
        self.seed = int(v.random_state)
        self.note = styled(W.HTML(""), "nbk-lora-note")
        self._controls = [self.rank, self.alpha, self.dropout, self.bias, self.checkpointing, self.fp8,
                          *self.targets.values()]
        self.widget = styled(
            W.VBox([
                header("LoRA adapters", "rank, scale, where they go"),
                self.rank, self.alpha,
                W.HTML("<div style='margin:4px 0 0 4px'>target modules</div>"),
                W.HBox(list(self.targets.values())[:4]), W.HBox(list(self.targets.values())[4:]),
                self.dropout, self.bias, self.checkpointing, self.fp8, self.note,
            ]),
            "nbk-panel", "nbk-lora-panel",
        )
        self._wire()
        self.on_change(lambda _p: self._update_note())
        self._update_note()

    def _update_note(self) -> None:
        text = fast_path_note(self.value)
        if not any(cb.value for cb in self.targets.values()):
            text = "Pick at least one target module: with none, nothing is trained."
        elif self._fp8_refused and not text:
            text = f"fp8_base_matmul=True was asked for but is off: {self._fp8_refused}"
        self.note.value = f"<div style='color:#a15c00;max-width:560px'>{text}</div>" if text else ""

    @property
    def value(self) -> LoRAChoice:
        return LoRAChoice(
            r=int(self.rank.value), lora_alpha=int(self.alpha.value),
            target_modules=[n for n, cb in self.targets.items() if cb.value],
            lora_dropout=round(float(self.dropout.value), 4), bias=str(self.bias.value),
            use_gradient_checkpointing=self.checkpointing.value, random_state=self.seed,
            fp8_base_matmul=bool(self.fp8.value),
        )
