"""``FastVisionModel.from_pretrained``: the vision-language variant of the one load pipeline
(:mod:`notebookkit.models.loading.loader`).

:data:`VISION_MODEL` is what differs from a text model; :func:`~notebookkit.models.loading.loader.load`
runs the steps. Resolution of ``model_name``, as for text models: a reserved tiny name
(``"notebookkit/tiny-qwen2.5-vl"``, ``"notebookkit/tiny-gemma3-vision"``: built once, offline, by
:mod:`notebookkit.embedded`), a local folder (a model, or a LoRA adapter saved from one, whose base
is loaded first), or a Hugging Face Hub name. The config's ``model_type`` must be a wrapper of the
family record (``Family.vision``: ``qwen2_5_vl``, ``gemma3``); any other model is refused with the
list of supported ones. The weights load with the wrapper's own class
(``Qwen2_5_VLForConditionalGeneration``...) in the precision
:func:`~notebookkit.models.loading.loader.pick_dtype` picks,
NF4 with double quantisation for ``load_in_4bit`` (every linear layer but the LM head, vision tower
included, as transformers quantises a VLM by default); the processor with
:func:`~.processor.load_processor`; the fused path with :func:`~.patcher.patch_vision_model`
(an adapter loaded from a folder also gets :func:`~.patcher.patch_tower_adapters`); and every
model the image-prompt preparation of its ``generate`` (:func:`~.decode.attach_image_prompts`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch.nn as nn

from notebookkit.families import Family, for_vision_model_type, vision_support_error

from ..common.banner import Banner
from ..loading import loader


def resolve_vision(model_name: Union[str, os.PathLike]) -> tuple[str, str]:
    """``(path_or_hub_id, kind)`` as :func:`~notebookkit.models.loading.loader.resolve`, for the tiny vision
    names too."""
    from notebookkit.embedded.tiny import is_tiny_vision_model_name, resolve_model_name

    name = os.fspath(model_name)
    if is_tiny_vision_model_name(name):
        return str(resolve_model_name(name)), "tiny"
    return loader.resolve(name)


def check_vision_config(config: Any, model_name: Union[str, os.PathLike], banner: Banner) -> Family:
    """The family record of a supported wrapper (the banner names it); any other model is refused with the list."""
    family = for_vision_model_type(getattr(config, "model_type", None))
    if family is None:
        raise vision_support_error(getattr(config, "model_type", None), f"{os.fspath(model_name)!r}")
    banner.header.append(f"vision-language model: {family.vision.model_class} ({family.name} decoder)")
    return family


def _wrapper_class(family: Family):
    import transformers

    return getattr(transformers, family.vision.model_class)


def _processor(path: str, family: Family, banner: Banner, **hub: Any):
    from .processor import load_processor

    return load_processor(path, family.vision, banner, **hub)


def _saved_processor(path: str, model: nn.Module, banner: Banner) -> Optional[Any]:
    """The processor saved with an adapter; ``None`` when there is none or it does not load (the base's is the
    same but for the template, and the banner says so)."""
    if not any((Path(path) / f).is_file() for f in ("processor_config.json", "preprocessor_config.json")):
        return None
    from .patcher import vision_family
    from .processor import load_processor

    try:
        return load_processor(path, vision_family(model).vision, banner)
    except Exception as exc:  # noqa: BLE001 - the base model's processor is the same but for the template
        banner.note(f"the processor saved with the adapter did not load ({type(exc).__name__}: {exc}); "
                    f"using the base model's")
        return None


def _patch(model: nn.Module, banner: Banner) -> Banner:
    from .patcher import patch_vision_model

    return patch_vision_model(model, banner)


def _patch_adapters(peft_model: nn.Module, banner: Banner) -> int:
    from .patcher import patch_tower_adapters

    return patch_tower_adapters(peft_model, banner)


def _attach_image_prompts(model: nn.Module) -> None:
    from .decode import attach_image_prompts

    attach_image_prompts(model)


#: a vision-language wrapper of the family record and its processor, patched by :func:`.patcher.patch_vision_model`
VISION_MODEL = loader.LoadVariant(
    where="FastVisionModel.from_pretrained",
    default_model_name="notebookkit/tiny-qwen2.5-vl",
    example_hub_name="Qwen/Qwen2.5-VL-7B-Instruct",
    length_hint="It is the longest sequence, in tokens and image tokens included, you will train on: e.g. 2048.",
    base_model_hint="the base model with FastVisionModel.from_pretrained",
    resolve=resolve_vision,
    check_config=check_vision_config,
    model_class=_wrapper_class,
    load_processor=_processor,
    tokenizer_of=lambda processor: processor.tokenizer,
    saved_processor=_saved_processor,
    patch=_patch,
    on_adapter=_patch_adapters,
    on_loaded=_attach_image_prompts,
    notes_position_limit=False,
)

from_pretrained = loader.entry_point(VISION_MODEL, __name__, """Load a vision-language model and its processor, with the language decoder on the fused kernels.

    Args:
        model_name: a reserved tiny name (``"notebookkit/tiny-qwen2.5-vl"``,
            ``"notebookkit/tiny-gemma3-vision"``), a local model or LoRA-adapter folder, or a Hugging
            Face Hub name of a supported wrapper (Qwen2.5-VL, Gemma 3 4B and larger).
        max_seq_length: longest training sequence in tokens, image tokens included (an image becomes a
            fixed number of tokens: 16 on the tiny models, up to a few thousand on real ones).
        dtype: ``None`` (bf16 if the GPU supports it, else fp16; fp32 on CPU), or a torch dtype/name.
        load_in_4bit: NF4 weights with double quantisation (QLoRA), vision tower included.
        load_in_8bit: LLM.int8 weights (LoRA then runs on stock PEFT code).
        load_in_2bit: not for vision-language models yet (2-bit bases load through
            ``FastLanguageModel.from_pretrained``); ``True`` raises an error that says so.
        load_in_ternary: the same for ternary bases.
        full_finetuning: train every weight (no quantisation, no LoRA).
        token: Hugging Face token for gated models.
        device_map: ``None`` (the current GPU, or CPU), ``"auto"``... as in ``transformers``.
        trust_remote_code: allow custom modelling code from the Hub.
        attn_implementation: Hugging Face attention backend for the parts left stock.
        fast_path: ``False`` loads on stock Hugging Face code (for comparisons).
        offload_embedding: keep the language model's input embedding table in pinned host memory, read
            by the GPU in place (1.02 GiB less GPU memory for Qwen2.5-VL-7B; not for tied embeddings).
        show_banner: print the load report (kept in ``model.notebookkit_banner`` either way).

    Returns:
        ``(model, processor)``: the processor renders chat messages with images
        (``processor.apply_chat_template``) and turns text + images into model inputs;
        ``model.notebookkit_banner`` holds the load report.
    """)


__all__ = ["VISION_MODEL", "check_vision_config", "from_pretrained", "resolve_vision"]
