"""The one architecture table: which fused pieces a Hugging Face ``model_type`` gets.

Adding a family is one row here plus its tests. Every row describes facts of the architecture that
the patcher needs and cannot safely guess from module names:

* ``activation``: gate activation of the gated MLP, ``down(act(gate(x)) * up(x))``:
  ``"swiglu"`` (SiLU), ``"geglu"`` (exact erf GELU) or ``"geglu_tanh"`` (tanh-approximated GELU).
  The config's own ``hidden_act`` / ``hidden_activation`` wins when it names one of these.
* ``gemma_norm``: RMSNorm with a unit offset computed in fp32,
  ``y = (x * rstd * (1 + w)).to(dtype)`` (Gemma), instead of ``y = (x * rstd).to(dtype) * w`` (Llama).
* ``qk_norm``: RMSNorm over the head dimension applied to queries and keys before RoPE
  (Qwen3, Gemma3).
* ``sandwich_norm``: extra norms after attention and after the MLP (Gemma2/3). The decoder layer
  of Hugging Face keeps that wiring; we only swap the norm's forward.
* ``scaled_embedding``: token embeddings multiplied by ``sqrt(hidden_size)`` (Gemma family). The
  model's own embedding module does it; the row documents it for the banner and the memory model.
* ``attn_softcap_attr`` / ``final_softcap_attr``: config attributes holding ``c`` of the soft-cap
  ``c * tanh(s / c)`` on attention scores and on the final logits (Gemma2, Gemma3 when set).
* ``sliding_window``: the config may set a sliding window on some layers; Hugging Face builds the
  per-layer masks and hands each attention the right one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

_ACT_NAMES = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu": "geglu",
    "gelu_pytorch_tanh": "geglu_tanh",
    "gelu_new": "geglu_tanh",
    "gelu_fast": "geglu_tanh",
    "gelu_tanh": "geglu_tanh",
}


@dataclass(frozen=True)
class ArchSpec:
    """What the patcher needs to know about one model family."""

    family: str
    activation: str = "swiglu"
    gemma_norm: bool = False
    qk_norm: bool = False
    sandwich_norm: bool = False
    scaled_embedding: bool = False
    attn_softcap_attr: Optional[str] = None
    final_softcap_attr: Optional[str] = None
    sliding_window: bool = False
    rope_style: str = "rotate_half"


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama"),
    "mistral": ArchSpec("mistral", sliding_window=True),
    "qwen2": ArchSpec("qwen2", sliding_window=True),
    "qwen3": ArchSpec("qwen3", qk_norm=True, sliding_window=True),
    "gemma": ArchSpec("gemma", activation="geglu_tanh", gemma_norm=True, scaled_embedding=True),
    "gemma2": ArchSpec(
        "gemma2",
        activation="geglu_tanh",
        gemma_norm=True,
        sandwich_norm=True,
        scaled_embedding=True,
        attn_softcap_attr="attn_logit_softcapping",
        final_softcap_attr="final_logit_softcapping",
        sliding_window=True,
    ),
    "gemma3_text": ArchSpec(
        "gemma3",
        activation="geglu_tanh",
        gemma_norm=True,
        qk_norm=True,
        sandwich_norm=True,
        scaled_embedding=True,
        attn_softcap_attr="attn_logit_softcapping",
        final_softcap_attr="final_logit_softcapping",
        sliding_window=True,
    ),
}


def lookup(config: Any) -> Optional[ArchSpec]:
    """The table row for a Hugging Face config, or ``None``.

    The top-level ``model_type`` decides: a multimodal wrapper (``"gemma3"`` with a vision tower)
    is not a row, so it stays entirely on stock code rather than being half-patched.
    """
    return ARCHITECTURES.get(getattr(config, "model_type", None))


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


def activation_of(act_fn: Any, config: Any = None, spec: Optional[ArchSpec] = None) -> Optional[str]:
    """The fused activation matching an MLP's ``act_fn`` module (read from the loaded instance).

    Falls back to the config's ``hidden_activation`` / ``hidden_act`` string, then to the table row.
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
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        act = getattr(text_config, "hidden_activation", None) or getattr(text_config, "hidden_act", None)
        if act is not None:
            return _ACT_NAMES.get(str(act))
    return spec.activation if spec is not None else None


def attn_softcap(config: Any, spec: ArchSpec) -> Optional[float]:
    """Attention-score soft-cap ``c`` (``None`` when the family or config has none)."""
    if spec.attn_softcap_attr is None:
        return None
    value = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, spec.attn_softcap_attr, None)
    return float(value) if value else None


def final_softcap(config: Any, spec: Optional[ArchSpec]) -> Optional[float]:
    """Final-logit soft-cap ``c`` (``None`` when the family or config has none)."""
    if spec is None or spec.final_softcap_attr is None:
        return None
    value = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, spec.final_softcap_attr, None)
    return float(value) if value else None


def supported_model_types() -> list[str]:
    """The ``model_type`` values that run on the fused path."""
    return sorted(ARCHITECTURES)
