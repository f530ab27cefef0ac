"""The one load pipeline behind ``FastLanguageModel.from_pretrained`` and ``FastVisionModel.from_pretrained``.

:func:`load` runs the same steps for every model; a :class:`LoadVariant` passes in what differs (the
text variant, :data:`TEXT_MODEL`, is here; the vision-language one is
:data:`notebookkit.models.vision.loader.VISION_MODEL`)::

    check model_name and max_seq_length -> banner -> resolve the name (variant.resolve)
      -> a LoRA adapter folder: load its base through this pipeline, then the adapter on top
      -> config -> variant.check_config -> device and dtype -> weights format
      -> weights (variant.model_class) -> tokenizer or processor (variant.load_processor)
      -> finish: limits, trainability, variant.patch (or stock code), variant.on_loaded
      -> input embedding offload -> banner

Resolution order for ``model_name``:

1. a reserved tiny name (``"notebookkit/tiny-llama"`` ...): built once, offline, by
   ``notebookkit.embedded.tiny`` and loaded from its cache folder;
2. a local folder: a model folder (``config.json``) or a LoRA adapter folder (``adapter_config.json``,
   whose base model is loaded first, then the adapter on top);
3. a Hugging Face Hub name, loaded through the usual cache; when it is neither cached nor reachable
   the user gets one readable error (:mod:`.offline`), not a chain of HTTP tracebacks.

Precision: ``dtype=None`` picks bf16 on GPUs that support it, fp16 on other GPUs (T4), fp32 on CPU.
``load_in_4bit`` quantises linear weights to NF4 with double quantisation through bitsandbytes,
computing in that dtype, and a mixture of experts' stacked expert weights in the same format by
:mod:`.nf4_experts` (bitsandbytes quantises ``nn.Linear`` only), each as it is read from the checkpoint
(:mod:`.stream_nf4_experts`: the 16-bit experts never all exist); checkpoints saved already quantised load as
they are.
"""

from __future__ import annotations

import inspect
import json
import os
import warnings
from contextlib import nullcontext
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn

from notebookkit.export.bind import bind_export_methods
from notebookkit.families import Family, for_model_type

from . import arguments
from ..common.banner import Banner, device_line, versions_line
from ..common.precision import family_dtype, is_bfloat16_supported
from .offline import explain_unreachable
from .nf4_experts import quantize_moe_experts
from .offload_embedding import offload_embedding_value, offload_input_embedding
from .stream_nf4_experts import ExpertTally, quantize_experts_as_read

_UNSUPPORTED_KWARGS = {
    "fast_inference": (
        "notebookkit has no vLLM engine: model.generate and TRL's trainers (use_vllm=False) generate with this "
        "patched model; model.fast_generate and model.load_lora do not exist"
    ),
    "gpu_memory_utilization": "only used by vLLM fast inference",
    "max_lora_rank": "only used by vLLM fast inference",
    "fix_tokenizer": "tokenizers load unchanged; a missing pad token is still added",
    "use_exact_model_name": "names are used as given",
    "resize_model_vocab": "vocabulary resizing is not done at load time",
    "float8_kv_cache": "not supported",
    "disable_log_stats": "only used by vLLM fast inference",
    "unsloth_force_compile": "notebookkit does not torch.compile the model; the fused kernels run as they are",
}

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def pick_dtype(dtype: Union[None, str, torch.dtype], device_type: str, banner: Optional[Banner] = None) -> torch.dtype:
    """Resolve ``dtype=None``/strings to a torch dtype for ``device_type`` ("cuda" or "cpu").

    ``None`` is bf16 on a GPU with native bf16, fp16 on other GPUs (T4, V100), fp32 on CPU.
    """
    if isinstance(dtype, str):
        name = dtype.replace("torch.", "").lower()
        aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
        name = aliases.get(name, name)
        if name not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of None, 'bfloat16', 'float16', 'float32'.")
        dtype = _DTYPES[name]
    elif dtype is not None and dtype not in _DTYPES.values():
        raise ValueError(
            f"dtype={dtype!r} is not one of None, torch.bfloat16, torch.float16, torch.float32 (or their names "
            "'bfloat16', 'float16', 'float32'). None picks the best one for this machine."
        )
    if dtype is None:
        if device_type == "cuda":
            return torch.bfloat16 if is_bfloat16_supported() else torch.float16
        return torch.float32
    if dtype == torch.bfloat16 and device_type == "cuda" and not is_bfloat16_supported():
        if banner is not None:
            banner.note("this GPU has no bf16: using float16 instead of the requested bfloat16")
        return torch.float16
    return dtype


