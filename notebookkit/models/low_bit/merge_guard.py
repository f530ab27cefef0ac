"""PEFT's ``merge`` / ``unmerge`` on a LoRA layer whose base is 2-bit or ternary: refused with a message.

``W + s B A`` is a dense matrix; writing it back into 2-bit codes would quantise the adapter's change
away (it is far below one quantisation step), and PEFT's own merge expects a dense ``base_layer.weight``
(these layers have none). :func:`guard_low_bit_merges` replaces ``merge`` and ``unmerge`` of each such
LoRA layer (on the instance: PEFT's class is untouched) by one that raises and says what to do instead:
the merged exports (:mod:`notebookkit.export.merge`) write ``W + s B A`` to a new folder, dense.
The replacement is a ``functools.partial`` of a module function, so ``copy.deepcopy`` and pickling keep it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.nn as nn

from notebookkit.base_formats import BASE_FORMATS
from notebookkit.base_layers.low_bit_linear import is_low_bit_linear

__all__ = ["guard_low_bit_merges", "LowBitMergeError"]


class LowBitMergeError(ValueError):
    """LoRA cannot be merged into a 2-bit or ternary base in place."""


def _refuse(base_format: str, what: str, *args: Any, **kwargs: Any) -> None:
    label = BASE_FORMATS[base_format].label
    raise LowBitMergeError(
        f"LoRA {what} on a {label} base is not possible in place: the merged weight W + s B A is dense, and "
        f"packing it back into {label} codes would round the adapter's change away. Keep the adapter separate "
        "(model.save_pretrained(folder) saves it; from_pretrained(folder, "
        f"{BASE_FORMATS[base_format].load_flag}=True) puts it back on the base), or write the merged model to a "
        "folder, leaving this one as it is: model.save_pretrained_merged(folder, tokenizer) (16-bit weights decoded "
        "from the codes plus the adapter, for plain transformers) or model.save_pretrained_gguf(folder, tokenizer)."
    )


def guard_low_bit_merges(model: nn.Module) -> int:
    """Make ``merge`` / ``unmerge`` of every LoRA layer on a low-bit base raise :class:`LowBitMergeError`;
    returns how many layers (idempotent)."""
    count = 0
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if base is None or not hasattr(module, "lora_A") or not is_low_bit_linear(base):
            continue
        for name in ("merge", "unmerge"):
            object.__setattr__(module, name, functools.partial(_refuse, base.base_format, name))
        count += 1
    return count
