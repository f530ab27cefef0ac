"""The patcher's reading of the family record: a loaded model's row, activation and soft-caps.

The facts live in :mod:`notebookkit.families` (one :class:`~notebookkit.families.Family` row per
family, importable without torch); this module looks a Hugging Face config up there and reads the
numbers the patcher needs from a loaded instance (its activation module, its soft-cap values).
"""

from __future__ import annotations

from typing import Any, Optional

from notebookkit.families import Family, for_model_type, supported_model_types

_ACT_NAMES = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu": "geglu",
    "gelu_pytorch_tanh": "geglu_tanh",
    "gelu_new": "geglu_tanh",
    "gelu_fast": "geglu_tanh",
    "gelu_tanh": "geglu_tanh",
}


def text_config(config: Any) -> Any:
    """The text part of a Hugging Face config (the config itself for a text-only model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def lookup(config: Any) -> Optional[Family]:
    """The family row for a Hugging Face config, or ``None``.

    The top-level ``model_type`` decides: a multimodal wrapper (``"gemma3"`` with a vision tower)
    is not a row, so it stays entirely on stock code rather than being half-patched.
    """
    return for_model_type(getattr(config, "model_type", None))


_ACT_CLASSES = {
    "SiLUActivation": "swiglu",
    "SiLU": "swiglu",
    "GELUTanh": "geglu_tanh",
    "PytorchGELUTanh": "geglu_tanh",
    "NewGELUActivation": "geglu_tanh",
    "FastGELUActivation": "geglu_tanh",
    "GELUActivation": "geglu",
    "GELU": "geglu",
}


def activation_of(act_fn: Any, config: Any = None, spec: Optional[Family] = None) -> Optional[str]:
    """The fused activation matching an MLP's ``act_fn`` module (read from the loaded instance).

    Falls back to the config's ``hidden_activation`` / ``hidden_act`` string, then to the family row.
    Returns ``None`` for an activation no fused kernel implements (the MLP then stays stock).
    """
    if act_fn is not None:
        name = type(act_fn).__name__
        if name == "GELU" and getattr(act_fn, "approximate", "none") == "tanh":
            return "geglu_tanh"
        if name in _ACT_CLASSES:
            return _ACT_CLASSES[name]
        return None
    if config is not None:
        text = text_config(config)
        act = getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", None)
        if act is not None:
            return _ACT_NAMES.get(str(act))
    return spec.activation if spec is not None else None


def attn_softcap(config: Any, spec: Family) -> Optional[float]:
    """Attention-score soft-cap ``c`` (``None`` when the family or config has none)."""
    if spec.attn_softcap_attr is None:
        return None
    value = getattr(text_config(config), spec.attn_softcap_attr, None)
    return float(value) if value else None


def final_softcap(config: Any, spec: Optional[Family]) -> Optional[float]:
    """Final-logit soft-cap ``c`` (``None`` when the family or config has none)."""
    if spec is None or spec.final_softcap_attr is None:
        return None
    value = getattr(text_config(config), spec.final_softcap_attr, None)
    return float(value) if value else None


__all__ = ["Family", "activation_of", "attn_softcap", "final_softcap", "lookup", "supported_model_types", "text_config"]
