"""Model shapes: the handful of config numbers the memory model needs, and where they come from.

A decoder-only model is, for memory purposes, a list of identical decoder layers between an
embedding table and an LM head. With

    H  = hidden_size                     L  = num_hidden_layers
    nh = num_attention_heads             nk = num_key_value_heads
    hd = head_dim (hidden_size / nh unless the config says otherwise)
    I  = intermediate_size               V  = vocab_size
    dq = nh * hd                         dk = nk * hd

one layer holds the seven projections

    q: H -> dq    k: H -> dk    v: H -> dk    o: dq -> H
    gate: H -> I  up: H -> I    down: I -> H

i.e. ``H*(2*dq + 2*dk) + 3*H*I`` linear parameters, plus small norm vectors (2 or 4 of size H,
and per-head q/k norms of size hd on Qwen3 / Gemma 3). The embedding table is ``V*H``; the LM head
is another ``V*H`` unless the embeddings are tied. ``attn_softcap`` marks models whose attention
scores are soft-capped (Gemma 2: ``attn_logit_softcapping``), which SDPA cannot express, so their
attention runs an explicit softmax that keeps ``[B, heads, T, T]`` tensors for backward. Which
families have q/k norms, sandwich norms and soft-caps is read from their record in
:mod:`notebookkit.families`, by ``model_type``.

``KNOWN_MODELS`` lists the curated hub checkpoints with the numbers copied from their public
``config.json`` files (text part for multimodal Gemma 3). ``model_shape(x)`` turns a Hugging Face
config, a plain dict, a known name or a local model folder into a :class:`ModelShape`.

A mixture-of-experts model (Qwen3-MoE, gpt-oss: ``Family.moe``) replaces the gate/up/down projections of
each layer by ``E`` experts of width ``I_e`` (``3*H*I_e`` each, stacked ``[E, 2 I_e, H]`` and ``[E, H, I_e]``)
and a router ``[E, H]``, ``k`` experts a token: :meth:`ModelShape.projection_shapes` then lists the four
attention projections only, :meth:`ModelShape.expert_shapes` the two stacked weights, and
:mod:`notebookkit.memory.moe` holds what the experts cost in a training step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from notebookkit.families import for_model_type

PROJECTIONS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """Config numbers of a decoder-only LM that decide its memory use."""

    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # extra post-attention / post-MLP norms (Gemma 2, Gemma 3)
    attention_sinks: bool = False  # a sink logit a head in the softmax (gpt-oss: kernels.attention_sinks)
    max_position_embeddings: int | None = None
    attn_softcap: bool = False  # attention logit soft-cap (Gemma 2): explicit softmax, T^2 scores kept
    num_experts: int = 0  # a mixture of experts: E experts a layer (0: a dense MLP)
    experts_per_token: int = 0  # k
    expert_intermediate_size: int = 0  # I_e, the width of one expert
    router_norm_topk: bool = False  # the k kept routing weights are divided by their sum (norm_topk_prob)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """``{name: (in_features, out_features)}`` for the linear projections of one layer: seven, or the
        four attention ones for a mixture of experts (its MLP is :meth:`expert_shapes`)."""
        H, I, dq, dk = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        shapes = {
            "q_proj": (H, dq),
            "k_proj": (H, dk),
            "v_proj": (H, dk),
            "o_proj": (dq, H),
            "gate_proj": (H, I),
            "up_proj": (H, I),
            "down_proj": (I, H),
        }
        return {n: shapes[n] for n in PROJECTIONS[:4]} if self.num_experts else shapes

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """``{name: (in_features, out_features)}`` of one expert's two stacked weights (``E`` of each a
        layer): ``gate_up_proj`` ``H -> 2 I_e`` and ``down_proj`` ``I_e -> H``; empty for a dense model."""
        if not self.num_experts:
            return {}
        H, Ie = self.hidden_size, self.expert_intermediate_size
        return {"gate_up_proj": (H, 2 * Ie), "down_proj": (Ie, H)}

    @property
    def active_linear_params_per_layer(self) -> int:
        """Linear parameters one token multiplies by in a layer: the attention, ``k`` experts, the router."""
        if not self.num_experts:
            return self.linear_params_per_layer
        attention = sum(i * o for i, o in self.projection_shapes().values())
        return attention + self.experts_per_token * 3 * self.hidden_size * self.expert_intermediate_size \
            + self.num_experts * self.hidden_size

    @property
    def linear_params_per_layer(self) -> int:
        if self.num_experts:  # attention projections + every expert's gate/up/down + the router
            attention = sum(i * o for i, o in self.projection_shapes().values())
            E, H = self.num_experts, self.hidden_size
            return attention + E * 3 * H * self.expert_intermediate_size + E * H
        return sum(i * o for i, o in self.projection_shapes().values())

    @property
    def norm_params_per_layer(self) -> int:
        n = (4 if self.sandwich_norms else 2) * self.hidden_size
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters of a separate LM head (0 when tied to the embeddings)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Total parameter count (tied weights counted once)."""
        return (
            self.num_layers * (self.linear_params_per_layer + self.norm_params_per_layer)
            + self.embedding_params
            + self.lm_head_params
            + self.hidden_size  # final norm
        )

    def describe(self) -> str:
        return (
            f"{self.name} ({self.model_type}): {self.num_params / 1e9:.2f}B params, L={self.num_layers}, "
            f"H={self.hidden_size}, heads={self.num_heads}/{self.num_kv_heads}x{self.head_dim}, "
            f"I={self.intermediate_size}, V={self.vocab_size}, tied={self.tie_word_embeddings}"
            + (f", {self.num_experts} experts of I={self.expert_intermediate_size}, {self.experts_per_token} a token"
               if self.num_experts else "")
        )


