"""The three configuration panels together, with the VRAM estimate following all of them.

    panels = ConfigPanels(model=dict(model_name="Qwen/Qwen3-4B"), lora=dict(r=16), training=dict(max_steps=60))
    panels                      # shows the panels (last expression of a cell), or panels.display()
    cfg = panels.value          # PanelValues(model=ModelChoice, lora=LoRAChoice, training=TrainingChoice)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ipywidgets as W

from ._base import Shown, styled
from .lora_panel import LoRAChoice, LoRAPanel
from .model_panel import ModelChoice, ModelPanel
from .training_panel import TrainingChoice, TrainingPanel


@dataclass
class PanelValues:
    """Everything the panels hold, as plain dataclasses."""

    model: ModelChoice
    lora: LoRAChoice
    training: TrainingChoice


def link_estimate(model_panel: ModelPanel, lora_panel: LoRAPanel | None = None,
                  training_panel: TrainingPanel | None = None) -> ModelPanel:
    """Make ``model_panel``'s VRAM estimate follow the LoRA and training panels' choices."""
    model_panel.link(lora=lora_panel, training=training_panel)
    return model_panel


def _panel(obj: Any, cls: type) -> Any:
    if obj is None:
        return cls()
    if isinstance(obj, cls):
        return obj
    if isinstance(obj, dict):
        return cls(**obj)
    raise TypeError(f"expected a {cls.__name__}, a dict of its settings or None, got {type(obj).__name__}")


class ConfigPanels(Shown):
    """Model, LoRA and training panels, linked so the VRAM estimate follows every choice.

    Each argument is a panel, a dict of overrides for it, or None for the defaults.
    """

    def __init__(self, model: ModelPanel | dict | None = None, lora: LoRAPanel | dict | None = None,
                 training: TrainingPanel | dict | None = None) -> None:
        self.model = _panel(model, ModelPanel)
        self.lora = _panel(lora, LoRAPanel)
        self.training = _panel(training, TrainingPanel)
        link_estimate(self.model, self.lora, self.training)
        self.widget = styled(W.VBox([self.model.widget, self.lora.widget, self.training.widget]), "nbk-config-panels")

    @property
    def value(self) -> PanelValues:
        return PanelValues(model=self.model.value, lora=self.lora.value, training=self.training.value)

    @property
    def estimate(self):
        """The current :class:`~notebookkit.widgets.model_panel.EstimateResult`."""
        return self.model.last_result
