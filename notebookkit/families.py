"""The model families notebookkit supports: one record per family, read by every layer.

Adding a family is one :class:`Family` row in :data:`FAMILIES` plus its tests; everything that
depends on a family reads the row:

* the patcher (:mod:`notebookkit.models.patcher`, through :mod:`notebookkit.models.architectures`):
  which fused pieces a loaded model gets, looked up by the Hugging Face ``model_type``;
* the memory model (:mod:`notebookkit.memory.shapes`): q/k norms, sandwich norms and whether
  attention is soft-capped (an explicit softmax that keeps ``[B, heads, T, T]`` scores);
* the embedded default (:mod:`notebookkit.embedded`): the config class and settings of
  ``notebookkit/tiny-<name>`` and its tokenizer's special tokens;
* the chat templates (:mod:`notebookkit.data.chat_templates`): the format a family's name picks;
* the widget catalogue (:mod:`notebookkit.widgets.catalog`) and the test helpers.

``tests/test_families.py`` fails when a row lacks any of these consumers.

The architecture facts of a row are what the patcher needs and cannot safely guess from module
names:

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
  ``c * tanh(s / c)`` on attention scores and on the final logits (Gemma2, Gemma3 when set);
  ``default_attn_softcap`` is the value a config of the family has when it does not say.
* ``query_pre_attn_scalar``: attention scores are scaled by ``query_pre_attn_scalar ** -0.5``, a
  config number, instead of ``head_dim ** -0.5`` (Gemma2/3); the tiny and test models set it to
  their head dimension.
* ``sliding_window``: the config may set a sliding window on some layers; Hugging Face builds the
  per-layer masks and hands each attention the right one.

This module imports nothing (no torch, no transformers), so every layer can read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class TinyRecipe:
    """How the embedded default builds ``notebookkit/tiny-<name>`` (:mod:`notebookkit.embedded`).

    The body every tiny model shares (hidden size, heads, MLP width, vocabulary, positions) is the
    builder's; a recipe adds the family's own part: the number of decoder layers, tied embeddings,
    the RoPE base (``local_rope_theta``: a second base for the sliding-window layers, Gemma 3) and
    optional scaling, and ``config``, further config arguments passed as they are. ``pretrained``
    models get a short pre-training on the bundled corpus; the others keep seeded random weights.
    """

    layers: int = 2
    tie_word_embeddings: bool = True
    rope_theta: float = 1000000.0
    rope_scaling: Optional[Mapping[str, Any]] = field(default=None, hash=False)
    local_rope_theta: Optional[float] = None
    pretrained: bool = False
    config: Mapping[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Family:
    """Everything notebookkit knows about one model family (see the module docstring)."""

    name: str  # canonical name: notebookkit/tiny-<name>, test ids, the catalogue
    model_types: tuple[str, ...]  # Hugging Face model_type(s) of the causal LM, the ones patched
    config_class: str  # the transformers config class of that model_type
    chat_template: str  # the notebookkit.data.chat_templates format of the family
    tokens: str  # the tiny tokenizer's special-token set (notebookkit.embedded.generate_tokenizer)
    tiny: TinyRecipe
    activation: str = "swiglu"
    gemma_norm: bool = False
    qk_norm: bool = False
    sandwich_norm: bool = False
    scaled_embedding: bool = False
    attn_softcap_attr: Optional[str] = None
    final_softcap_attr: Optional[str] = None
    default_attn_softcap: Optional[float] = None
    query_pre_attn_scalar: bool = False
    sliding_window: bool = False
    rope_style: str = "rotate_half"
    # multimodal wrappers whose text model is this family: the memory model reads their shapes,
    # the patcher leaves them on stock code (never half-patched)
    multimodal_model_types: tuple[str, ...] = ()

    @property
    def tiny_name(self) -> str:
        """The reserved name of the family's tiny default model."""
        return f"notebookkit/tiny-{self.name}"


