"""The export panel: which forms to write, GGUF quantisations, memory budget, output folder, verify.

    panel = ExportPanel(output_dir="outputs/export")
    panel                     # shows it
    choice = panel.value      # ExportChoice(forms=[...], gguf_methods=[...], ...)
    rows = export_and_verify(model, tokenizer, **choice.kwargs())
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ipywidgets as W

from notebookkit import export_forms

from ._base import Panel, header, styled

__all__ = ["ExportChoice", "ExportPanel", "EXPORT_FORMS", "GGUF_CHOICES"]

#: the forms the panel offers (rows of :mod:`notebookkit.export_forms` with a label), and the GGUF types
EXPORT_FORMS = tuple(f.name for f in export_forms.EXPORT_FORMS.values() if f.label)
GGUF_CHOICES = tuple(t.name for t in export_forms.GGUF_TYPES.values() if t.in_panel)
_LABELS = [(export_forms.EXPORT_FORMS[name].label, name) for name in EXPORT_FORMS]
_NEEDS_LLAMA_CPP = ", ".join(t for t in GGUF_CHOICES if export_forms.GGUF_TYPES[t].needs_llama_cpp)


@dataclass
class ExportChoice:
    """What the export panel holds."""

    forms: list[str] = field(default_factory=lambda: list(EXPORT_FORMS))
    gguf_methods: list[str] = field(default_factory=lambda: ["q8_0"])
    maximum_memory_usage: float = 0.75
    output_dir: str = "outputs/export"
    verify: bool = True

    def kwargs(self) -> dict:
        """Keyword arguments of :func:`notebookkit.export.report.export_and_verify`."""
        return dict(output_dir=self.output_dir, forms=list(self.forms), gguf_methods=list(self.gguf_methods),
                    maximum_memory_usage=self.maximum_memory_usage, verify=self.verify)


class ExportPanel(Panel):
    """Forms to write (adapter, merged 16-bit, GGUF), GGUF quantisations, GPU budget, folder, verification."""

    def __init__(self, **overrides) -> None:
        super().__init__()
        start = ExportChoice(**overrides)
        self.forms = styled(W.SelectMultiple(options=_LABELS, value=tuple(start.forms), description="forms", rows=3), "nbk-export-forms")
        self.gguf = styled(W.SelectMultiple(options=list(GGUF_CHOICES), value=tuple(start.gguf_methods), description="GGUF", rows=4), "nbk-export-gguf")
        self.budget = styled(W.FloatSlider(value=start.maximum_memory_usage, min=0.1, max=1.0, step=0.05, description="GPU budget",
                                           readout_format=".2f"), "nbk-export-budget")
        self.folder = styled(W.Text(value=start.output_dir, description="folder"), "nbk-export-folder")
        self.verify = styled(W.Checkbox(value=start.verify, description="reload and verify each export"), "nbk-export-verify")
        self._controls = [self.forms, self.gguf, self.budget, self.folder, self.verify]
        note = W.HTML(f"<span style='color:#666'>K-quants ({_NEEDS_LLAMA_CPP}) need llama-cpp-python; "
                      "the GPU budget is the fraction of the card the merge may fill.</span>")
        self.widget = styled(W.VBox([header("Export", "what to write and how to check it"), W.HBox([self.forms, self.gguf]),
                                     self.budget, self.folder, self.verify, note]), "nbk-export-panel")
        self._wire()

    @property
    def value(self) -> ExportChoice:
        return ExportChoice(forms=list(self.forms.value), gguf_methods=list(self.gguf.value),
                            maximum_memory_usage=float(self.budget.value), output_dir=self.folder.value, verify=bool(self.verify.value))
