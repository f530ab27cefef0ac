"""Tiny models saved pre-quantised in a low-bit base format, built from another tiny model's folder.

Each decoder projection's weight (``model.layers.<i>.self_attn.{q,k,v,o}_proj``,
``model.layers.<i>.mlp.{gate,up,down}_proj``) is quantised the way
``from_pretrained(..., load_in_ternary=True)`` quantises it on load
(:func:`notebookkit.kernels.ternary.quantize_ternary`, its defaults: a scale a row, four least-squares
refits) and written as notebookkit's pre-quantised checkpoint: ``<name>.qweight`` and ``<name>.scale``
in ``model.safetensors``, the record under ``notebookkit.base_formats.PREQUANTISED_CONFIG_KEY`` in
``config.json``. Every other tensor and file (tokenizer, chat template, generation config) is copied.
Only the kernels are used (the embedded default does not import the models layer).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def _projection(key: str) -> str | None:
    """The layer name of a decoder projection's weight key, else ``None``."""
    if not (key.startswith("model.layers.") and key.endswith(".weight")):
        return None
    prefix = key[: -len(".weight")]
    return prefix if prefix.split(".", 3)[3] in PROJECTIONS else None


def build_low_bit_model_folder(source: Path, out: Path, base_format: str) -> dict[str, Any]:
    """Write ``source``'s model into ``out`` with its projections in ``base_format`` (``"ternary"``);
    returns ``{"params", "base_format"}`` for the build stamp (``params``: the dense model's count)."""
    from safetensors.torch import load_file, save_file

    from notebookkit.base_formats import PREQUANTISED_CONFIG_KEY
    from notebookkit.kernels.ternary import quantize_ternary

    if base_format != "ternary":
        raise ValueError(f"only ternary tiny models are built, not {base_format!r}.")
    tensors = load_file(str(source / "model.safetensors"))
    modules, packed, params = [], {}, 0
    for key, value in tensors.items():
        params += value.numel()
        layer = _projection(key)
        if layer is None:
            packed[key] = value
            continue
        t = quantize_ternary(value)
        packed[layer + ".qweight"], packed[layer + ".scale"] = t.packed, t.scales
        modules.append(layer)
    save_file(packed, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config[PREQUANTISED_CONFIG_KEY] = {"format": base_format, "group_size": None, "modules": modules}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for extra in source.iterdir():
        if extra.is_file() and extra.name not in ("model.safetensors", "config.json") and not extra.name.startswith("."):
            shutil.copy2(extra, out / extra.name)
    return {"params": params, "base_format": base_format}
