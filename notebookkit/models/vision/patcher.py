"""Patch a loaded vision-language wrapper onto the fused kernels (and back, with ``unpatch_model``).

The wrapper's row in :mod:`notebookkit.families` (``Family.vision``) says where its parts live.
What runs fused:

* the **language decoder** (``vision.language_model``), exactly as a text model of its family on
  the FastLanguageModel path: every RMSNorm on ``kernels.rms_norm``, every gated MLP on the fused
  activation / ``lora_mlp``, every self-attention on fused LoRA QKV/O + the RoPE kernel + SDPA.
  Qwen2.5-VL's multimodal rotary embedding ("mrope") needs nothing of its own: the model's rotary
  module turns the ``[3, B, T]`` time / height / width positions into one per-token
  ``[B, T, head_dim]`` cos/sin table (each section of the frequencies rotated by its own axis),
  and the RoPE kernel applies any per-token table. That is checked on the loaded model (a
  transformers whose rotary module returned the three tables separately would keep the attention
  on stock code, and the banner would say so);
* the **LM head** in training with labels: the fused linear cross-entropy (:mod:`.lm_head`);
* the **vision tower** where the same kernels apply: its RMSNorms (Qwen2.5-VL's blocks and merger,
  Gemma 3's projector norm) and its gated SiLU MLPs (Qwen2.5-VL's, whose frozen biases the fused
  ``kernels.lora_mlp`` adds inside: one autograd function a block, gate and up one grouped product);
  the other adapted tower linears (attention, merger) run the LoRA projection kernels once
  ``get_peft_model`` adapts them, :mod:`notebookkit.models.patching.patch_lora_linear`;
  Qwen2.5-VL's attention within windows and images on the RoPE kernel and one SDPA call per
  segment length (:mod:`.tower_attention`, instead of a Python loop over the windows).
  SigLIP's attention (already one batched call), LayerNorms and plain GELU MLPs stay stock.

Everything is an instance rebinding (:mod:`notebookkit.base_layers.rebinding`), so ``unpatch_model`` restores it all.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from notebookkit.base_layers.linear4bit import describe_linear4bit, guard_lora_merges, patch_linear4bit
from notebookkit.families import Family, for_vision_model_type

from ..common import architectures
from ..common.banner import Banner
from ..common.decoder_layers import decoder_layers
from ..patching.lora_fast_path import describe_lora
from ..patching.patch_lora_linear import patch_lora_linears
from ..patching.patch_mlp import mlp_ready, patch_mlp
from ..patching.patch_norms import patch_norms
from ..patching.patcher import patch_attentions, patch_mlps, stays_stock
from .lm_head import patch_vision_head, vision_head_ready
from .tower_attention import patch_segment_attentions


def submodule(model: nn.Module, path: str) -> Optional[nn.Module]:
    """``model.<path>`` for a dotted attribute path, or ``None`` when a part is missing."""
    obj: Any = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, nn.Module) else None


def wrapper_of(model: nn.Module) -> nn.Module:
    """The Hugging Face wrapper inside a PEFT model (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def vision_family(model: nn.Module) -> Optional[Family]:
    """The family record of a loaded vision-language wrapper, or ``None``."""
    return for_vision_model_type(getattr(wrapper_of(model).config, "model_type", None))


def rope_table_problem(language: nn.Module) -> Optional[str]:
    """Why the decoder's rotary tables cannot go to the RoPE kernel as they are, or ``None`` when they can.

    The kernel takes one ``[B, T, head_dim]`` table per token. The rotary module is run on two
    3-axis positions and must give exactly that.
    """
    rotary = getattr(language, "rotary_emb", None)
    if rotary is None:
        return "the decoder has no rotary_emb"
    buffer = next(iter(rotary.buffers()), None)
    device = buffer.device if buffer is not None else torch.device("cpu")
    x = torch.zeros(1, 2, 1, device=device)
    positions = torch.arange(2, device=device).view(1, 1, 2).expand(3, 1, 2)
    try:
        with torch.no_grad():
            cos, _ = rotary(x, positions)
    except Exception as exc:  # noqa: BLE001 - a module that refuses the probe stays stock
        return f"its rotary module refused 3-axis positions ({type(exc).__name__}: {exc})"
    if cos.dim() != 3 or tuple(cos.shape[:2]) != (1, 2):
        return (f"its rotary module returns tables of shape {tuple(cos.shape)}, not one [batch, tokens, head_dim] "
                "table per token (the sections are composed inside attention in this transformers version)")
    return None


def patch_vision_model(model: nn.Module, banner: Optional[Banner] = None) -> Banner:
    """Patch a Qwen2.5-VL / Gemma 3 wrapper (PEFT-wrapped or not) in place; returns the banner."""
    banner = banner if banner is not None else Banner()
    describe_linear4bit(model, banner, patch_linear4bit(model))  # correctness first: NF4 decode on CPU
    if hasattr(model, "peft_config"):
        guard_lora_merges(model)
    wrapper = wrapper_of(model)
    family = vision_family(wrapper)
    if family is None:
        from notebookkit.families import vision_support_error

        raise vision_support_error(getattr(wrapper.config, "model_type", None), type(wrapper).__name__)
    if stays_stock(wrapper, family, banner):
        return banner
    vision = family.vision
    language = submodule(wrapper, vision.language_model)
    if language is None:
        banner.feature("fast path", False, f"{type(wrapper).__name__} has no {vision.language_model}: stock code")
        return banner
    text_config = wrapper.config.get_text_config()
    layers = decoder_layers(wrapper)

    n_norms = patch_norms(language, family.norm)
    banner.feature("RMSNorm", n_norms > 0, f"{n_norms} decoder norms on kernels.rms_norm ({family.norm})" if n_norms
                   else "no RMSNorm modules found in the decoder")
    mlps = patch_mlps(layers, text_config, family, banner)
    problem = rope_table_problem(language) if vision.rope == "mrope" else None
    if problem is None:
        attns = patch_attentions(wrapper, layers, text_config, family, banner)
        if attns and vision.rope == "mrope":
            on, why = banner.features["attention"]
            banner.feature("attention", on, why + "; multimodal RoPE (t/h/w sections, composed per token by the "
                           "model's rotary module) on the same kernel")
    else:
        attns = 0
        banner.feature("attention", False, f"stock: multimodal RoPE not on the kernel: {problem}")
    _patch_tower(wrapper, family, banner)
    reason = vision_head_ready(wrapper)
    softcap = architectures.final_softcap(text_config, family)
    if reason is None:
        patch_vision_head(wrapper, softcap)
        banner.feature("fused CE loss", True, "model(..., labels=...) in training: fused linear cross-entropy, no "
                       "full logits" + (f" (final soft-cap {softcap:g})" if softcap else ""))
    else:
        banner.feature("fused CE loss", False, reason)
    if layers and (mlps != len(layers) or attns != len(layers)):
        banner.note("some decoder layers stay on stock Hugging Face code; outputs are still exact, only slower")
    if hasattr(model, "peft_config"):
        describe_lora(model, banner)
    return banner


def _tower_parts(wrapper: nn.Module, family: Family) -> list[nn.Module]:
    """The vision tower and the projector of a wrapper (those it has; Qwen2.5-VL's projector is inside its tower)."""
    vision = family.vision
    return [m for m in (submodule(wrapper, vision.vision_tower), submodule(wrapper, vision.projector)) if m is not None]


def _patch_tower(wrapper: nn.Module, family: Family, banner: Banner) -> None:
    """RMSNorms, gated SiLU MLPs and segment attentions of the vision tower and projector; the banner's
    ``vision tower`` line."""
    vision = family.vision
    parts = _tower_parts(wrapper, family)
    seen: set[int] = set()
    n_norms = n_mlps = n_attentions = 0
    for part in parts:
        if id(part) in seen:
            continue
        inner = {id(m) for m in part.modules()}
        if seen & inner:  # the projector inside the tower (Qwen2.5-VL's merger): already walked
            continue
        seen |= inner
        n_norms += patch_norms(part, family.norm)
        for module in part.modules():
            if all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")):
                activation = architectures.activation_of(getattr(module, "act_fn", None))
                if activation is not None and mlp_ready(activation) is None:
                    patch_mlp(module, activation)
                    n_mlps += 1
        if vision.tower_attention == "segments":
            n_attentions += patch_segment_attentions(part)
    fused = [f"{n_norms} RMSNorms on kernels.rms_norm"] if n_norms else []
    if n_mlps:
        fused.append(f"{n_mlps} gated MLPs on the fused LoRA MLP (frozen biases added inside)")
    if n_attentions:
        fused.append(f"{n_attentions} window/image attentions on the RoPE kernel and one SDPA call per segment "
                     "length")
    stock = "LayerNorms and plain MLPs" if n_attentions else "attention, LayerNorms and plain MLPs"
    banner.feature(
        "vision tower", bool(fused),
        (", ".join(fused) if fused else "nothing fused") + f"; its {stock} run stock Hugging Face code",
    )


def patch_tower_adapters(peft_model: nn.Module, banner: Optional[Banner] = None) -> int:
    """Put the adapted linears of the vision tower and projector of a PEFT-wrapped VLM on the LoRA projection
    kernels (:mod:`notebookkit.models.patching.patch_lora_linear`); returns how many, and the banner's
    ``vision LoRA`` line says it."""
    wrapper = wrapper_of(peft_model)
    family = vision_family(wrapper)
    if family is None:
        return 0
    count = patch_lora_linears(*_tower_parts(wrapper, family))
    if count and banner is not None:
        banner.feature("vision LoRA", True, f"{count} adapted linears of the vision tower / projector on the LoRA "
                       "projection kernels (adapters cast to the compute dtype once per step)")
    return count


__all__ = ["patch_tower_adapters", "patch_vision_model", "rope_table_problem", "submodule", "vision_family", "wrapper_of"]