def _shape(name, model_type, H, L, nh, nk, hd, I, V, tied, max_pos, attn_softcap=None, experts=None) -> ModelShape:
    """A :class:`ModelShape` whose norms and soft-cap follow the family record of ``model_type``.

    ``attn_softcap``: whether the config soft-caps attention scores, ``None`` when it does not say
    (then the family's default decides, :attr:`~notebookkit.families.Family.default_attn_softcap`).
    ``experts``: ``(E, k, I_e, norm_topk_prob)`` of a mixture of experts.
    """
    family = for_model_type(model_type, multimodal=True)
    if attn_softcap is None:
        attn_softcap = family is not None and family.default_attn_softcap is not None
    return ModelShape(
        name=name, model_type=model_type, hidden_size=H, num_layers=L, num_heads=nh, num_kv_heads=nk,
        head_dim=hd, intermediate_size=I, vocab_size=V, tie_word_embeddings=tied,
        qk_norm=family is not None and family.qk_norm,
        sandwich_norms=family is not None and family.sandwich_norm,
        attention_sinks=family is not None and family.attention_sinks,
        max_position_embeddings=max_pos, attn_softcap=bool(attn_softcap),
        **(dict(zip(("num_experts", "experts_per_token", "expert_intermediate_size", "router_norm_topk"), experts))
           if experts else {}),
    )


