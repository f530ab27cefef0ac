"""``FastVisionModel``: the notebook-facing API for vision-language models (load, add LoRA, switch modes).

The same calls as the most used vision notebooks::

    model, processor = FastVisionModel.from_pretrained("notebookkit/tiny-qwen2.5-vl", max_seq_length=512)
    model = FastVisionModel.get_peft_model(model, finetune_vision_layers=True, finetune_language_layers=True,
                                           finetune_attention_modules=True, finetune_mlp_modules=True, r=16)
    # ... train with notebookkit.data.VisionDataCollator and TRL's SFTTrainer / notebookkit's FastSFTTrainer ...
    FastVisionModel.for_inference(model)
    model.generate(**processor(text=..., images=..., return_tensors="pt"), max_new_tokens=32)

The language decoder runs on the FastLanguageModel fused path (RMSNorm, RoPE including
Qwen2.5-VL's multimodal rotary embedding, fused LoRA QKV / O / MLP, the fused cross-entropy, the
activation planner); the vision tower's RMSNorms and gated MLPs run the same kernels, the rest of it
stock code (:mod:`.vision.patcher`). The banner says which part runs what.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch.nn as nn

from .common.banner import Banner, get_banner
from .fast_language_model import FastLanguageModel
from .loading import arguments
from .lora_setup import (already_adapted, check_lora_arguments, describe_adapters, lora_config, note_setup,
                         wrap_with_lora)
from .patching.checkpointing import apply_checkpointing
from .patching.lora_fast_path import describe_lora
from .vision import loader as vision_loader
from .vision.patcher import patch_tower_adapters, vision_family, wrapper_of
from .vision.targets import select_targets


class FastVisionModel:
    """Load Qwen2.5-VL / Gemma 3 vision-language models onto notebookkit's fused kernels and train them with LoRA."""

    from_pretrained = staticmethod(vision_loader.from_pretrained)  # same signature and docstring as the loader

    @staticmethod
    def get_peft_model(
        model: nn.Module,
        finetune_vision_layers: bool = True,
        finetune_language_layers: bool = True,
        finetune_attention_modules: bool = True,
        finetune_mlp_modules: bool = True,
        r: int = 16,
        target_modules: Optional[Union[str, Sequence[str]]] = None,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        bias: str = "none",
        use_gradient_checkpointing: Union[bool, str] = "auto",
        random_state: int = 3407,
        use_rslora: bool = False,
        loftq_config: Any = None,
        modules_to_save: Optional[Sequence[str]] = None,
        init_lora_weights: Any = True,
        max_seq_length: Optional[int] = None,
        planning_batch_size: Optional[int] = None,
        max_memory: Any = None,
        show_banner: bool = True,
        fp8_base_matmul: bool = False,
        **kwargs: Any,
    ):
        """Attach LoRA adapters (PEFT) to a model loaded by ``FastVisionModel.from_pretrained``.

        Args:
            model: the model returned by ``FastVisionModel.from_pretrained``.
            finetune_vision_layers: adapters on the vision tower and its projector.
            finetune_language_layers: adapters on the language decoder (these run the fused kernels).
            finetune_attention_modules: adapters on attention projections (q/k/v/o, ``qkv``/``proj``).
            finetune_mlp_modules: adapters on MLP projections (gate/up/down, ``fc1``/``fc2``, the merger).
                A layer is adapted when the switch of its tower and the switch of its kind are both on
                (:mod:`notebookkit.models.vision.targets`).
            r, lora_alpha, lora_dropout, bias, use_rslora, loftq_config, modules_to_save,
                init_lora_weights: as in ``FastLanguageModel.get_peft_model`` (dropout 0 and bias
                ``"none"`` keep the decoder on the fused kernels).
            target_modules: ``None`` (the switches decide) or PEFT's ``target_modules`` (a list of
                names, ``"all-linear"`` or a regular expression), which then replaces the switches.
            use_gradient_checkpointing: ``False``, ``True``, ``"offload"`` (``"unsloth"``) or ``"auto"``
                (the memory planner picks per decoder layer; on CPU: none).
            random_state: seed for the LoRA initialisation.
            max_seq_length, planning_batch_size, max_memory, fp8_base_matmul: as in
                ``FastLanguageModel.get_peft_model``.

        Returns:
            a ``peft.PeftModel`` in training mode.
        """
        _require_model(model, "FastVisionModel.get_peft_model")
        banner = get_banner(model) or Banner()
        if hasattr(model, "peft_config"):
            return already_adapted(model, banner, fp8_base_matmul, show_banner)
        where = "FastVisionModel.get_peft_model"
        family = vision_family(model)
        if family is None:
            from notebookkit.families import vision_support_error

            raise vision_support_error(getattr(wrapper_of(model).config, "model_type", None),
                                       f"{where}: this {type(wrapper_of(model)).__name__}")
        r, mode, max_seq_length, planning_batch_size = check_lora_arguments(
            where, r, lora_alpha, lora_dropout, bias, use_gradient_checkpointing, max_seq_length,
            planning_batch_size, max_memory,
        )
        if target_modules is None:
            targets, described = _selected_targets(model, family.vision, where, finetune_vision_layers,
                                                   finetune_language_layers, finetune_attention_modules,
                                                   finetune_mlp_modules)
        else:
            targets = target_modules if isinstance(target_modules, str) else list(target_modules)
            described = f"target_modules={targets!r} (the finetune_* switches are not used)"
        config = lora_config(
            r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, bias=bias, target_modules=targets,
            use_rslora=use_rslora, modules_to_save=modules_to_save, init_lora_weights=init_lora_weights,
            layers_to_transform=None, loftq_config=loftq_config,
            keywords_of=FastLanguageModel.get_peft_model,  # the known keywords its errors have always listed
            **kwargs,
        )
        note_setup(model, banner, max_memory, mode)
        peft_model = wrap_with_lora(model, config, random_state, banner, fp8_base_matmul, max_seq_length)
        patch_tower_adapters(peft_model, banner)
        apply_checkpointing(
            peft_model, use_gradient_checkpointing, banner, batch_size=planning_batch_size, max_memory=max_memory
        )
        describe_lora(peft_model, banner)
        describe_adapters(peft_model, banner, r, lora_alpha, use_rslora, described)
        if show_banner:
            banner.show()
        return FastVisionModel.for_training(peft_model)

    @staticmethod
    def for_inference(model: nn.Module) -> nn.Module:
        """Switch to generation: eval mode, KV cache on (wrapper and text configs), the fast ``model.generate``.

        ``model.generate`` then runs the language decoder's decode path (as after
        ``FastLanguageModel.for_inference``): a prompt with images goes through the model's own forward
        once, every new token through the fast decode step (:mod:`notebookkit.models.vision.decode`;
        Qwen2.5-VL's at the per-row multimodal RoPE offsets its forward leaves). The banner's
        ``image prompts`` line says which path runs.
        Returns the model.
        """
        from .generation import is_bound
        from .vision.decode import attach_image_prompts, describe_image_prompts

        _require_model(model, "FastVisionModel.for_inference")
        attach_image_prompts(model)  # also for a wrapper that did not come from FastVisionModel.from_pretrained
        FastLanguageModel.for_inference(model)
        _set_use_cache(model, True)
        banner = get_banner(model)
        if banner is not None:
            describe_image_prompts(model, banner, is_bound(model))
        return model

    @staticmethod
    def for_training(
        model: nn.Module, use_gradient_checkpointing: Union[bool, str, None] = None, max_memory: Any = None
    ) -> nn.Module:
        """Switch back to training mode (KV cache off). Optionally change the checkpointing mode."""
        _require_model(model, "FastVisionModel.for_training")
        FastLanguageModel.for_training(model, use_gradient_checkpointing, max_memory)
        _set_use_cache(model, False)
        return model

    @staticmethod
    def patch(model: nn.Module) -> Banner:
        """(Re)apply the fused path to a vision-language model in place; returns its banner."""
        from .vision.patcher import patch_vision_model

        return patch_vision_model(model, get_banner(model) or Banner())

    unpatch = staticmethod(FastLanguageModel.unpatch)


