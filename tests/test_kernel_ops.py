"""``NOTEBOOKKIT_DISABLE_KERNELS`` switches kernel modules off, and a change of the variable counts at the next
lookup (the parsed list is kept only while the text is the same)."""

from notebookkit.base_layers.kernel_ops import disabled, kernel, why_missing


def test_the_disable_switch_follows_the_environment(monkeypatch):
    monkeypatch.delenv("NOTEBOOKKIT_DISABLE_KERNELS", raising=False)
    assert kernel("rope", "apply_rope") is not None and disabled() == frozenset()
    monkeypatch.setenv("NOTEBOOKKIT_DISABLE_KERNELS", " rope , lora_mlp,")
    assert disabled() == {"rope", "lora_mlp"} and kernel("rope", "apply_rope") is None
    assert "disabled by NOTEBOOKKIT_DISABLE_KERNELS" in why_missing("rope", "apply_rope")
    monkeypatch.setenv("NOTEBOOKKIT_DISABLE_KERNELS", "lora_mlp")
    assert kernel("rope", "apply_rope") is not None and kernel("lora_mlp", "lora_mlp") is None
    monkeypatch.delenv("NOTEBOOKKIT_DISABLE_KERNELS")
    assert kernel("lora_mlp", "lora_mlp") is not None
