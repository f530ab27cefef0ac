"""``FastLanguageModel.from_pretrained``: resolve a name, load a Hugging Face causal LM, patch it.

Resolution order for ``model_name``:

1. a reserved tiny name (``"notebookkit/tiny-llama"`` ...): built once, offline, by
   ``notebookkit.embedded.tiny`` and loaded from its cache folder;
2. a local folder: a model folder (``config.json``) or a LoRA adapter folder (``adapter_config.json``,
   whose base model is loaded first, then the adapter on top);
3. a Hugging Face Hub name, loaded through the usual cache; when it is neither cached nor reachable
   the user gets one readable error (:mod:`.offline`), not a chain of HTTP tracebacks.

Precision: ``dtype=None`` picks bf16 on GPUs that support it, fp16 on other GPUs (T4), fp32 on CPU.
``load_in_4bit`` quantises linear weights to NF4 with double quantisation through bitsandbytes,
computing in that dtype; checkpoints saved already quantised load as they are.
"""

from __future__ import annotations

import inspect
import json
import os
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch

from . import arguments
from .banner import Banner, device_line, versions_line
from .offline import explain_unreachable
from .offload_embedding import offload_embedding_value, offload_input_embedding
from .precision import family_dtype, is_bfloat16_supported

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


def _read_adapter_config(path: str) -> Optional[dict]:
    cfg = Path(path) / "adapter_config.json"
    if cfg.is_file():
        return json.loads(cfg.read_text())
    return None


def _default_device_map(device_map: Any) -> Any:
    if device_map is not None:
        return device_map
    if torch.cuda.is_available():
        # Under torchrun / accelerate launch every process owns the GPU of its LOCAL_RANK; CUDA's
        # current device is still 0 there unless the script set it, so read the launcher's variables.
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("LOCAL_RANK", "") != "":
            return {"": int(os.environ["LOCAL_RANK"])}
        return {"": torch.cuda.current_device()}
    return None


def _fix_tokenizer(tokenizer, model, banner: Banner, max_seq_length: int) -> None:
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


def _quant_config(load_in_4bit: bool, load_in_8bit: bool, dtype: torch.dtype, banner: Banner):
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


