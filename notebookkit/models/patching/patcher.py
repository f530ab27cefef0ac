"""Walk a loaded Hugging Face causal LM and rebind its pieces onto the fused kernels (and back).

``patch_model(model)`` looks the model's ``model_type`` up in the family record
(:mod:`notebookkit.families`, read through :mod:`notebookkit.models.common.architectures`) and rebinds the ``forward`` of
instances, one step per kind: every RMSNorm, every decoder MLP, every decoder self-attention and
the causal-LM head; and, for every model, the CPU forward of bitsandbytes 4-bit layers
(:mod:`notebookkit.base_layers.linear4bit`). A family that is not in the table is left entirely on stock code (never
half-patched), and the banner says so. ``unpatch_model(model)`` restores every original forward.
Each feature is independent: if one kernel file is missing, only that feature stays stock.
:func:`stays_stock`, :func:`patch_mlps` and :func:`patch_attentions` are the steps a vision-language
wrapper's decoder shares (:mod:`notebookkit.models.vision.patcher`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn

from notebookkit.base_layers.kernel_ops import why_missing
from notebookkit.base_layers.linear4bit import (TAG as NF4_CPU_TAG, describe_linear4bit, guard_lora_merges,
                                                patch_linear4bit)
from notebookkit.base_layers.rebinding import patch_tag, patched_modules, restore
from notebookkit.compat import attention_implementation
from notebookkit.families import Family
from notebookkit.marks import LM_HEAD_OWNER, PATCH_TAG
from notebookkit.memory.model_setup import record_fused_lm_head

from ..common import architectures
from ..common.banner import Banner
from ..common.decoder_layers import decoder_layers
from .lora_fast_path import describe_lora
from .patch_attention import attention_ready, patch_attention
from .patch_lm_head import ALL_ATTENTION_PATCHED, describe_lm_head, lm_head_ready, patch_lm_head
from .patch_mlp import mlp_ready, patch_mlp
from .patch_moe import is_moe_block, moe_ready, patch_moe
from .patch_norms import patch_norms


def _unwrap(model: nn.Module) -> nn.Module:
    """The Hugging Face ``*ForCausalLM`` inside a PEFT wrapper (or the model itself)."""
    if hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def patch_model(model: nn.Module, banner: Optional[Banner] = None) -> Banner:
    """Patch ``model`` in place onto the fused path; returns the banner with one line per feature."""
    banner = banner if banner is not None else Banner()
    # Not a speed-up but correctness, so before anything can return early: 4-bit layers on the CPU
    # decode with notebookkit's NF4 kernel, never bitsandbytes' (patch_linear4bit).
    describe_linear4bit(model, banner, patch_linear4bit(model))
    if hasattr(model, "peft_config"):
        guard_lora_merges(model)
    causal_lm = _unwrap(model)
    config = causal_lm.config
    spec = architectures.lookup(config)
    if stays_stock(causal_lm, spec, banner):
        return banner
    layers = decoder_layers(causal_lm)
    _patch_norms(causal_lm, spec, banner)
    mlp_done = patch_mlps(layers, config, spec, banner)
    attn_done = patch_attentions(causal_lm, layers, config, spec, banner)
    _patch_head(causal_lm, config, spec, banner)
    if len(layers) and (mlp_done != len(layers) or attn_done != len(layers)):
        banner.note("some layers stay on stock Hugging Face code; outputs are still exact, only slower")
    if hasattr(model, "peft_config"):
        describe_lora(model, banner)
    return banner


def stays_stock(causal_lm: nn.Module, spec: Optional[Family], banner: Banner) -> bool:
    """Whether the whole model stays on stock code (family not in the table, or CPU/disk offload); says why."""
    if spec is None:
        model_type = getattr(architectures.text_config(causal_lm.config), "model_type", "?")
        banner.feature(
            "fast path",
            False,
            f"model_type {model_type!r} is not in notebookkit's architecture table "
            f"({', '.join(architectures.supported_model_types())}): the whole model runs stock Hugging Face code",
        )
        return True
    placed = {str(d) for d in (getattr(causal_lm, "hf_device_map", None) or {}).values()}
    if placed & {"cpu", "disk"} and placed - {"cpu", "disk"}:
        banner.feature(
            "fast path",
            False,
            "device_map offloads some weights to CPU/disk (they are fetched by accelerate hooks on each call, "
            "which the fused kernels would bypass): the whole model runs stock Hugging Face code",
        )
        return True
    return False


def _patch_norms(causal_lm: nn.Module, spec: Family, banner: Banner) -> None:
    """Every RMSNorm onto ``kernels.rms_norm`` in the family's flavour (``Family.norm``)."""
    n_norms = patch_norms(causal_lm, spec.norm)
    if n_norms:
        banner.feature("RMSNorm", True, f"{n_norms} norms on kernels.rms_norm ({spec.norm})")
    else:
        banner.feature("RMSNorm", False, why_missing("rms_norm", "rms_norm") or "no RMSNorm modules found")


