"""ipywidgets panels and the live training dashboard.

    from notebookkit.widgets import ConfigPanels, LiveDashboard
    panels = ConfigPanels(model=dict(model_name="notebookkit/tiny-llama"))
    panels                        # model / LoRA / training panels with a live VRAM estimate
    cfg = panels.value            # dataclasses: cfg.model, cfg.lora, cfg.training
    dash = LiveDashboard()        # a transformers TrainerCallback: trainer.add_callback(dash)
"""

from __future__ import annotations

from notebookkit._lazy import lazy_exports

_LAZY = {
    "ModelPanel": "model_panel", "ModelChoice": "model_panel", "compute_estimate": "model_panel",
    "LoRAPanel": "lora_panel", "LoRAChoice": "lora_panel",
    "TrainingPanel": "training_panel", "TrainingChoice": "training_panel",
    "ConfigPanels": "panels", "PanelValues": "panels", "link_estimate": "panels",
    "LiveDashboard": "dashboard",
    "CATALOG": "catalog", "resolve_shape": "catalog",
    "card_options": "cards",
    "ExportPanel": "export_panel", "ExportChoice": "export_panel",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
__all__ = list(_LAZY)