_GEMMA_TANH = {"hidden_activation": "gelu_pytorch_tanh"}
_ALTERNATING = {"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"]}

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family(
        "llama", ("llama",), "LlamaConfig", chat_template="llama-3", tokens="llama",
        tiny=TinyRecipe(
            layers=4, pretrained=True, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 256},
            config={"rms_norm_eps": 1e-5},
        ),
    ),
    Family(
        "mistral", ("mistral",), "MistralConfig", chat_template="mistral", tokens="mistral", sliding_window=True,
        tiny=TinyRecipe(tie_word_embeddings=False, config={"rms_norm_eps": 1e-5, "sliding_window": 1024}),
    ),
    Family(
        "qwen2", ("qwen2",), "Qwen2Config", chat_template="qwen-2.5", tokens="qwen2", sliding_window=True,
        tiny=TinyRecipe(config={"rms_norm_eps": 1e-6, "use_sliding_window": False}),
    ),
    Family(
        "qwen3", ("qwen3",), "Qwen3Config", chat_template="qwen-3", tokens="qwen3", qk_norm=True,
        sliding_window=True,
        tiny=TinyRecipe(config={"rms_norm_eps": 1e-6, "use_sliding_window": False, "attention_bias": False}),
    ),
    Family(
        "gemma", ("gemma",), "GemmaConfig", chat_template="gemma", tokens="gemma", activation="geglu_tanh",
        gemma_norm=True, scaled_embedding=True,
        tiny=TinyRecipe(rope_theta=10000.0,
                        config={"rms_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh", **_GEMMA_TANH}),
    ),
    Family(
        "gemma2", ("gemma2",), "Gemma2Config", chat_template="gemma", tokens="gemma", activation="geglu_tanh",
        gemma_norm=True, sandwich_norm=True, scaled_embedding=True,
        attn_softcap_attr="attn_logit_softcapping", final_softcap_attr="final_logit_softcapping",
        default_attn_softcap=50.0, query_pre_attn_scalar=True, sliding_window=True,
        tiny=TinyRecipe(rope_theta=10000.0, config={
            "rms_norm_eps": 1e-6, **_GEMMA_TANH, **_ALTERNATING,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        }),
    ),
    Family(
        "gemma3", ("gemma3_text",), "Gemma3TextConfig", chat_template="gemma-3", tokens="gemma",
        activation="geglu_tanh", gemma_norm=True, qk_norm=True, sandwich_norm=True, scaled_embedding=True,
        attn_softcap_attr="attn_logit_softcapping", final_softcap_attr="final_logit_softcapping",
        query_pre_attn_scalar=True, sliding_window=True, multimodal_model_types=("gemma3",),
        tiny=TinyRecipe(local_rope_theta=10000.0, config={
            "rms_norm_eps": 1e-6, **_GEMMA_TANH, **_ALTERNATING,
            "attn_logit_softcapping": None, "final_logit_softcapping": None,
        }),
    ),
)}

_BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.model_types}
_BY_WRAPPER_TYPE: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.multimodal_model_types}


def family(name: str) -> Family:
    """The record of family ``name`` (``"llama"``, ``"gemma3"``, ...); a readable error otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"Unknown model family {name!r}; the supported families are: {', '.join(FAMILIES)}.") from None


def for_model_type(model_type: Any, multimodal: bool = False) -> Optional[Family]:
    """The family whose causal LM has Hugging Face ``model_type``, or ``None``.

    With ``multimodal=True`` a multimodal wrapper's ``model_type`` (``"gemma3"``) names the family
    of its text model too (the memory model wants its shape; the patcher does not patch it).
    """
    found = _BY_MODEL_TYPE.get(model_type)
    if found is None and multimodal:
        found = _BY_WRAPPER_TYPE.get(model_type)
    return found


def supported_model_types() -> list[str]:
    """The ``model_type`` values that run on the fused path."""
    return sorted(_BY_MODEL_TYPE)