def patch_mlps(layers: list[nn.Module], config: Any, spec: Family, banner: Banner) -> int:
    """Every gated decoder MLP onto the fused activation, every sparse MoE block of an MoE family onto
    the grouped expert kernel; returns how many layers were patched."""
    mlp_done, mlp_reason = 0, None
    moe_done, moe_reason = 0, None
    activation = None
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if spec.moe is not None and is_moe_block(mlp, spec.moe):
            moe_reason = moe_ready(mlp, spec.moe)
            if moe_reason is None:
                patch_moe(mlp, spec.moe)
                moe_done += 1
            continue
        if mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            mlp_reason = f"{type(mlp).__name__} is not a gated MLP"
            continue
        activation = architectures.activation_of(getattr(mlp, "act_fn", None), config, spec)
        reason = mlp_ready(activation)
        if reason is not None:
            mlp_reason = reason
            continue
        patch_mlp(mlp, activation)
        mlp_done += 1
    if spec.moe is not None:
        banner.feature("MoE experts", moe_done > 0,
                       f"{moe_done}/{len(layers)} layers: fp32 {spec.moe.routing} routing + grouped expert GEMMs "
                       f"({spec.moe.activation}, kernels.moe_experts; LoRA through target_parameters)"
                       if moe_done else (moe_reason or "no sparse MoE blocks found"))
    if mlp_done:
        banner.feature("MLP", True, f"{mlp_done}/{len(layers)} layers: fused {activation} (lora_mlp when LoRA/frozen weights allow)")
    elif spec.moe is None or mlp_reason is not None:
        banner.feature("MLP", False, mlp_reason or "no decoder MLPs found")
    return mlp_done + moe_done


def patch_attentions(causal_lm: nn.Module, layers: list[nn.Module], config: Any, spec: Family, banner: Banner) -> int:
    """Every decoder self-attention onto fused QKV/O + RoPE; returns how many were patched.

    Marks the backbone when all of them are ours: a plainly causal forward may then skip Hugging
    Face's masks (:mod:`.patch_lm_head`).
    """
    text_config = architectures.text_config(config)
    attn_impl = attention_implementation(text_config) or attention_implementation(config)
    softcap = architectures.attn_softcap(config, spec)
    attn_done, attn_reason = 0, None
    if attn_impl not in (None, "sdpa", "eager"):
        # flash-attention / flex masks have other formats (2-D, BlockMask); leave those layers stock.
        attn_reason = f"attn_implementation={attn_impl!r} requested: attention stays on Hugging Face's {attn_impl}"
    else:
        for layer in layers:
            attn = getattr(layer, "self_attn", None)
            reason = attention_ready(attn, spec.attention_sinks) if attn is not None else "no self_attn"
            if reason is None and spec.qk_norm and not (hasattr(attn, "q_norm") and hasattr(attn, "k_norm")):
                reason = "q/k norms expected but not found"
            if reason is not None:
                attn_reason = reason
                continue
            patch_attention(attn, softcap, spec.qk_norm, spec.attention_sinks)
            attn_done += 1
    backbone = getattr(causal_lm, "model", None)
    if isinstance(backbone, nn.Module):
        object.__setattr__(backbone, ALL_ATTENTION_PATCHED, bool(layers) and attn_done == len(layers))
    if attn_done:
        how = ("eager fp32 softmax (attention soft-cap)" if softcap
               else "fused attention with sinks (kernels.attention_sinks)" if spec.attention_sinks else "PyTorch SDPA")
        extra = ", q/k norm" if spec.qk_norm else ""
        banner.feature(
            "attention", True, f"{attn_done}/{len(layers)} layers: fused QKV/O + RoPE kernel{extra} + {how}; packed rows isolated"
        )
    else:
        banner.feature("attention", False, attn_reason or "no decoder attention found")
    return attn_done


def _patch_head(causal_lm: nn.Module, config: Any, spec: Family, banner: Banner) -> None:
    """The causal-LM head onto the fused linear cross-entropy (final soft-cap included)."""
    reason = lm_head_ready(causal_lm)
    if reason is None:
        patch_lm_head(causal_lm, architectures.final_softcap(config, spec), moe=spec.moe is not None)
        describe_lm_head(banner, architectures.final_softcap(config, spec))
    else:
        banner.feature("fused CE loss", False, reason)


def unpatch_model(model: nn.Module, keep_nf4_decode: bool = True) -> int:
    """Restore every forward that notebookkit rebound in ``model``; returns how many were restored.

    ``keep_nf4_decode=True`` (the default) leaves the 4-bit layers' CPU forward on notebookkit's NF4
    decode (:mod:`notebookkit.base_layers.linear4bit`): bitsandbytes' own CPU forward gives wrong results on AVX-512
    CPUs for some shapes and rewrites weights in place in eval mode. ``False`` restores it anyway.
    """
    count = 0
    for _, module in list(patched_modules(model)):
        if keep_nf4_decode and patch_tag(module) == NF4_CPU_TAG:
            continue
        count += restore(module)
        module.__dict__.pop(LM_HEAD_OWNER, None)
        module.__dict__.pop(ALL_ATTENTION_PATCHED, None)
        record_fused_lm_head(module, False)
    return count


def patch_summary(model: nn.Module) -> dict[str, int]:
    """How many modules of each kind are currently patched (``{"rms_norm": 9, "mlp": 2, ...}``)."""
    counts: dict[str, int] = {}
    for _, module in patched_modules(model):
        tag = module.__dict__.get(PATCH_TAG, "?")
        counts[tag] = counts.get(tag, 0) + 1
    return counts
