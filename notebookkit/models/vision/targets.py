"""Which linear layers of a vision-language model get LoRA adapters, from four switches.

``FastVisionModel.get_peft_model(finetune_vision_layers, finetune_language_layers,
finetune_attention_modules, finetune_mlp_modules)`` picks adapters the way the most used vision
notebooks do. Every leaf linear layer (``nn.Linear`` or a bitsandbytes 4/8-bit linear) of the
wrapper is sorted by two facts read off its dotted name and the family record (``Family.vision``):

* **tower**: *vision* when it lies under the vision tower or the projector (Qwen2.5-VL's
  ``model.visual`` with its ``merger``; Gemma 3's ``model.vision_tower``; Gemma 3's projector is a
  bare matrix, not a linear layer, so it never gets an adapter), *language* when it lies under the
  text backbone (``model.language_model``). The LM head gets none.
* **kind**: *attention* when a part of its name is an attention block (``self_attn``, ``attn``,
  ``attention``: q/k/v/o, Qwen2.5-VL's fused ``qkv`` and ``proj``, SigLIP's ``out_proj``), *MLP*
  when a part is ``mlp`` (gate/up/down, ``fc1``/``fc2``, the merger's two layers).

A layer is adapted when its tower's switch and its kind's switch are both on. The result is the
list of full module names, given to PEFT as ``target_modules`` (an exact match per name), so the
saved ``adapter_config.json`` says exactly which layers were adapted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from notebookkit.families import Vision

ATTENTION_PARTS = ("self_attn", "attn", "attention", "self_attention")
MLP_PARTS = ("mlp",)
_LINEAR_CLASSES = ("Linear4bit", "Linear8bitLt")


@dataclass
class TargetSelection:
    """The adapted layers, by tower and kind (``names`` is what PEFT gets)."""

    names: list[str] = field(default_factory=list)
    counts: dict[tuple[str, str], int] = field(default_factory=dict)

    def describe(self) -> str:
        """``"vision: 4 attention + 6 MLP, language: 8 attention + 6 MLP"``."""
        out = []
        for tower in ("vision", "language"):
            kinds = [f"{self.counts[(tower, k)]} {k}" for k in ("attention", "MLP") if self.counts.get((tower, k))]
            if kinds:
                out.append(f"{tower}: {' + '.join(kinds)}")
        return ", ".join(out) or "no layers"


def is_leaf_linear(module: nn.Module) -> bool:
    """A linear layer PEFT can adapt: ``nn.Linear`` or a bitsandbytes quantised linear (not a LoRA wrapper)."""
    if hasattr(module, "base_layer"):
        return False
    return isinstance(module, nn.Linear) or type(module).__name__ in _LINEAR_CLASSES


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def tower_of(name: str, vision: Vision) -> str | None:
    """``"vision"``, ``"language"`` or ``None`` (neither: the LM head, anything else) for a module name."""
    if _under(name, vision.vision_tower) or _under(name, vision.projector):
        return "vision"
    if _under(name, vision.language_model):
        return "language"
    return None


def kind_of(name: str) -> str | None:
    """``"attention"``, ``"MLP"`` or ``None`` for a module name."""
    parts = name.split(".")[:-1]
    if any(p in ATTENTION_PARTS for p in parts):
        return "attention"
    if any(p in MLP_PARTS for p in parts):
        return "MLP"
    return None


def select_targets(
    wrapper: nn.Module,
    vision: Vision,
    finetune_vision_layers: bool = True,
    finetune_language_layers: bool = True,
    finetune_attention_modules: bool = True,
    finetune_mlp_modules: bool = True,
) -> TargetSelection:
    """The linear layers of ``wrapper`` (a Hugging Face VLM, not PEFT-wrapped) the four switches select."""
    towers = {"vision": finetune_vision_layers, "language": finetune_language_layers}
    kinds = {"attention": finetune_attention_modules, "MLP": finetune_mlp_modules}
    selection = TargetSelection()
    for name, module in wrapper.named_modules():
        if not is_leaf_linear(module):
            continue
        tower, kind = tower_of(name, vision), kind_of(name)
        if tower is None or kind is None or not (towers[tower] and kinds[kind]):
            continue
        selection.names.append(name)
        selection.counts[(tower, kind)] = selection.counts.get((tower, kind), 0) + 1
    return selection


__all__ = ["TargetSelection", "is_leaf_linear", "kind_of", "select_targets", "tower_of"]
