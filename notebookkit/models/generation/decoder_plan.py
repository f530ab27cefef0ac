"""What the cached forward reads from a loaded model, once: its modules and its family's facts.

A :class:`DecoderPlan` holds, for a causal LM of a family in :mod:`notebookkit.families` (or the
language model of a vision-language wrapper of the family record: the decode steps are its):

* the token embedding module and whether the hidden states still need ``* sqrt(hidden_size)``
  after it (Gemma family: transformers 5 scales inside the embedding module, ``embed_scale``;
  earlier versions in the backbone's forward: :func:`embedding_scale` decides, and
  tests/models/generation/test_cached_forward.py proves it by equality with the layer-0 input);
* per decoder layer (:class:`LayerPlan`): the layer and its attention module, heads, scaling
  (``query_pre_attn_scalar ** -0.5`` for Gemma 2/3, read from the module), the attention soft-cap,
  its sliding window (the module's ``sliding_window``; Mistral's config one for every layer; gpt-oss:
  every other layer), q/k norms, sandwich norms, the attention sinks (gpt-oss: the module's ``sinks``,
  one logit a query head), which RoPE table it reads, and for a mixture of experts whether its MLP is
  the family's sparse block (``moe``: Qwen3-MoE may keep dense MLPs on some layers, ``mlp_only_layers``);
* which norms the decode step runs fused with the residual add in front of them (:class:`FusedNorm`,
  :mod:`notebookkit.kernels.add_rms_norm`): the layer's input and pre-MLP norms and the final norm, when
  they are plain RMSNorm modules (:func:`~notebookkit.models.patching.patch_norms.is_rms_norm`, the epsilon
  read as the patcher reads it, the flavour from the family's ``norm``) and the family has no sandwich
  norms (Gemma 2/3: a post-norm sits between the block and the add);
* the RoPE tables (:class:`RopeTables`): ``cos``/``sin`` ``[positions, head_dim]`` computed by the
  model's own rotary embedding for positions ``0 .. n - 1`` (Llama 3.1 scaling, Gemma 3's local base
  on sliding layers: whatever that module computes), gathered per row and step afterwards; a module
  that hands back half-width tables (gpt-oss: ``[positions, head_dim / 2]``, applied to the two halves
  of a head as ``(x1 cos - x2 sin, x2 cos + x1 sin)``) has them repeated to full width, which is the
  same rotation in the rotate-half layout the RoPE kernel takes;
* the final norm, the LM head and the final-logit soft-cap.

:func:`plan_for` says why a model cannot be planned (family not in the table, rotary embeddings that
recompute their frequencies from the sequence length, ...); the caller then uses Hugging Face's
``generate``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn

from notebookkit.families import Family, MoE, for_vision_model_type

from ..common import architectures
from ..common.decoder_layers import decoder_layers
from ..patching.moe_routing import router_ready
from ..patching.patch_norms import is_rms_norm, rms_norm_eps
from ..patching.patch_moe import STACKED, is_moe_block, unwrap_experts

__all__ = ["DecoderPlan", "FusedNorm", "LayerPlan", "RopeTables", "embedding_scale", "fused_norm", "plan_for",
           "causal_lm_of"]

_DYNAMIC_ROPE = ("dynamic", "longrope")


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The Hugging Face ``*ForCausalLM`` inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@dataclass(frozen=True)
class FusedNorm:
    """An RMSNorm the decode step runs together with the residual add in front of it
    (:func:`notebookkit.kernels.add_rms_norm.add_rms_norm`: ``s = h + a``, ``y = norm(s)`` in one kernel).

    ``module`` is read at each call (its ``weight`` may be moved or reloaded); ``eps`` and ``flavour``
    (``Family.norm``) are the ones the patcher gives the module's own forward."""

    module: nn.Module
    eps: float
    flavour: str


