"""ipywidgets panels and the live training dashboard.

    from notebookkit.widgets import ConfigPanels, LiveDashboard
    panels = ConfigPanels(model=dict(model_name="notebookkit/tiny-llama"))
    panels                        # model / LoRA / training panels with a live VRAM estimate
    cfg = panels.value            # dataclasses: cfg.model, cfg.lora, cfg.training
    dash = LiveDashboard()        # a transformers TrainerCallback: trainer.add_callback(dash)
"""

from __future__ import annotations

from notebookkit._lazy import lazy_package

__getattr__, __dir__, __all__ = lazy_package(__name__, {
    "model_panel": ("ModelPanel", "ModelChoice", "compute_estimate", "card_verdicts"),
    "lora_panel": ("LoRAPanel", "LoRAChoice"),
    "training_panel": ("TrainingPanel", "TrainingChoice"),
    "panels": ("ConfigPanels", "PanelValues", "link_estimate"),
    "dashboard": ("LiveDashboard",),
    "catalog": ("CATALOG", "resolve_shape"),
    "cards": ("card_options",),
    "export_panel": ("ExportPanel", "ExportChoice"),
})
