"""The steps of ``get_peft_model`` that ``FastLanguageModel`` and ``FastVisionModel`` share.

Both check their arguments before anything changes (:func:`check_lora_arguments`), build one
``peft.LoraConfig`` (:func:`lora_config`), note settings that will not act (:func:`note_setup`), wrap
the model with its LoRA weights drawn from the seed (:func:`wrap_with_lora`) and write the banner's
LoRA line (:func:`describe_adapters`); they differ only in which layers they adapt.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn as nn

from notebookkit import compat
from notebookkit.base_layers.linear4bit import guard_lora_merges
from notebookkit.export.bind import bind_export_methods

from .common.banner import Banner, get_banner
from .loading import arguments
from .low_bit.merge_guard import guard_low_bit_merges
from .patching.checkpointing import normalize_mode
from .patching.lora_fast_path import describe_lora, set_fp8_base_matmul


def note_unused_max_memory(banner: Banner, max_memory: Any, mode: str, device_type: str) -> None:
    """Say in the banner when a ``max_memory`` cap will not be read: it sizes the ``"auto"`` plan on a GPU."""
    if device_type != "cuda":
        banner.note(
            f"max_memory={max_memory!r} not used: the cap applies to a GPU only (it sizes the activation plan "
            "of use_gradient_checkpointing='auto' in VRAM); this model is on the CPU"
        )
    elif mode != "auto":
        banner.note(
            f"max_memory={max_memory!r} not used: only use_gradient_checkpointing='auto' plans within it "
            f"(this call asked for {mode!r})"
        )


def already_adapted(model: nn.Module, banner: Banner, fp8_base_matmul: bool, show_banner: bool) -> nn.Module:
    """``get_peft_model`` on a model that has adapters: unchanged, but ``fp8_base_matmul=True`` still applies."""
    banner.note("get_peft_model called on a model that already has LoRA adapters; returning it unchanged "
                "(only fp8_base_matmul=True is applied)")
    if fp8_base_matmul:  # the one thing a second call may still switch on
        set_fp8_base_matmul(model, True)
        describe_lora(model, banner)
    if show_banner:
        banner.show()
    return model


def check_lora_arguments(
    where: str, r: Any, lora_alpha: Any, lora_dropout: Any, bias: str, use_gradient_checkpointing: Union[bool, str],
    max_seq_length: Any, planning_batch_size: Any, max_memory: Any,
) -> tuple[int, str, Optional[int], Optional[int]]:
    """Readable errors for arguments PEFT would reject later, or less clearly; returns
    ``(r, checkpointing mode, max_seq_length, planning_batch_size)`` as whole numbers."""
    r = arguments.positive_int(
        r, "r", where, "r is the LoRA rank (the inner size of the adapter matrices): e.g. 8, 16, 32 or 64."
    )
    arguments.positive_number(
        lora_alpha, "lora_alpha", where,
        f"The LoRA update is scaled by lora_alpha / r, so it must be positive: the usual choice is "
        f"lora_alpha = r or 2 * r (here {r} or {2 * r}).",
    )
    arguments.probability(
        lora_dropout, "lora_dropout", where,
        "It is the fraction of LoRA inputs dropped in training; 0 (the default) runs the fused kernels.",
    )
    if bias not in ("none", "all", "lora_only"):
        raise ValueError(f"bias={bias!r} must be 'none', 'all' or 'lora_only'.")
    mode = normalize_mode(use_gradient_checkpointing)
    if max_seq_length is not None:
        max_seq_length = arguments.positive_int(
            max_seq_length, "max_seq_length", where, "Leave it out to keep the one given to from_pretrained."
        )
    if planning_batch_size is not None:
        planning_batch_size = arguments.positive_int(
            planning_batch_size, "planning_batch_size", where,
            "It is the per-device batch size the 'auto' plan should fit: e.g. per_device_train_batch_size.",
        )
    if max_memory is not None:
        arguments.max_memory_bytes(max_memory, where)
    return r, mode, max_seq_length, planning_batch_size


_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_targets(model: nn.Module, target_modules: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with ``target_parameters`` set to the experts' stacked weights (``Family.moe``) when the
    model is a mixture of experts, ``target_modules`` names the MLP's projections (as the default does),
    the caller did not choose ``target_parameters`` and PEFT does not map those names onto the experts
    itself (``MoE.peft_maps_mlp_targets``: Qwen3-MoE); otherwise ``kwargs`` unchanged."""
    from notebookkit.families import for_model_type

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    family = for_model_type(getattr(getattr(base, "config", None), "model_type", None))
    if family is None or family.moe is None or family.moe.peft_maps_mlp_targets or "target_parameters" in kwargs:
        return kwargs
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules or ())
    if target_modules != "all-linear" and not any(n in _MLP_PROJECTIONS for n in names):
        return kwargs
    return {**kwargs, "target_parameters": list(family.moe.lora_parameters)}