def from_pretrained(
    model_name: Union[str, os.PathLike] = "notebookkit/tiny-llama",
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
    """Load a causal language model and its tokenizer, patched onto the fused kernels.

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
        full_finetuning: train every weight (no quantisation, no LoRA).
        token: Hugging Face token for gated models.
        device_map: ``None`` (the current GPU, or CPU), ``"auto"``, ``"sequential"``, ``"balanced"``
            or an explicit map, as in ``transformers``.
        trust_remote_code: allow custom modelling code from the Hub (runs on stock code).
        attn_implementation: Hugging Face attention backend for anything left unpatched.
        fast_path: set ``False`` to load on stock Hugging Face code (for comparisons).
        offload_embedding: keep the input embedding table in pinned host memory, read by the GPU in
            place (saves ``vocab x hidden`` 16-bit values of GPU memory: 0.98 GiB for Llama-3.1-8B; not for
            models whose LM head is tied to it). :mod:`notebookkit.models.offload_embedding`.

    Returns:
        ``(model, tokenizer)``; ``model.notebookkit_banner`` holds the load report.
    """
    from transformers import AutoTokenizer

    if not isinstance(model_name, (str, os.PathLike)) or not os.fspath(model_name).strip():
        raise TypeError(
            f"from_pretrained: model_name={model_name!r} is not a model name. Pass a built-in tiny model such as "
            "'notebookkit/tiny-llama', a Hugging Face Hub id such as 'Qwen/Qwen2.5-0.5B-Instruct', or a local folder."
        )
    max_seq_length = arguments.positive_int(
        max_seq_length, "max_seq_length", "from_pretrained",
        "It is the longest sequence, in tokens, you will train on: e.g. max_seq_length=2048.",
    )
    banner = _load_banner(kwargs)
    if kwargs.pop("load_in_16bit", False):  # 16-bit LoRA, the other notebooks' spelling
        load_in_4bit = load_in_8bit = False
    if os.environ.get("NOTEBOOKKIT_FAST_PATH", "1") in ("0", "false", "False"):
        fast_path = False
    offload_embedding = offload_embedding_value(offload_embedding)

    path, kind = resolve(model_name)

    adapter_cfg = _read_adapter_config(path) if kind != "hub" else None
    if adapter_cfg is not None:
        return _load_adapter_folder(
            path, adapter_cfg, banner,
            max_seq_length=max_seq_length, dtype=dtype, load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit,
            full_finetuning=full_finetuning, token=token, device_map=device_map,
            trust_remote_code=trust_remote_code, attn_implementation=attn_implementation,
            fast_path=fast_path, offload_embedding=offload_embedding, show_banner=show_banner, **kwargs,
        )

    config = _load_config(path, kind, model_name, token=token, trust_remote_code=trust_remote_code)
    device_map, torch_dtype = _placement(device_map, dtype, banner)
    torch_dtype = family_dtype(config, torch_dtype, dtype, banner)
    quant = _weights_format(config, load_in_4bit, load_in_8bit, full_finetuning, torch_dtype, banner)

    load_kwargs = weights_kwargs(torch_dtype, token, trust_remote_code, device_map, quant, attn_implementation, kwargs)
    model = _load_weights(path, kind, model_name, load_kwargs)

    tokenizer = AutoTokenizer.from_pretrained(path, token=token, trust_remote_code=trust_remote_code)
    _fix_tokenizer(tokenizer, model, banner, max_seq_length)

    finish_model(model, banner, max_seq_length=max_seq_length, full_finetuning=full_finetuning, fast_path=fast_path)
    if offload_embedding:
        offload_input_embedding(model, banner)
    if show_banner:
        banner.show()
    return model, tokenizer


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


def _load_banner(kwargs: dict[str, Any]) -> Banner:
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


def _load_config(path: str, kind: str, model_name: Union[str, os.PathLike], **kwargs: Any):
    """The model's Hugging Face config; one readable error when a hub name cannot be fetched."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, **kwargs)
    except Exception as exc:  # noqa: BLE001 - one readable error instead of a traceback chain
        if kind == "hub":
            raise explain_unreachable(os.fspath(model_name), exc) from None
        raise


def _placement(device_map: Any, dtype: Union[None, str, torch.dtype], banner: Banner) -> tuple[Any, torch.dtype]:
    """``(device_map, compute dtype)``: the current GPU (or CPU) unless a map is given, and its dtype."""
    device_map = _default_device_map(device_map)
    device_type = "cuda" if torch.cuda.is_available() and device_map not in ("cpu", {"": "cpu"}) else "cpu"
    banner.header.append(device_line(torch.device(device_type)))
    return device_map, pick_dtype(dtype, device_type, banner)


def _weights_format(config: Any, load_in_4bit: bool, load_in_8bit: bool, full_finetuning: bool,
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
    quant = _quant_config(load_in_4bit, load_in_8bit, torch_dtype, banner)
    if quant is None:
        banner.header.append(f"weights: {_dtype_name(torch_dtype)}")
    elif load_in_4bit:
        banner.header.append(f"weights: NF4 4-bit, double quantisation, compute {_dtype_name(torch_dtype)}")
    else:
        banner.header.append(f"weights: LLM.int8 8-bit, compute {_dtype_name(torch_dtype)}")
    return quant


def _load_weights(path: str, kind: str, model_name: Union[str, os.PathLike], load_kwargs: dict[str, Any],
                  model_class: Any = None, api: Any = None, where: str = "from_pretrained"):
    """``model_class.from_pretrained`` (default ``AutoModelForCausalLM``); one readable error when a hub
    name cannot be fetched or a keyword is misspelt (the known ones read off ``api``'s signature)."""
    from transformers import AutoModelForCausalLM

    model_class = model_class or AutoModelForCausalLM
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
        known = [*inspect.signature(api or from_pretrained).parameters, *_UNSUPPORTED_KWARGS, "load_in_16bit"]
        raise arguments.unknown_keyword_error(
            where, keyword, (k for k in known if k != "kwargs"), "transformers' from_pretrained"
        ) from None


def finish_model(model, banner: Banner, max_seq_length: int, full_finetuning: bool, fast_path: bool) -> None:
    """Attach the banner and limits, set trainability, and patch the fused path (when asked)."""
    object.__setattr__(model, "notebookkit_banner", banner)
    object.__setattr__(model, "max_seq_length", int(max_seq_length))
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    max_pos = getattr(text_config, "max_position_embeddings", None)
    if max_pos is not None and max_seq_length > max_pos:
        banner.note(
            f"max_seq_length={max_seq_length} is longer than the model's max_position_embeddings={max_pos}; "
            "quality beyond that length depends on the model's RoPE settings"
        )
    if full_finetuning:
        for p in model.parameters():
            if p.is_floating_point():
                p.requires_grad_(True)
        banner.header.append("training: full fine-tuning (every weight trainable)")
    else:
        for p in model.parameters():
            p.requires_grad_(False)

    from .patch_linear4bit import describe_linear4bit, patch_linear4bit
    from .patcher import patch_model

    if fast_path:
        patch_model(model, banner)
    else:
        banner.feature("fast path", False, "disabled by fast_path=False / NOTEBOOKKIT_FAST_PATH=0: stock Hugging Face code")
        # Stock code, but never bitsandbytes' CPU NF4 decode (wrong on AVX-512 CPUs): see patch_linear4bit.
        describe_linear4bit(model, banner, patch_linear4bit(model))
    from .export_hook import attach_export_methods

    attach_export_methods(model)


def _load_adapter_folder(path: str, adapter_cfg: dict, banner: Banner, **kw):
    from peft import PeftModel
    from transformers import AutoTokenizer

    from .patch_linear4bit import guard_lora_merges

    base_name = adapter_cfg.get("base_model_name_or_path")
    if not base_name:
        raise ValueError(
            f"{path}/adapter_config.json has no base_model_name_or_path, so the base model is unknown. "
            "Load the base model first, then attach the adapter with peft.PeftModel.from_pretrained(model, path)."
        )
    show = kw.pop("show_banner", True)
    model, tokenizer = from_pretrained(base_name, show_banner=False, **kw)
    base_banner: Banner = model.notebookkit_banner
    peft_model = PeftModel.from_pretrained(model, path, is_trainable=True)
    guard_lora_merges(peft_model)
    object.__setattr__(peft_model, "notebookkit_banner", base_banner)
    from .export_hook import attach_export_methods

    attach_export_methods(peft_model)
    base_banner.header.append(f"adapter: {path} on base {base_name}")
    if (Path(path) / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(path)
        _fix_tokenizer(tokenizer, model, base_banner, kw.get("max_seq_length", 2048))
    from .lora_fast_path import describe_lora

    describe_lora(peft_model, base_banner)
    if show:
        base_banner.show()
    return peft_model, tokenizer


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
