"""The export panel's values reach export_and_verify's arguments."""

from __future__ import annotations

from notebookkit.widgets import ExportChoice, ExportPanel


def test_panel_value_and_kwargs():
    panel = ExportPanel(output_dir="out/x", gguf_methods=["q8_0", "q4_k_m"])
    seen = []
    panel.on_change(lambda p: seen.append(p.value))
    panel.forms.value = ("merged_16bit", "gguf")
    panel.budget.value = 0.5
    choice = panel.value
    assert choice == ExportChoice(forms=["merged_16bit", "gguf"], gguf_methods=["q8_0", "q4_k_m"], maximum_memory_usage=0.5,
                                  output_dir="out/x", verify=True)
    assert choice.kwargs() == dict(output_dir="out/x", forms=["merged_16bit", "gguf"], gguf_methods=["q8_0", "q4_k_m"],
                                   maximum_memory_usage=0.5, verify=True)
    assert len(seen) == 2 and seen[-1].maximum_memory_usage == 0.5