def fused_norm(module: Optional[nn.Module], family: Family) -> Optional[FusedNorm]:
    """``module`` as a :class:`FusedNorm` when the decode step may fuse it with its residual add, else ``None``
    (module docstring: plain RMSNorm, no sandwich norms)."""
    if module is None or family.sandwich_norm or not is_rms_norm(module):
        return None
    return FusedNorm(module=module, eps=rms_norm_eps(module), flavour=family.norm)


@dataclass
class LayerPlan:
    """One decoder layer as the cached forward runs it."""

    index: int
    layer: nn.Module
    attn: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    softcap: Optional[float]
    window: Optional[int]
    rope_key: str
    qk_norm: bool
    sandwich: bool
    activation: Optional[str]  # the gated MLP's fused activation ("swiglu", "geglu_tanh", ...), None if none
    moe: Optional[MoE] = None  # the family's sparse-block layout when this layer's MLP is one (else a dense MLP)
    sinks: Optional[torch.Tensor] = None  # [heads] learned logits in each softmax's denominator (gpt-oss)
    input_norm: Optional[FusedNorm] = None  # input_layernorm, fused with the previous layer's MLP residual add
    mlp_norm: Optional[FusedNorm] = None  # the pre-MLP norm, fused with the attention residual add

    @property
    def pre_mlp_norm(self) -> nn.Module:
        """The norm in front of the MLP: ``pre_feedforward_layernorm`` with sandwich norms (Gemma 2/3),
        ``post_attention_layernorm`` otherwise (Llama's name for the same place)."""
        return self.layer.pre_feedforward_layernorm if self.sandwich else self.layer.post_attention_layernorm


