"""The low-bit step of the one load pipeline (:func:`notebookkit.models.loading.loader.load`): where the
16-bit / NF4 path calls the model class's ``from_pretrained``, a 2-bit or ternary load calls
:func:`load_weights_low_bit` (device from ``device_map``, the streamed load of :mod:`.stream_load`, the
generation config, the banner's weights line); :func:`loaded_base_format` names what any load produced,
for ``notebookkit.memory.model_setup.record_base_format``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from notebookkit.base_formats import BASE_FORMATS
from notebookkit.base_layers.low_bit_linear import is_low_bit_linear

from .flags import is_bitnet_config, saved_low_bit_record
from .stream_load import load_low_bit

__all__ = ["device_of_map", "load_weights_low_bit", "loaded_base_format"]


def device_of_map(device_map: Any, flag: str) -> torch.device:
    """The one device a low-bit load places the model on: ``None``/``"cpu"``, a GPU index or ``{"": device}``."""
    if device_map is None or device_map == "cpu":
        return torch.device("cpu")
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if isinstance(device_map, int):
        return torch.device("cuda", device_map)
    if isinstance(device_map, (str, torch.device)):
        try:
            return torch.device(device_map)
        except RuntimeError:
            pass
    raise ValueError(f"{flag}=True places the whole model on one device, but device_map={device_map!r} spreads it. "
                     "Pass device_map=None (this GPU), a device such as 'cuda:0', or {'': 0}.")


def load_weights_low_bit(path: str, kind: str, config: Any, base_format: str, model_class: Any, dtype: torch.dtype,
                         device_map: Any, banner: Any, token: Optional[str] = None,
                         attn_implementation: Optional[str] = None, extra: Optional[dict] = None,
                         where: str = "from_pretrained") -> nn.Module:
    """Load ``path`` with its decoder projections in ``base_format`` (``"2bit"`` or ``"ternary"``)."""
    flag = BASE_FORMATS[base_format].load_flag
    if extra:
        raise ValueError(f"{where}: {', '.join(sorted(extra))} cannot be passed on to a {flag}=True load (it builds "
                         "the model itself, tensor by tensor). Drop them, or load in 16-bit / 4-bit.")
    device = device_of_map(device_map, flag)
    saved = saved_low_bit_record(config)
    notes: list[str] = []
    model = load_low_bit(path, config, base_format, model_class, dtype, device, kind=kind, token=token,
                         attn_implementation=attn_implementation, notes=notes)
    generation = Path(path) / "generation_config.json"
    if generation.is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    label = BASE_FORMATS[base_format].label
    if saved is not None:
        how = "pre-quantised checkpoint, loaded as saved"
    elif is_bitnet_config(config):
        how = "BitNet b1.58 checkpoint, codes read as they are (activations stay 16-bit, not 8-bit as BitNet's)"
    else:
        how = "quantised on load, one tensor at a time"
    banner.header.append(f"weights: {label} projections ({how}); the rest {str(dtype).replace('torch.', '')}")
    for note in notes:
        banner.note(note)
    return model


def loaded_base_format(model: nn.Module) -> Optional[str]:
    """The base format of a loaded model's projections: ``"2bit"``, ``"ternary"``, ``"nf4"``, ``"16bit"``,
    or ``None`` (8-bit: no record in :data:`notebookkit.base_formats.BASE_FORMATS`)."""
    for module in model.modules():
        if is_low_bit_linear(module):
            return module.base_format
        name = type(module).__name__
        if name == "Linear4bit":
            return "nf4"
        if name == "Linear8bitLt":
            return None
    return "16bit"
