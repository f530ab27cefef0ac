"""``FastVisionModel.from_pretrained``: resolve a name, load a vision-language model and its processor, patch it.

Resolution of ``model_name``, as for text models (:mod:`.loader`): a reserved tiny name
(``"notebookkit/tiny-qwen2.5-vl"``, ``"notebookkit/tiny-gemma3-vision"``: built once, offline, by
:mod:`notebookkit.embedded`), a local folder (a model, or a LoRA adapter saved from one, whose base
is loaded first), or a Hugging Face Hub name. The config's ``model_type`` must be a wrapper of the
family record (``Family.vision``: ``qwen2_5_vl``, ``gemma3``); any other model is refused with the
list of supported ones. The weights load with the wrapper's own class
(``Qwen2_5_VLForConditionalGeneration``...) in the precision :func:`~.loader.pick_dtype` picks,
NF4 with double quantisation for ``load_in_4bit`` (every linear layer but the LM head, vision tower
included, as transformers quantises a VLM by default); the processor with
:func:`~.vision_processor.load_processor`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from notebookkit.families import for_vision_model_type, vision_support_error

from . import arguments, loader
from .banner import Banner
from .offload_embedding import offload_embedding_value, offload_input_embedding
from .precision import family_dtype


def resolve_vision(model_name: Union[str, os.PathLike]) -> tuple[str, str]:
    """``(path_or_hub_id, kind)`` as :func:`.loader.resolve`, for the tiny vision names too."""
    from notebookkit.embedded.tiny import is_tiny_vision_model_name, resolve_model_name

    name = os.fspath(model_name)
    if is_tiny_vision_model_name(name):
        return str(resolve_model_name(name)), "tiny"
    return loader.resolve(name)


def from_pretrained(
    model_name: Union[str, os.PathLike] = "notebookkit/tiny-qwen2.5-vl",
    max_seq_length: int = 2048,
    dtype: Union[None, str, torch.dtype] = None,
    load_in_4bit: bool = True,
    load_in_8bit: bool = False,
    full_finetuning: bool = False,
    token: Optional[str] = None,
    device_map: Any = None,
    trust_remote_code: bool = False,
    attn_implementation: Optional[str] = None,
    fast_path: bool = True,
    offload_embedding: bool = False,
    show_banner: bool = True,
    **kwargs: Any,
):
    """Load a vision-language model and its processor, with the language decoder on the fused kernels.

    Args:
        model_name: a reserved tiny name (``"notebookkit/tiny-qwen2.5-vl"``,
            ``"notebookkit/tiny-gemma3-vision"``), a local model or LoRA-adapter folder, or a Hugging
            Face Hub name of a supported wrapper (Qwen2.5-VL, Gemma 3 4B and larger).
        max_seq_length: longest training sequence in tokens, image tokens included (an image becomes a
            fixed number of tokens: 16 on the tiny models, up to a few thousand on real ones).
        dtype: ``None`` (bf16 if the GPU supports it, else fp16; fp32 on CPU), or a torch dtype/name.
        load_in_4bit: NF4 weights with double quantisation (QLoRA), vision tower included.
        load_in_8bit: LLM.int8 weights (LoRA then runs on stock PEFT code).
        full_finetuning: train every weight (no quantisation, no LoRA).
        token: Hugging Face token for gated models.
        device_map: ``None`` (the current GPU, or CPU), ``"auto"``... as in ``transformers``.
        trust_remote_code: allow custom modelling code from the Hub.
        attn_implementation: Hugging Face attention backend for the parts left stock.
        fast_path: ``False`` loads on stock Hugging Face code (for comparisons).
        offload_embedding: keep the language model's input embedding table in pinned host memory, read
            by the GPU in place (1.02 GiB less GPU memory for Qwen2.5-VL-7B; not for tied embeddings).

    Returns:
        ``(model, processor)``: the processor renders chat messages with images
        (``processor.apply_chat_template``) and turns text + images into model inputs;
        ``model.notebookkit_banner`` holds the load report.
    """
    if not isinstance(model_name, (str, os.PathLike)) or not os.fspath(model_name).strip():
        raise TypeError(
            f"FastVisionModel.from_pretrained: model_name={model_name!r} is not a model name. Pass a built-in tiny "
            "model such as 'notebookkit/tiny-qwen2.5-vl', a Hugging Face Hub id such as "
            "'Qwen/Qwen2.5-VL-7B-Instruct', or a local folder."
        )
    where = "FastVisionModel.from_pretrained"
    max_seq_length = arguments.positive_int(
        max_seq_length, "max_seq_length", where,
        "It is the longest sequence, in tokens and image tokens included, you will train on: e.g. 2048.",
    )
    banner = loader._load_banner(kwargs)
    if kwargs.pop("load_in_16bit", False):
        load_in_4bit = load_in_8bit = False
    if os.environ.get("NOTEBOOKKIT_FAST_PATH", "1") in ("0", "false", "False"):
        fast_path = False
    path, kind = resolve_vision(model_name)
    adapter_cfg = loader._read_adapter_config(path) if kind != "hub" else None
    offload_embedding = offload_embedding_value(offload_embedding)
    common = dict(max_seq_length=max_seq_length, dtype=dtype, load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit,
                  full_finetuning=full_finetuning, token=token, device_map=device_map,
                  trust_remote_code=trust_remote_code, attn_implementation=attn_implementation, fast_path=fast_path,
                  offload_embedding=offload_embedding)
    if adapter_cfg is not None:
        return _load_adapter_folder(path, adapter_cfg, show_banner=show_banner, **common, **kwargs)

    config = loader._load_config(path, kind, model_name, token=token, trust_remote_code=trust_remote_code)
    family = for_vision_model_type(getattr(config, "model_type", None))
    if family is None:
        raise vision_support_error(getattr(config, "model_type", None), f"{os.fspath(model_name)!r}")
    banner.header.append(f"vision-language model: {family.vision.model_class} ({family.name} decoder)")
    device_map, torch_dtype = loader._placement(device_map, dtype, banner)
    torch_dtype = family_dtype(config, torch_dtype, dtype, banner)
    quant = loader._weights_format(config, load_in_4bit, load_in_8bit, full_finetuning, torch_dtype, banner)
    load_kwargs = loader.weights_kwargs(torch_dtype, token, trust_remote_code, device_map, quant, attn_implementation,
                                        kwargs)
    import transformers

    model = loader._load_weights(path, kind, model_name, load_kwargs, getattr(transformers, family.vision.model_class),
                                 api=from_pretrained, where=where)

    from .vision_processor import load_processor

    processor = load_processor(path, family.vision, banner, token=token, trust_remote_code=trust_remote_code)
    loader._fix_tokenizer(processor.tokenizer, model, banner, max_seq_length)
    finish_vision_model(model, banner, max_seq_length, full_finetuning, fast_path)
    if offload_embedding:
        offload_input_embedding(model, banner)
    if show_banner:
        banner.show()
    return model, processor


def finish_vision_model(model, banner: Banner, max_seq_length: int, full_finetuning: bool, fast_path: bool) -> None:
    """Attach the banner and the length limit, set trainability, patch the fused path (when asked)."""
    object.__setattr__(model, "notebookkit_banner", banner)
    object.__setattr__(model, "max_seq_length", int(max_seq_length))
    for p in model.parameters():
        p.requires_grad_(bool(full_finetuning) and p.is_floating_point())
    if full_finetuning:
        banner.header.append("training: full fine-tuning (every weight trainable)")
    from .patch_linear4bit import describe_linear4bit, patch_linear4bit

    if fast_path:
        from .patch_vision import patch_vision_model

        patch_vision_model(model, banner)
    else:
        banner.feature("fast path", False, "disabled by fast_path=False / NOTEBOOKKIT_FAST_PATH=0: stock Hugging Face code")
        describe_linear4bit(model, banner, patch_linear4bit(model))
    from .vision_decode import attach_image_prompts

    attach_image_prompts(model)
    from .export_hook import attach_export_methods

    attach_export_methods(model)


def _load_adapter_folder(path: str, adapter_cfg: dict, show_banner: bool = True, **kw: Any):
    """Base model (by ``base_model_name_or_path``), then the saved adapter on top, trainable."""
    from peft import PeftModel

    from .export_hook import attach_export_methods
    from .lora_fast_path import describe_lora
    from .patch_linear4bit import guard_lora_merges
    from .patch_vision import patch_tower_adapters

    base_name = adapter_cfg.get("base_model_name_or_path")
    if not base_name:
        raise ValueError(
            f"{path}/adapter_config.json has no base_model_name_or_path, so the base model is unknown. Load the base "
            "model with FastVisionModel.from_pretrained first, then attach the adapter with "
            "peft.PeftModel.from_pretrained(model, path)."
        )
    model, processor = from_pretrained(base_name, show_banner=False, **kw)
    banner: Banner = model.notebookkit_banner
    peft_model = PeftModel.from_pretrained(model, path, is_trainable=True)
    guard_lora_merges(peft_model)
    patch_tower_adapters(peft_model, banner)
    object.__setattr__(peft_model, "notebookkit_banner", banner)
    attach_export_methods(peft_model)
    banner.header.append(f"adapter: {path} on base {base_name}")
    describe_lora(peft_model, banner)
    if any((Path(path) / f).is_file() for f in ("processor_config.json", "preprocessor_config.json")):
        from .vision_processor import load_processor
        from .patch_vision import vision_family

        try:
            processor = load_processor(path, vision_family(model).vision, banner)
        except Exception as exc:  # noqa: BLE001 - the base model's processor is the same but for the template
            banner.note(f"the processor saved with the adapter did not load ({type(exc).__name__}: {exc}); "
                        f"using the base model's")
        loader._fix_tokenizer(processor.tokenizer, model, banner, kw.get("max_seq_length", 2048))
    if show_banner:
        banner.show()
    return peft_model, processor


__all__ = ["finish_vision_model", "from_pretrained", "resolve_vision"]
