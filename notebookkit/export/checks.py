"""Checks made before an export does any work, with messages a notebook user can act on."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.nn as nn

from notebookkit.export_forms import REFUSED_SAVE_METHOD, forms_written_by

__all__ = ["ExportError", "refuse_mixture_of_experts", "require_notebookkit_model", "check_output_folder", "check_save_method", "SAVE_METHODS",
           "parse_size", "format_bytes"]

#: the ``save_method`` values of ``save_pretrained_merged`` (the forms of :mod:`notebookkit.export_forms` it
#: writes), its default first
DEFAULT_SAVE_METHOD = "merged_16bit"
SAVE_METHODS = (DEFAULT_SAVE_METHOD, *(f for f in forms_written_by("save_pretrained_merged") if f != DEFAULT_SAVE_METHOD))


class ExportError(ValueError):
    """An export that cannot start: bad arguments, a folder that cannot take it, a model it cannot write."""


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def parse_size(value: Any) -> int:
    """``"5GB"`` -> 5e9 bytes, ``"500MB"``, ``"2GiB"``, or a number of bytes (Hugging Face's convention)."""
    if isinstance(value, (int, float)):
        return int(value)
    text = str(value).strip().upper().replace(" ", "")
    units = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            number = text[: -len(unit)]
            try:
                return int(float(number) * factor)
            except ValueError:
                break
    raise ExportError(f"max_shard_size={value!r} is not a size: write it like '5GB', '500MB' or a number of bytes.")


def require_notebookkit_model(model: Any, what: str) -> nn.Module:
    """The Hugging Face model inside ``model``; raises when it did not come from ``FastLanguageModel``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(base, nn.Module) or not hasattr(base, "notebookkit_banner"):
        raise ExportError(
            f"{what} needs a model loaded by notebookkit, but got {type(model).__name__}. Load it with\n"
            "    model, tokenizer = FastLanguageModel.from_pretrained(name_or_folder)\n"
            "(`from notebookkit import FastLanguageModel`; a folder with your adapter works too), "
            "then call model." + what + "(...)."
        )
    return base


def _existing_ancestor(path: Path) -> Path:
    p = path
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    return p


def check_output_folder(path: os.PathLike, need_bytes: int, what: str = "the export") -> Path:
    """Raise unless ``path`` can be created (or replaced) and its file system has ``need_bytes`` free.

    The export is written into a temporary folder beside ``path`` and renamed at the end, so the
    parent folder must be writable and hold the whole export.
    """
    target = Path(os.path.expanduser(os.fspath(path))).absolute()
    if target.exists() and not target.is_dir():
        raise ExportError(f"{target} is a file, not a folder. Pass a folder name for {what}.")
    parent = _existing_ancestor(target.parent)
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(
            f"Cannot write {what} to {target}: the folder {parent} is not writable by this user. "
            "Pass a folder you can write to (for example one under your home folder or /content on Colab)."
        )
    free = shutil.disk_usage(parent).free
    margin = 64 * 2**20
    if free < need_bytes + margin:
        raise ExportError(
            f"Not enough disk space for {what} in {parent}: it needs about {format_bytes(need_bytes)} "
            f"and {format_bytes(free)} is free. Free some space, or pass a folder on a larger disk."
        )
    return target


def check_save_method(save_method: str) -> None:
    """Raise a readable error unless ``save_method`` is a form this function writes."""
    if save_method == REFUSED_SAVE_METHOD:
        raise ExportError(
            "save_method='merged_4bit' re-quantises the merged weights to 4-bit, which rounds part of the LoRA "
            "update away. Use save_method='merged_16bit' (lossless; load it with load_in_4bit=True for 4-bit "
            "memory), or save_method='merged_4bit_forced' if you need a 4-bit folder (it warns how much the "
            "rounding changed the weights)."
        )
    if save_method not in SAVE_METHODS:
        raise ExportError(f"save_method={save_method!r} is not one of {', '.join(repr(m) for m in SAVE_METHODS)}.")


def refuse_mixture_of_experts(model_type: Any, what: str) -> None:
    """Raise :class:`ExportError` when ``model_type`` is a mixture-of-experts family (Qwen3-MoE, gpt-oss)
    and ``what`` is ``merged_4bit_forced``: transformers + bitsandbytes quantise ``nn.Linear`` layers only,
    so the stacked expert weights (most of the model) would stay 16-bit in a folder that claims 4-bit."""
    from notebookkit.families import for_model_type

    family = for_model_type(model_type)
    if family is None or family.moe is None:
        return
    raise ExportError(
        f"{what} does not cover mixture-of-experts models ({family.name}): bitsandbytes quantises linear layers "
        "only, and the experts are stacked 3-D weights, so most of the model would stay 16-bit. Save with "
        "save_method='merged_16bit' (the experts' LoRA merged in) and load that folder with load_in_4bit=True, or "
        "save the adapters with save_method='lora'."
    )