def resolve(model_name: Union[str, os.PathLike]) -> tuple[str, str]:
    """``(path_or_hub_id, kind)`` with kind one of ``"tiny"``, ``"local"``, ``"hub"``.

    Reserved tiny names are built (once, offline) into a local folder; an unknown
    ``"notebookkit/..."`` name raises an error listing the valid ones.
    """
    from notebookkit.embedded.tiny import is_tiny_model_name, resolve_model_name

    name = os.fspath(model_name)
    if is_tiny_model_name(name):
        return str(resolve_model_name(name)), "tiny"
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        return os.path.abspath(expanded), "local"
    resolve_model_name(name)  # raises for unknown "notebookkit/..." names
    return name, "hub"


def read_adapter_config(path: str) -> Optional[dict]:
    """The ``adapter_config.json`` of a LoRA adapter folder, or ``None`` when ``path`` holds none."""
    cfg = Path(path) / "adapter_config.json"
    if cfg.is_file():
        return json.loads(cfg.read_text())
    return None


def default_device_map(device_map: Any) -> Any:
    """``device_map`` as given, else this process's GPU (``LOCAL_RANK`` under a launcher), else ``None`` (CPU)."""
    if device_map is not None:
        return device_map
    if torch.cuda.is_available():
        # Under torchrun / accelerate launch every process owns the GPU of its LOCAL_RANK; CUDA's
        # current device is still 0 there unless the script set it, so read the launcher's variables.
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("LOCAL_RANK", "") != "":
            return {"": int(os.environ["LOCAL_RANK"])}
        return {"": torch.cuda.current_device()}
    return None


def fix_tokenizer(tokenizer, model, banner: Banner, max_seq_length: int) -> None:
    """A pad token (unk, else eos, else a new ``<|pad|>``), right padding, the length limit, and the
    model's ``pad_token_id`` set from it."""
    if tokenizer.pad_token is None:
        if getattr(tokenizer, "unk_token", None) is not None and tokenizer.unk_token != tokenizer.eos_token:
            tokenizer.pad_token = tokenizer.unk_token
        elif tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
            model.resize_token_embeddings(len(tokenizer))
        banner.note(f"tokenizer had no pad token: using {tokenizer.pad_token!r}")
    tokenizer.padding_side = "right"
    tokenizer.model_max_length = max_seq_length
    for cfg in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        if cfg is not None and getattr(cfg, "pad_token_id", None) is None:
            cfg.pad_token_id = tokenizer.pad_token_id


def quant_config(load_in_4bit: bool, load_in_8bit: bool, dtype: torch.dtype, banner: Banner):
    """The ``BitsAndBytesConfig`` for NF4 (double quantisation) or LLM.int8, or ``None`` (16-bit, or no bitsandbytes)."""
    if not (load_in_4bit or load_in_8bit):
        return None
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except Exception as exc:  # noqa: BLE001
        banner.note(f"bitsandbytes is unavailable ({exc}); loading 16-bit weights instead of quantised ones")
        return None
    if load_in_4bit:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_storage=torch.uint8,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