class RopeTables:
    """``cos``/``sin`` of every position, per RoPE kind, computed by the model's rotary embedding.

    ``sources[key](x, position_ids)`` is the model's own call for that kind (``x`` gives the dtype and
    device, as in Hugging Face). The tables grow (are recomputed) when a longer cache needs them;
    :meth:`lookup` only gathers rows, so it is graph-safe.
    """

    def __init__(self, sources: dict[str, Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]):
        self.sources = sources
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.length = 0
        self.dtype: Optional[torch.dtype] = None
        self.device: Optional[torch.device] = None

    def ensure(self, length: int, dtype: torch.dtype, device: torch.device) -> None:
        """Tables for positions ``0 .. length - 1`` in ``dtype`` on ``device`` (recomputed when shorter)."""
        if length <= self.length and dtype == self.dtype and torch.device(device) == self.device:
            return
        probe = torch.empty(1, 1, dtype=dtype, device=device)
        positions = torch.arange(length, device=device)[None]
        with torch.no_grad():
            self.tables = {key: tuple(t[0].contiguous() for t in source(probe, positions))
                           for key, source in self.sources.items()}
        self.length, self.dtype, self.device = length, dtype, torch.device(device)

    def lookup(self, key: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, T, D]`` of ``positions`` ``[B, T]``."""
        cos, sin = self.tables[key]
        return cos[positions], sin[positions]

    def release(self) -> None:
        self.tables, self.length = {}, 0


@dataclass
class DecoderPlan:
    """A causal LM as :func:`~.cached_forward.cached_forward` runs it (see the module docstring)."""

    family: Family
    embed: nn.Module
    embed_scale: Optional[float]
    layers: list[LayerPlan]
    final_norm: nn.Module
    lm_head: nn.Module
    final_softcap: Optional[float]
    rope: RopeTables
    vocab_size: int
    windows: tuple[Optional[int], ...] = field(default=())
    final_fused: Optional[FusedNorm] = None  # the final norm, fused with the last MLP residual add (T == 1 only)

    @property
    def kv_heads(self) -> int:
        return self.layers[0].kv_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].head_dim

    def hidden_dtype(self) -> torch.dtype:
        """dtype of the hidden states (and so of the KV cache): the final norm's, the model's own 16-bit dtype
        (an embedding table being trained under fp16 is an fp32 master weight that hands back fp16 rows:
        :mod:`notebookkit.models.patching.master_weights`)."""
        return self.final_norm.weight.dtype

    def device(self) -> torch.device:
        return self.embed.weight.device


def embedding_scale(embed: nn.Module, family: Family, hidden_size: int) -> Optional[float]:
    """The factor the backbone still multiplies the embeddings by, or ``None``.

    Gemma-family models multiply token embeddings by ``sqrt(hidden_size)``. A module with an
    ``embed_scale`` (transformers 5's ``*ScaledWordEmbedding``) already does it in its own forward;
    otherwise (a plain ``nn.Embedding``, transformers 4) the backbone's forward did it, so we do too.
    """
    if not family.scaled_embedding or hasattr(embed, "embed_scale"):
        return None
    return float(hidden_size) ** 0.5


def _rope_sources(backbone: nn.Module, config: Any, n_layers: int) -> tuple[list[str], dict[str, Callable]]:
    """Per layer the key of its RoPE table, and per key the model's call that computes it."""
    rotary = backbone.rotary_emb
    layer_types = list(getattr(config, "layer_types", None) or [])
    if layer_types and "layer_type" in inspect.signature(rotary.forward).parameters:
        keys = [layer_types[i] for i in range(n_layers)]

        def by_type(kind: str) -> Callable:
            return lambda x, pos: rotary(x, pos, layer_type=kind)

        return keys, {kind: by_type(kind) for kind in sorted(set(keys))}
    local = getattr(backbone, "rotary_emb_local", None)
    if layer_types and local is not None:  # transformers 4: a second module for the sliding layers
        keys = ["local" if layer_types[i] == "sliding_attention" else "global" for i in range(n_layers)]
        return keys, {"local": local, "global": rotary}
    return ["default"] * n_layers, {"default": rotary}


def _on_three_axes(rotary: Callable) -> Callable:
    """A multimodal rotary module called with one position per token on all three axes (time, height,
    width): what every token generated after the prompt has, each at its ``rope_deltas`` offset. Some
    transformers versions expand ``[B, T]`` positions to the axes themselves, others require ``[3, B, T]``."""

    def source(x: torch.Tensor, positions: torch.Tensor):
        return rotary(x, positions.expand(3, *positions.shape))

    return source


def _rope_problem(backbone: nn.Module) -> Optional[str]:
    modules = [m for m in (getattr(backbone, "rotary_emb", None), getattr(backbone, "rotary_emb_local", None)) if m]
    if not modules:
        return f"{type(backbone).__name__} has no rotary_emb"
    for module in modules:
        kinds = getattr(module, "rope_type", "default")
        for kind in (kinds.values() if isinstance(kinds, dict) else [kinds]):
            if kind in _DYNAMIC_ROPE:
                return f"rope_type {kind!r} recomputes its frequencies from the sequence length"
    return None


def _full_width(source: Callable, head_dim: int) -> Callable:
    """``source`` with half-width tables (gpt-oss's rotary embedding) repeated to ``head_dim`` (module docstring)."""

    def full(x: torch.Tensor, positions: torch.Tensor):
        cos, sin = source(x, positions)
        if cos.shape[-1] * 2 == head_dim:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return cos, sin

    return full


def _sparse_block_problem(layer: nn.Module, moe: MoE) -> Optional[str]:
    """Why the cached forward cannot run ``layer``'s sparse block (``None``: it can)."""
    reason = router_ready(getattr(layer.mlp, moe.router, None), moe.router_bias)
    if reason is not None:
        return reason
    base, _ = unwrap_experts(getattr(layer.mlp, moe.experts, nn.Module()))
    missing = [n for n in STACKED if not isinstance(getattr(base, n, None), torch.Tensor)]
    return f"{type(base).__name__} has no stacked {', '.join(missing)}" if missing else None


def _window_of(attn: nn.Module, config: Any) -> Optional[int]:
    """The sliding window of one attention layer (``None``: full attention), as Hugging Face masks it."""
    if hasattr(attn, "sliding_window"):  # Qwen2/3, Gemma 2/3: None on full-attention layers
        window = attn.sliding_window
    else:  # Mistral: the config's window on every layer
        window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def plan_for(model: nn.Module) -> Union[DecoderPlan, str]:
    """The :class:`DecoderPlan` of ``model`` (PEFT-wrapped or not), or the reason it has none."""
    causal_lm = causal_lm_of(model)
    config = architectures.text_config(causal_lm.config)
    family = architectures.lookup(causal_lm.config)
    backbone = getattr(causal_lm, "model", None)
    mrope = False
    if family is None:  # a vision-language wrapper: the decode steps are its language model's
        family = for_vision_model_type(getattr(causal_lm.config, "model_type", None))
        backbone = getattr(backbone, "language_model", None)
        mrope = family is not None and family.vision.rope == "mrope"
    if family is None:
        return (f"model_type {getattr(causal_lm.config, 'model_type', '?')!r} is not in notebookkit's family table "
                f"({', '.join(architectures.supported_model_types())})")
    layers = decoder_layers(causal_lm)
    if backbone is None or not layers:
        return f"{type(causal_lm).__name__} has no decoder layers where notebookkit looks for them"
    problem = _rope_problem(backbone)
    if problem is not None:
        return problem
    lm_head = causal_lm.get_output_embeddings()
    embed = causal_lm.get_input_embeddings()
    if lm_head is None or embed is None or not hasattr(embed, "weight"):
        return "the model has no input embedding or LM head module"
    keys, sources = _rope_sources(backbone, config, len(layers))
    if mrope:
        sources = {key: _on_three_axes(source) for key, source in sources.items()}
    head_dim = int(getattr(layers[0].self_attn, "head_dim", 0) or 0)
    sources = {key: _full_width(source, head_dim) for key, source in sources.items()}
    softcap = architectures.attn_softcap(causal_lm.config, family)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    plans = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"):
            if not hasattr(attn, name):
                return f"{type(attn).__name__} has no {name}"
        if family.qk_norm and not (hasattr(attn, "q_norm") and hasattr(attn, "k_norm")):
            return f"{type(attn).__name__}: q/k norms expected but not found"
        sparse = family.moe is not None and is_moe_block(getattr(layer, "mlp", None), family.moe)
        if sparse:
            problem = _sparse_block_problem(layer, family.moe)
            if problem is not None:
                return f"layer {i}'s sparse block: {problem}"
        sinks = getattr(attn, "sinks", None)
        plans.append(LayerPlan(
            index=i, layer=layer, attn=attn, heads=int(config.num_attention_heads), kv_heads=kv_heads,
            head_dim=int(attn.head_dim), scaling=float(attn.scaling), softcap=softcap,
            window=_window_of(attn, config), rope_key=keys[i], qk_norm=family.qk_norm,
            sandwich=family.sandwich_norm,
            activation=None if sparse else architectures.activation_of(getattr(layer.mlp, "act_fn", None),
                                                                       causal_lm.config, family),
            moe=family.moe if sparse else None, sinks=sinks if isinstance(sinks, torch.Tensor) else None,
            input_norm=fused_norm(getattr(layer, "input_layernorm", None), family),
            mlp_norm=fused_norm(getattr(layer, "post_attention_layernorm", None), family),
        ))
    return DecoderPlan(
        family=family, embed=embed, embed_scale=embedding_scale(embed, family, int(config.hidden_size)),
        layers=plans, final_norm=backbone.norm, lm_head=lm_head,
        final_softcap=architectures.final_softcap(causal_lm.config, family), rope=RopeTables(sources),
        vocab_size=int(lm_head.weight.shape[0]), windows=tuple(sorted({p.window for p in plans}, key=lambda w: w or 0)),
        final_fused=fused_norm(backbone.norm, family),
    )