def lora_config(
    *, r: int, lora_alpha: int, lora_dropout: float, bias: str, target_modules: Any, use_rslora: bool,
    modules_to_save: Optional[Sequence[str]], init_lora_weights: Any, layers_to_transform: Optional[Sequence[int]],
    loftq_config: Any, keywords_of: Callable[..., Any], **kwargs: Any,
):
    """The ``peft.LoraConfig`` of a causal LM (LoftQ initialisation when ``loftq_config`` is given);
    a misspelt keyword is named before PEFT touches the model, with the keywords of ``keywords_of``
    (a ``get_peft_model``) as the known ones."""
    from peft import LoraConfig

    config_kwargs: dict[str, Any] = dict(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        bias=bias,
        target_modules=target_modules,
        use_rslora=use_rslora,
        modules_to_save=list(modules_to_save) if modules_to_save else None,
        task_type="CAUSAL_LM",
        init_lora_weights=init_lora_weights,
    )
    if layers_to_transform is not None:
        config_kwargs["layers_to_transform"] = list(layers_to_transform)
    if loftq_config:
        config_kwargs["loftq_config"] = loftq_config
        config_kwargs["init_lora_weights"] = "loftq"
    for key in ("temporary_location", "use_dora_fast_path"):
        kwargs.pop(key, None)
    config_kwargs.update(kwargs)
    try:
        return LoraConfig(**config_kwargs)
    except TypeError as exc:
        keyword = arguments.unknown_keyword(exc, kwargs)
        if keyword is None:
            raise
        known = [k for k in inspect.signature(keywords_of).parameters if k != "kwargs"]
        raise arguments.unknown_keyword_error("get_peft_model", keyword, known, "peft.LoraConfig") from None


def note_setup(model: nn.Module, banner: Banner, max_memory: Any, mode: str) -> None:
    """Banner notes about settings that will not act: a ``max_memory`` not read, a model not from
    ``FastLanguageModel.from_pretrained``."""
    if max_memory is not None:
        on_gpu = any(p.device.type == "cuda" for p in model.parameters())
        note_unused_max_memory(banner, max_memory, mode, "cuda" if on_gpu else "cpu")
    if get_banner(model) is None:
        banner.note(
            "this model was not loaded by FastLanguageModel.from_pretrained, so its layers run stock Hugging Face "
            "code; load it with FastLanguageModel.from_pretrained(...) for the fused kernels, or call "
            "FastLanguageModel.patch(model) before get_peft_model"
        )


def wrap_with_lora(model: nn.Module, lora_config: Any, random_state: int, banner: Banner, fp8_base_matmul: bool,
                    max_seq_length: Optional[int]) -> nn.Module:
    """``peft.get_peft_model`` with the LoRA weights drawn from ``torch.manual_seed(random_state)``; a
    failure (e.g. target modules PEFT cannot find) leaves the model as it came."""
    from peft import get_peft_model as peft_get_peft_model

    # Before PEFT wraps anything, so an unsupported GPU raises with the model unchanged. The flag
    # lives on the base linears, which PEFT keeps as each LoRA layer's base_layer.
    set_fp8_base_matmul(model, bool(fp8_base_matmul))
    previous_length = model.__dict__.get("max_seq_length")
    if max_seq_length is not None:
        object.__setattr__(model, "max_seq_length", max_seq_length)
    torch.manual_seed(random_state)
    try:
        with compat.quiet_checkpointing_flag_deprecation():  # PEFT reads the deprecated flag
            peft_model = peft_get_peft_model(model, lora_config)
    except Exception:
        set_fp8_base_matmul(model, False)
        if previous_length is not None:
            object.__setattr__(model, "max_seq_length", previous_length)
        raise
    guard_lora_merges(peft_model)  # PEFT's merge would decode 4-bit bases with bitsandbytes on a CPU
    guard_low_bit_merges(peft_model)  # and cannot write into 2-bit / ternary codes
    object.__setattr__(peft_model, "notebookkit_banner", banner)
    bind_export_methods(peft_model)
    return peft_model


def describe_adapters(peft_model: nn.Module, banner: Banner, r: int, lora_alpha: int, use_rslora: bool,
                      targets: str) -> None:
    """The banner's LoRA line: rank, scaling (``alpha / r``, rsLoRA ``alpha / sqrt(r)``), ``targets`` (what was
    adapted, in words) and the trainable share of parameters."""
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    banner.header.append(
        f"LoRA r={r}, alpha={lora_alpha}{' (rsLoRA)' if use_rslora else ''} on {targets}: "
        f"{trainable:,} trainable of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%)"
    )