# Numbers from the public config.json of each checkpoint (instruct and base share them).
#            name                                   type        H     L   nh  nk  hd    I      V       tied   max_pos
_ROWS = [
    ("meta-llama/Llama-3.2-1B-Instruct",       "llama",   2048, 16, 32, 8, 64,  8192, 128256, True,  131072),
    ("meta-llama/Llama-3.2-1B",                "llama",   2048, 16, 32, 8, 64,  8192, 128256, True,  131072),
    ("meta-llama/Llama-3.2-3B-Instruct",       "llama",   3072, 28, 24, 8, 128, 8192, 128256, True,  131072),
    ("meta-llama/Llama-3.2-3B",                "llama",   3072, 28, 24, 8, 128, 8192, 128256, True,  131072),
    ("meta-llama/Llama-3.1-8B-Instruct",       "llama",   4096, 32, 32, 8, 128, 14336, 128256, False, 131072),
    ("meta-llama/Llama-3.1-8B",                "llama",   4096, 32, 32, 8, 128, 14336, 128256, False, 131072),
    ("meta-llama/Llama-3.1-70B-Instruct",      "llama",   8192, 80, 64, 8, 128, 28672, 128256, False, 131072),
    ("meta-llama/Llama-3.1-70B",               "llama",   8192, 80, 64, 8, 128, 28672, 128256, False, 131072),
    ("Qwen/Qwen3-0.6B",                        "qwen3",   1024, 28, 16, 8, 128, 3072, 151936, True,  40960),
    ("Qwen/Qwen3-1.7B",                        "qwen3",   2048, 28, 16, 8, 128, 6144, 151936, True,  40960),
    ("Qwen/Qwen3-4B",                          "qwen3",   2560, 36, 32, 8, 128, 9728, 151936, True,  40960),
    ("Qwen/Qwen3-8B",                          "qwen3",   4096, 36, 32, 8, 128, 12288, 151936, False, 40960),
    ("google/gemma-2-2b-it",                   "gemma2",  2304, 26, 8, 4, 256,  9216, 256000, True,  8192),
    ("google/gemma-2-9b-it",                   "gemma2",  3584, 42, 16, 8, 256, 14336, 256000, True,  8192),
    ("google/gemma-3-1b-it",                   "gemma3_text", 1152, 26, 4, 1, 256, 6912, 262144, True, 32768),
    ("google/gemma-3-4b-it",                   "gemma3_text", 2560, 34, 8, 4, 256, 10240, 262208, True, 131072),
    ("mistralai/Mistral-7B-Instruct-v0.3",     "mistral", 4096, 32, 32, 8, 128, 14336, 32768, False, 32768),
    ("mistralai/Mistral-7B-v0.3",              "mistral", 4096, 32, 32, 8, 128, 14336, 32768, False, 32768),
]

# Mixtures of experts: the same columns (I: the config's intermediate_size, which Qwen3-MoE does not use), then
#            experts E, a token k, expert width I_e, norm_topk_prob
_MOE_ROWS = [
    ("Qwen/Qwen3-30B-A3B",                     "qwen3_moe", 2048, 48, 32, 4, 128, 6144, 151936, False, 40960,
     None, (128, 8, 768, True)),
    ("openai/gpt-oss-20b",                     "gpt_oss", 2880, 24, 64, 8, 64, 2880, 201088, False, 131072,
     None, (32, 4, 2880, False)),
    # its 16-bit copy (the same config, no MXFP4 quantization_config): what load_in_4bit streams into NF4 experts
    ("unsloth/gpt-oss-20b-BF16",               "gpt_oss", 2880, 24, 64, 8, 64, 2880, 201088, False, 131072,
     None, (32, 4, 2880, False)),
]

KNOWN_MODELS: dict[str, ModelShape] = {row[0]: _shape(*row) for row in _ROWS + _MOE_ROWS}


def known_shape(name: str) -> ModelShape | None:
    if name in KNOWN_MODELS:
        return KNOWN_MODELS[name]
    low = name.lower()
    for key, shape in KNOWN_MODELS.items():
        if key.lower() == low or key.split("/", 1)[1].lower() == low.split("/")[-1]:
            return shape
    return None


