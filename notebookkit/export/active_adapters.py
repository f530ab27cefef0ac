"""The LoRA adapters a merge adds into a layer's weight: the active ones not merged yet."""

from __future__ import annotations

import torch.nn as nn

__all__ = ["active_adapter_names"]


def active_adapter_names(module: nn.Module) -> list[str]:
    """The LoRA adapters of ``module`` that are active and not yet merged into its weight."""
    active = getattr(module, "active_adapters", None) or []
    if isinstance(active, str):
        active = [active]
    merged = set(getattr(module, "merged_adapters", []) or [])
    return [a for a in active if a in module.lora_A and a not in merged]