def _require_model(obj: Any, where: str) -> None:
    """Refuse what is not a model, in FastVisionModel's words (the ``(model, processor)`` pair is the usual slip)."""
    arguments.require_model(obj, where, api="FastVisionModel", second="processor")


def _selected_targets(model: nn.Module, vision: Any, where: str, *switches: bool) -> tuple[list[str], str]:
    vision_layers, language_layers, attention, mlp = switches
    if not (vision_layers or language_layers):
        raise ValueError(f"{where}: finetune_vision_layers and finetune_language_layers are both False, so no layer "
                         "would get an adapter. Switch at least one on (the language layers run the fused kernels).")
    if not (attention or mlp):
        raise ValueError(f"{where}: finetune_attention_modules and finetune_mlp_modules are both False, so no layer "
                         "would get an adapter. Switch at least one on.")
    selection = select_targets(wrapper_of(model), vision, vision_layers, language_layers, attention, mlp)
    if not selection.names:
        raise ValueError(f"{where}: the finetune_* switches select no linear layer of this "
                         f"{type(wrapper_of(model)).__name__}; pass target_modules= explicitly.")
    return selection.names, selection.describe()


def _set_use_cache(model: nn.Module, on: bool) -> None:
    config = wrapper_of(model).config
    for cfg in (config, config.get_text_config()):
        if getattr(cfg, "use_cache", None) is not None:
            cfg.use_cache = on


__all__ = ["FastVisionModel"]