@dataclass(frozen=True)
class LoadVariant:
    """What differs between loading one kind of model and another; :func:`load` does everything else.

    Every hook receives what the steps before it produced; ``checked`` is what :attr:`check_config`
    returned (the vision variant: the model's family record).
    """

    where: str  # the API name errors speak of: ``"from_pretrained"``, ``"FastVisionModel.from_pretrained"``
    default_model_name: str  # the tiny model loaded when no name is given (also the example in errors)
    example_hub_name: str  # a Hub id the bad-``model_name`` error shows
    length_hint: str  # the bad-``max_seq_length`` error's hint
    base_model_hint: str  # how an adapter folder without a base should be loaded instead
    resolve: Callable[[str], tuple[str, str]]  # ``model_name`` -> ``(path or hub id, "tiny" | "local" | "hub")``
    check_config: Callable[[Any, Union[str, os.PathLike], Banner], Any]  # refuse or describe the config
    model_class: Callable[[Any], Any]  # ``checked`` -> the transformers class whose ``from_pretrained`` loads it
    load_processor: Callable[..., Any]  # ``(path, checked, banner, **hub keywords)`` -> tokenizer or processor
    tokenizer_of: Callable[[Any], Any]  # the tokenizer inside what ``load_processor`` returned
    saved_processor: Callable[[str, nn.Module, Banner], Any]  # an adapter folder's own processor, or ``None``
    patch: Callable[[nn.Module, Banner], Any]  # the fused path, when ``fast_path``
    on_adapter: Callable[[nn.Module, Banner], Any]  # after PEFT loaded a saved adapter (``peft_model, banner``)
    on_loaded: Callable[[nn.Module], Any]  # run on every model loaded, patched or not
    # the banner notes a ``max_seq_length`` beyond the config's ``max_position_embeddings`` (the text
    # loader always has; the vision loader never did, kept so that its banner stays as it was)
    notes_position_limit: bool = True


