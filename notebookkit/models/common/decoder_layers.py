"""Where a loaded causal LM keeps its decoder layers: the one rule the patcher, the LoRA fast path
and checkpointing share.

A Hugging Face ``*ForCausalLM`` holds its backbone in ``.model`` and the backbone its decoder
layers, in order, in the ``ModuleList`` ``.layers``. A PEFT model is unwrapped to that causal LM
first; a multimodal wrapper keeps its text decoder one level deeper, in
``.model.language_model.layers`` (its vision tower's encoder layers are not decoder layers).
"""

from __future__ import annotations

from typing import Any


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of ``model`` (a causal LM, PEFT-wrapped or not), first to last; ``[]`` if none."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(causal_lm, "model", None)
    backbone = getattr(backbone, "language_model", backbone)
    layers = getattr(backbone, "layers", None)
    return list(layers) if layers is not None else []