def config_value(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def shape_from_config(cfg: Any, name: str | None = None) -> ModelShape:
    """Read a :class:`ModelShape` from a Hugging Face config object or a config dict."""
    tied_outer = config_value(cfg, "tie_word_embeddings")
    text = config_value(cfg, "text_config")
    if text is not None and config_value(cfg, "hidden_size") is None:
        cfg = text
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
               if config_value(cfg, k) is None]
    if missing:
        raise ValueError(
            f"notebookkit.memory: this model config lacks {missing}; the memory model needs a decoder-only "
            "LM config (hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size)."
        )
    H = int(config_value(cfg, "hidden_size"))
    nh = int(config_value(cfg, "num_attention_heads"))
    nk = config_value(cfg, "num_key_value_heads") or nh
    hd = config_value(cfg, "head_dim") or H // nh
    model_type = str(config_value(cfg, "model_type", "llama") or "llama")
    tied = config_value(cfg, "tie_word_embeddings")
    family = for_model_type(model_type, multimodal=True)
    if tied is None:  # the config class's default: the family's, or Gemma's for another Gemma variant
        default = family.tied_embeddings if family is not None else model_type.startswith("gemma")
        tied = tied_outer if tied_outer is not None else default
    softcap_attr = (family.attn_softcap_attr if family is not None else None) or "attn_logit_softcapping"
    _missing = object()
    softcap = config_value(cfg, softcap_attr, _missing)
    experts = {}
    if family is not None and family.moe is not None:
        # a saved config.json may spell E either way (transformers 5 writes Qwen3-MoE's as num_local_experts)
        count = next((config_value(cfg, key) for key in (family.moe.num_experts, "num_local_experts", "num_experts")
                      if config_value(cfg, key)), 0)
        experts = dict(num_experts=int(count or 0),
                       experts_per_token=int(config_value(cfg, "num_experts_per_tok", 0) or 0),
                       expert_intermediate_size=int(config_value(cfg, family.moe.intermediate, 0) or 0),
                       router_norm_topk=bool(config_value(cfg, "norm_topk_prob", False)))
    shape = _shape(
        name or str(config_value(cfg, "_name_or_path", "") or config_value(cfg, "name_or_path", "") or model_type),
        model_type, H, int(config_value(cfg, "num_hidden_layers")), nh, int(nk), int(hd),
        int(config_value(cfg, "intermediate_size")), int(config_value(cfg, "vocab_size")), bool(tied),
        config_value(cfg, "max_position_embeddings"),
        attn_softcap=None if softcap is _missing else softcap is not None,
    )
    return replace(shape, **experts) if experts else shape


def model_shape(model_config: Any) -> ModelShape:
    """Turn what a user has into a :class:`ModelShape`.

    Accepts a :class:`ModelShape`, a Hugging Face ``PretrainedConfig``, a model (its ``.config``), a
    config ``dict``, a curated hub name from :data:`KNOWN_MODELS`, or a local folder with a
    ``config.json``. Other hub names are looked up with ``transformers.AutoConfig`` (which needs the
    network or the local Hugging Face cache).
    """
    if isinstance(model_config, ModelShape):
        return model_config
    if isinstance(model_config, (str, os.PathLike)):
        name = str(model_config)
        known = known_shape(name)
        if known is not None:
            return known
        path = Path(name).expanduser()
        if (path / "config.json").is_file():
            return shape_from_config(json.loads((path / "config.json").read_text()), name=name)
        try:
            from transformers import AutoConfig

            return shape_from_config(AutoConfig.from_pretrained(name), name=name)
        except Exception as exc:  # network off, gated repo, typo
            raise ValueError(
                f"notebookkit.memory: cannot read the config of {name!r} ({type(exc).__name__}: {exc}). "
                f"Pass a config dict or transformers config instead, a local model folder, or one of the "
                f"curated names: {', '.join(KNOWN_MODELS)}."
            ) from exc
    cfg = getattr(model_config, "config", None)
    if cfg is not None and not isinstance(model_config, Mapping) and config_value(model_config, "hidden_size") is None:
        return shape_from_config(cfg)
    return shape_from_config(model_config)


def resolve_attention(shape: ModelShape, attention: str | None = "auto") -> str:
    """The attention path the fused model runs: ``"eager"`` (explicit softmax) for soft-capped
    attention (Gemma 2), else ``"sdpa"``; an explicit ``"sdpa"``/``"flash"``/``"eager"`` is kept."""
    key = "auto" if attention is None else str(attention).lower()
    if key == "auto":
        return "eager" if shape.attn_softcap else "sdpa"
    if key in ("sdpa", "flash", "flash_attention_2", "eager"):
        return "eager" if key == "eager" else "sdpa"
    raise ValueError(f"notebookkit.memory: unknown attention {attention!r}; use 'auto', 'sdpa', 'flash' or 'eager'.")