def load(
    variant: LoadVariant,
    model_name: Union[str, os.PathLike],
    max_seq_length: int = 2048,
    dtype: Union[None, str, torch.dtype] = None,
    load_in_4bit: bool = True,
    load_in_8bit: bool = False,
    load_in_2bit: bool = False,
    load_in_ternary: bool = False,
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
    """Load ``model_name`` as ``variant`` says (the steps: module docstring); returns ``(model, tokenizer or processor)``.

    The keywords are those of ``FastLanguageModel.from_pretrained`` / ``FastVisionModel.from_pretrained``
    (:func:`entry_point` makes those two from this signature).
    """
    if not isinstance(model_name, (str, os.PathLike)) or not os.fspath(model_name).strip():
        raise TypeError(
            f"{variant.where}: model_name={model_name!r} is not a model name. Pass a built-in tiny model such as "
            f"{variant.default_model_name!r}, a Hugging Face Hub id such as {variant.example_hub_name!r}, or a "
            "local folder."
        )
    max_seq_length = arguments.positive_int(max_seq_length, "max_seq_length", variant.where, variant.length_hint)
    banner = start_banner(kwargs)
    if kwargs.pop("load_in_16bit", False):  # 16-bit LoRA, the other notebooks' spelling
        load_in_4bit = load_in_8bit = False
    if os.environ.get("NOTEBOOKKIT_FAST_PATH", "1") in ("0", "false", "False"):
        fast_path = False
    offload_embedding = offload_embedding_value(offload_embedding)

    path, kind = variant.resolve(model_name)

    adapter_cfg = read_adapter_config(path) if kind != "hub" else None
    if adapter_cfg is not None:
        return load_adapter_folder(
            variant, path, adapter_cfg,
            max_seq_length=max_seq_length, dtype=dtype, load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit,
            load_in_2bit=load_in_2bit, load_in_ternary=load_in_ternary, full_finetuning=full_finetuning, token=token, device_map=device_map,
            trust_remote_code=trust_remote_code, attn_implementation=attn_implementation,
            fast_path=fast_path, offload_embedding=offload_embedding, show_banner=show_banner, **kwargs,
        )

    config = load_config(path, kind, model_name, token=token, trust_remote_code=trust_remote_code)
    checked = variant.check_config(config, model_name, banner)
    device_map, torch_dtype = placement(device_map, dtype, banner)
    torch_dtype = family_dtype(config, torch_dtype, dtype, banner)
    low_bit = low_bit_format(variant, config, load_in_2bit, load_in_ternary)
    if low_bit is None:
        quant = weights_format(config, load_in_4bit, load_in_8bit, full_finetuning, torch_dtype, banner)
        load_kwargs = weights_kwargs(torch_dtype, token, trust_remote_code, device_map, quant, attn_implementation,
                                     kwargs)
        family = nf4_experts_family(config, quant)
        read = ExpertTally()
        with quantize_experts_as_read(read) if family is not None else nullcontext():
            model = load_weights(path, kind, model_name, load_kwargs, variant.model_class(checked),
                                 where=variant.where)
        if family is not None:
            quantize_moe_experts(model, family, banner, read)
    else:
        from ..low_bit.loading import load_weights_low_bit

        model = load_weights_low_bit(path, kind, config, low_bit, variant.model_class(checked), torch_dtype,
                                     device_map, banner, token=token, attn_implementation=attn_implementation,
                                     extra=kwargs, where=variant.where)
    from notebookkit.memory.model_setup import record_base_format

    from ..low_bit.loading import loaded_base_format

    base_format_name = loaded_base_format(model)
    if base_format_name is not None:  # 8-bit has no base-format record
        record_base_format(model, base_format_name)

    processor = variant.load_processor(path, checked, banner, token=token, trust_remote_code=trust_remote_code)
    fix_tokenizer(variant.tokenizer_of(processor), model, banner, max_seq_length)

    finish_model(model, banner, variant, max_seq_length=max_seq_length, full_finetuning=full_finetuning,
                 fast_path=fast_path)
    if offload_embedding:
        offload_input_embedding(model, banner)
    if show_banner:
        banner.show()
    return model, processor


#: the keywords :func:`load` reads, besides ``variant`` (what both public ``from_pretrained`` take)
LOAD_KEYWORDS = tuple(name for name in inspect.signature(load).parameters if name not in ("variant", "kwargs"))


def entry_point(variant: LoadVariant, module: str, doc: str) -> Callable[..., tuple[Any, Any]]:
    """The public ``from_pretrained`` of ``variant`` (defined in ``module``): :func:`load`'s keywords
    (written once, there), the variant's default ``model_name``, and ``doc`` for ``help()`` / ``?``."""
    parameters = list(inspect.signature(load).parameters.values())[1:]  # all but ``variant``
    parameters[0] = parameters[0].replace(default=variant.default_model_name)
    signature = inspect.Signature(parameters)

    def from_pretrained(*args: Any, **kwargs: Any):
        bound = signature.bind(*args, **kwargs)
        from ..low_bit.flags import check_flag_conflicts

        check_flag_conflicts({**bound.arguments, **bound.arguments.get("kwargs", {})}, variant.where)
        bound.apply_defaults()
        options = dict(bound.arguments)
        extra = options.pop("kwargs")
        return load(variant, **options, **extra)

    from_pretrained.__signature__ = signature  # type: ignore[attr-defined]
    from_pretrained.__doc__ = doc
    from_pretrained.__qualname__ = "from_pretrained"
    from_pretrained.__module__ = module
    return from_pretrained


def low_bit_format(variant: LoadVariant, config: Any, load_in_2bit: bool, load_in_ternary: bool) -> Optional[str]:
    """``"2bit"`` / ``"ternary"`` when the keywords or the checkpoint ask for a low-bit base
    (:func:`~notebookkit.models.low_bit.flags.format_to_load`), else ``None``; only causal LMs
    (:data:`TEXT_MODEL`) load so."""
    from ..low_bit.flags import format_to_load

    wanted = format_to_load(config, load_in_2bit, load_in_ternary, variant.where)
    if wanted is not None and variant.model_class is not _auto_causal_lm:
        raise ValueError(f"{variant.where}: 2-bit and ternary bases are for causal language models "
                         "(FastLanguageModel.from_pretrained); load this model with load_in_4bit=True or in 16-bit.")
    family = for_model_type(getattr(config, "model_type", None))
    if wanted is not None and family is not None and family.moe is not None:
        raise ValueError(f"{variant.where}: 2-bit and ternary bases do not cover mixture-of-experts models yet "
                         f"({family.name}: its experts are stacked 3-D weights, not the linear layers these formats "
                         "hold; issue #36). Load it with load_in_4bit=True or in 16-bit.")
    return wanted


def weights_kwargs(torch_dtype: torch.dtype, token: Optional[str], trust_remote_code: bool, device_map: Any,
                   quant: Any, attn_implementation: Optional[str], extra: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of the model class's ``from_pretrained`` (the caller's ``extra`` ones last)."""
    load_kwargs: dict[str, Any] = dict(dtype=torch_dtype, token=token, trust_remote_code=trust_remote_code)
    if device_map is not None:
        load_kwargs["device_map"] = device_map
    if quant is not None:
        load_kwargs["quantization_config"] = quant
    if attn_implementation is not None:
        load_kwargs["attn_implementation"] = attn_implementation
    load_kwargs.update(extra)
    return load_kwargs


def start_banner(kwargs: dict[str, Any]) -> Banner:
    """A new load banner; drops the keyword arguments notebookkit does not use (noting the set ones)."""
    banner = Banner()
    banner.header.append(versions_line())
    for key in list(kwargs):
        if key in _UNSUPPORTED_KWARGS:
            value = kwargs.pop(key)
            if value not in (None, False, 0):
                banner.note(f"{key}={value!r} ignored: {_UNSUPPORTED_KWARGS[key]}")
    kwargs.pop("use_gradient_checkpointing", None)
    kwargs.pop("random_state", None)
    return banner


def load_config(path: str, kind: str, model_name: Union[str, os.PathLike], **kwargs: Any):
    """The model's Hugging Face config; one readable error when a hub name cannot be fetched."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, **kwargs)
    except Exception as exc:  # noqa: BLE001 - one readable error instead of a traceback chain
        if kind == "hub":
            raise explain_unreachable(os.fspath(model_name), exc) from None
        raise


def placement(device_map: Any, dtype: Union[None, str, torch.dtype], banner: Banner) -> tuple[Any, torch.dtype]:
    """``(device_map, compute dtype)``: the current GPU (or CPU) unless a map is given, and its dtype."""
    device_map = default_device_map(device_map)
    device_type = "cuda" if torch.cuda.is_available() and device_map not in ("cpu", {"": "cpu"}) else "cpu"
    banner.header.append(device_line(torch.device(device_type)))
    return device_map, pick_dtype(dtype, device_type, banner)


def weights_format(config: Any, load_in_4bit: bool, load_in_8bit: bool, full_finetuning: bool,
                   torch_dtype: torch.dtype, banner: Banner):
    """The bitsandbytes config to load with (``None``: as saved, or 16-bit); the banner says which."""
    prequantised = getattr(config, "quantization_config", None)
    if full_finetuning and (load_in_4bit or load_in_8bit):
        banner.note("full_finetuning=True: loading 16-bit weights (4/8-bit loading is for LoRA)")
        load_in_4bit = load_in_8bit = False
    if load_in_8bit:
        load_in_4bit = False
    if prequantised is not None:
        qmethod = prequantised.get("quant_method") if isinstance(prequantised, dict) else getattr(prequantised, "quant_method", "?")
        banner.header.append(f"weights: pre-quantised checkpoint ({qmethod}), loaded as saved; compute {_dtype_name(torch_dtype)}")
        return None
    quant = quant_config(load_in_4bit, load_in_8bit, torch_dtype, banner)
    if quant is None:
        banner.header.append(f"weights: {_dtype_name(torch_dtype)}")
    elif load_in_4bit:
        banner.header.append(f"weights: NF4 4-bit, double quantisation, compute {_dtype_name(torch_dtype)}")
    else:
        banner.header.append(f"weights: LLM.int8 8-bit, compute {_dtype_name(torch_dtype)}")
    return quant


def nf4_experts_family(config: Any, quant: Any) -> Optional[Family]:
    """The family record when a mixture of experts loads under ``load_in_4bit`` (its stacked experts go to NF4
    too: bitsandbytes quantises ``nn.Linear`` only, :mod:`.nf4_experts`), else ``None`` (a dense model, 16-bit,
    8-bit or a pre-quantised checkpoint: loaded as before)."""
    family = for_model_type(getattr(config, "model_type", None))
    if family is None or family.moe is None or not getattr(quant, "load_in_4bit", False):
        return None
    return family


def load_weights(path: str, kind: str, model_name: Union[str, os.PathLike], load_kwargs: dict[str, Any],
                 model_class: Any, where: str):
    """``model_class.from_pretrained``; one readable error when a hub name cannot be fetched or a keyword
    is misspelt (the known ones: :data:`LOAD_KEYWORDS` and the ignored ones)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch_dtype.*")
            return model_class.from_pretrained(path, **load_kwargs)
    except OSError as exc:
        if kind == "hub":
            raise explain_unreachable(os.fspath(model_name), exc) from None
        raise
    except TypeError as exc:  # a misspelt keyword reaches the model class's __init__
        keyword = arguments.unknown_keyword(exc, load_kwargs)
        if keyword is None:
            raise
        known = [*LOAD_KEYWORDS, *_UNSUPPORTED_KWARGS, "load_in_16bit"]
        raise arguments.unknown_keyword_error(where, keyword, known, "transformers' from_pretrained") from None


def finish_model(model, banner: Banner, variant: LoadVariant, max_seq_length: int, full_finetuning: bool,
                 fast_path: bool) -> None:
    """Attach the banner and limits, set trainability, and patch the fused path (when asked)."""
    object.__setattr__(model, "notebookkit_banner", banner)
    object.__setattr__(model, "max_seq_length", int(max_seq_length))
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    max_pos = getattr(text_config, "max_position_embeddings", None)
    if variant.notes_position_limit and max_pos is not None and max_seq_length > max_pos:
        banner.note(
            f"max_seq_length={max_seq_length} is longer than the model's max_position_embeddings={max_pos}; "
            "quality beyond that length depends on the model's RoPE settings"
        )
    for p in model.parameters():  # integer (quantised) tensors can never require gradients
        p.requires_grad_(bool(full_finetuning) and p.is_floating_point())
    if full_finetuning:
        banner.header.append("training: full fine-tuning (every weight trainable)")

    from notebookkit.base_layers.linear4bit import describe_linear4bit, patch_linear4bit

    if fast_path:
        variant.patch(model, banner)
    else:
        banner.feature("fast path", False, "disabled by fast_path=False / NOTEBOOKKIT_FAST_PATH=0: stock Hugging Face code")
        # Stock code, but never bitsandbytes' CPU NF4 decode (wrong on AVX-512 CPUs): see patch_linear4bit.
        describe_linear4bit(model, banner, patch_linear4bit(model))
    variant.on_loaded(model)
    bind_export_methods(model)


def load_adapter_folder(variant: LoadVariant, path: str, adapter_cfg: dict, show_banner: bool = True, **kw: Any):
    """Base model (by ``base_model_name_or_path``, through :func:`load`), then the saved adapter on top, trainable."""
    from peft import PeftModel

    from ..patching.lora_fast_path import describe_lora
    from ..low_bit.merge_guard import guard_low_bit_merges
    from notebookkit.base_layers.linear4bit import guard_lora_merges

    base_name = adapter_cfg.get("base_model_name_or_path")
    if not base_name:
        raise ValueError(
            f"{path}/adapter_config.json has no base_model_name_or_path, so the base model is unknown. "
            f"Load {variant.base_model_hint} first, then attach the adapter with "
            "peft.PeftModel.from_pretrained(model, path)."
        )
    model, processor = load(variant, base_name, show_banner=False, **kw)
    banner: Banner = model.notebookkit_banner
    peft_model = PeftModel.from_pretrained(model, path, is_trainable=True)
    guard_lora_merges(peft_model)
    guard_low_bit_merges(peft_model)
    variant.on_adapter(peft_model, banner)
    object.__setattr__(peft_model, "notebookkit_banner", banner)
    bind_export_methods(peft_model)
    banner.header.append(f"adapter: {path} on base {base_name}")
    describe_lora(peft_model, banner)
    saved = variant.saved_processor(path, model, banner)
    if saved is not None:
        processor = saved
        fix_tokenizer(variant.tokenizer_of(processor), model, banner, kw.get("max_seq_length", 2048))
    if show_banner:
        banner.show()
    return peft_model, processor


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _auto_causal_lm(checked: Any):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def _auto_tokenizer(path: str, checked: Any, banner: Banner, **hub: Any):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, **hub)


def _saved_tokenizer(path: str, model: nn.Module, banner: Banner):
    if not (Path(path) / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _patch_text_model(model: nn.Module, banner: Banner) -> Banner:
    from ..patching.patcher import patch_model

    return patch_model(model, banner)


def _nothing(*args: Any) -> None:
    return None


#: a causal LM and its tokenizer, patched by :func:`notebookkit.models.patching.patcher.patch_model`
TEXT_MODEL = LoadVariant(
    where="from_pretrained",
    default_model_name="notebookkit/tiny-llama",
    example_hub_name="Qwen/Qwen2.5-0.5B-Instruct",
    length_hint="It is the longest sequence, in tokens, you will train on: e.g. max_seq_length=2048.",
    base_model_hint="the base model",
    resolve=resolve,
    check_config=_nothing,
    model_class=_auto_causal_lm,
    load_processor=_auto_tokenizer,
    tokenizer_of=lambda tokenizer: tokenizer,
    saved_processor=_saved_tokenizer,
    patch=_patch_text_model,
    on_adapter=_nothing,
    on_loaded=_nothing,
)

from_pretrained = entry_point(TEXT_MODEL, __name__, """Load a causal language model and its tokenizer, patched onto the fused kernels.

    Args:
        model_name: a reserved tiny name (``"notebookkit/tiny-llama"``, ``-mistral``, ``-qwen2``,
            ``-qwen3``, ``-gemma``, ``-gemma2``, ``-gemma3``), a local model or LoRA-adapter folder,
            or a Hugging Face Hub name.
        max_seq_length: longest sequence you will train on; longer training batches raise an error
            that says so.
        dtype: ``None`` (bf16 if the GPU supports it, else fp16; fp32 on CPU), or a torch dtype/name.
        load_in_4bit: NF4 weights with double quantisation (QLoRA). Ignored for pre-quantised
            checkpoints (they load as saved) and for ``full_finetuning``.
        load_in_8bit: LLM.int8 weights (runs LoRA on stock PEFT code: no fused 8-bit path).
        load_in_2bit: notebookkit's 2-bit base (groups of 64 weights with an fp16 scale and zero,
            2.5 bits a weight), quantised on load one tensor at a time from a 16-bit safetensors
            checkpoint; a checkpoint saved from such a model loads as saved.
            :mod:`notebookkit.models.low_bit`.
        load_in_ternary: a ternary base (weights in {-1, 0, +1} times an fp16 scale a row, about 2 bits
            a weight), quantised on load; BitNet b1.58 checkpoints always load this way.
        full_finetuning: train every weight (no quantisation, no LoRA).
        token: Hugging Face token for gated models.
        device_map: ``None`` (the current GPU, or CPU), ``"auto"``, ``"sequential"``, ``"balanced"``
            or an explicit map, as in ``transformers``.
        trust_remote_code: allow custom modelling code from the Hub (runs on stock code).
        attn_implementation: Hugging Face attention backend for anything left unpatched.
        fast_path: set ``False`` to load on stock Hugging Face code (for comparisons).
        offload_embedding: keep the input embedding table in pinned host memory, read by the GPU in
            place (saves ``vocab x hidden`` 16-bit values of GPU memory: 0.98 GiB for Llama-3.1-8B; not for
            models whose LM head is tied to it). :mod:`notebookkit.models.loading.offload_embedding`.
        show_banner: print the load report (kept in ``model.notebookkit_banner`` either way).

    Returns:
        ``(model, tokenizer)``; ``model.notebookkit_banner`` holds the load report.
    """)
