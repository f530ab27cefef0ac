"""``FastLanguageModel.from_pretrained``: resolve a name, load a Hugging Face causal LM, patch it.

Resolution order for ``model_name``:

1. a reserved tiny name (``"notebookkit/tiny-llama"`` ...): built once, offline, by
   ``notebookkit.data.tiny`` and loaded from its cache folder;
2. a local folder: a model folder (``config.json``) or a LoRA adapter folder (``adapter_config.json``,
   whose base model is loaded first, then the adapter on top);
3. a Hugging Face Hub name, loaded through the usual cache; when it is neither cached nor reachable
   the user gets one readable error, not a chain of HTTP tracebacks.

Precision: ``dtype=None`` picks bf16 on GPUs that support it, fp16 on other GPUs (T4), fp32 on CPU.
``load_in_4bit`` quantises linear weights to NF4 with double quantisation through bitsandbytes,
computing in that dtype; checkpoints saved already quantised load as they are.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch

from .banner import Banner, device_line, versions_line

_UNSUPPORTED_KWARGS = {
    "fast_inference": "vLLM fast inference is not part of notebookkit; generation uses model.generate",
    "gpu_memory_utilization": "only used by vLLM fast inference",
    "max_lora_rank": "only used by vLLM fast inference",
    "fix_tokenizer": "tokenizers load unchanged; a missing pad token is still added",
    "use_exact_model_name": "names are used as given",
    "resize_model_vocab": "vocabulary resizing is not done at load time",
    "float8_kv_cache": "not supported",
    "disable_log_stats": "only used by vLLM fast inference",
}


class ModelLoadError(OSError):
    """A model name that is neither a reserved tiny name, a local folder, nor reachable on the Hub."""


def pick_dtype(dtype: Union[None, str, torch.dtype], device_type: str, banner: Optional[Banner] = None) -> torch.dtype:
    """Resolve ``dtype=None``/strings to a torch dtype for ``device_type`` ("cuda" or "cpu")."""
    if isinstance(dtype, str):
        name = dtype.replace("torch.", "").lower()
        aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
        name = aliases.get(name, name)
        if name not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype={dtype!r} is not one of None, 'bfloat16', 'float16', 'float32'.")
        dtype = getattr(torch, name)
    if dtype is None:
        if device_type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype == torch.bfloat16 and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        if banner is not None:
            banner.note("this GPU has no bf16: using float16 instead of the requested bfloat16")
        return torch.float16
    return dtype


def _offline_error(name: str, cause: BaseException) -> BaseException:
    """The one readable error for an unreachable name (``notebookkit.data.offline``'s when present)."""
    try:
        from notebookkit.data.offline import explain_unreachable

        return explain_unreachable(name, cause)
    except ImportError:
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
    why = (
        "this session is offline (HF_HUB_OFFLINE=1) and the model is not in the Hugging Face cache"
        if offline
        else f"the Hugging Face Hub did not provide it ({type(cause).__name__})"
    )
    return ModelLoadError(
        f"Cannot load model {name!r}: it is not a reserved tiny name, not a local folder, and {why}.\n"
        "Fix: pass a local folder that contains config.json (or adapter_config.json), a cached Hub name, "
        "or a built-in tiny model such as 'notebookkit/tiny-llama'."
    )


def resolve(model_name: Union[str, os.PathLike]) -> tuple[str, str]:
    """``(path_or_hub_id, kind)`` with kind one of ``"tiny"``, ``"local"``, ``"hub"``.

    Reserved tiny names are built (once, offline) into a local folder; an unknown
    ``"notebookkit/..."`` name raises an error listing the valid ones.
    """
    name = os.fspath(model_name)
    try:
        from notebookkit.data.tiny import is_tiny_model_name, resolve_model_name
    except ImportError:
        is_tiny_model_name = resolve_model_name = None
    if is_tiny_model_name is not None and is_tiny_model_name(name):
        return str(resolve_model_name(name)), "tiny"
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        return os.path.abspath(expanded), "local"
    if resolve_model_name is not None:
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

    Returns:
        ``(model, tokenizer)``; ``model.notebookkit_banner`` holds the load report.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    banner = Banner()
    banner.header.append(versions_line())
    for key in list(kwargs):
        if key in _UNSUPPORTED_KWARGS:
            value = kwargs.pop(key)
            if value not in (None, False, 0):
                banner.note(f"{key}={value!r} ignored: {_UNSUPPORTED_KWARGS[key]}")
    kwargs.pop("use_gradient_checkpointing", None)
    kwargs.pop("random_state", None)
    if os.environ.get("NOTEBOOKKIT_FAST_PATH", "1") in ("0", "false", "False"):
        fast_path = False

    path, kind = resolve(model_name)

    adapter_cfg = _read_adapter_config(path) if kind != "hub" else None
    if adapter_cfg is not None:
        return _load_adapter_folder(
            path, adapter_cfg, banner,
            max_seq_length=max_seq_length, dtype=dtype, load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit,
            full_finetuning=full_finetuning, token=token, device_map=device_map,
            trust_remote_code=trust_remote_code, attn_implementation=attn_implementation,
            fast_path=fast_path, show_banner=show_banner, **kwargs,
        )

    try:
        config = AutoConfig.from_pretrained(path, token=token, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - one readable error instead of a traceback chain
        if kind == "hub":
            raise _offline_error(os.fspath(model_name), exc) from None
        raise

    device_map = _default_device_map(device_map)
    device_type = "cuda" if torch.cuda.is_available() and device_map not in ("cpu", {"": "cpu"}) else "cpu"
    banner.header.append(device_line(torch.device(device_type)))
    torch_dtype = pick_dtype(dtype, device_type, banner)

    prequantised = getattr(config, "quantization_config", None)
    if full_finetuning and (load_in_4bit or load_in_8bit):
        banner.note("full_finetuning=True: loading 16-bit weights (4/8-bit loading is for LoRA)")
        load_in_4bit = load_in_8bit = False
    if load_in_8bit:
        load_in_4bit = False
    quant = None
    if prequantised is not None:
        qmethod = prequantised.get("quant_method") if isinstance(prequantised, dict) else getattr(prequantised, "quant_method", "?")
        banner.header.append(f"weights: pre-quantised checkpoint ({qmethod}), loaded as saved; compute {_dtype_name(torch_dtype)}")
    else:
        quant = _quant_config(load_in_4bit, load_in_8bit, torch_dtype, banner)
        if quant is None:
            banner.header.append(f"weights: {_dtype_name(torch_dtype)}")
        elif load_in_4bit:
            banner.header.append(f"weights: NF4 4-bit, double quantisation, compute {_dtype_name(torch_dtype)}")
        else:
            banner.header.append(f"weights: LLM.int8 8-bit, compute {_dtype_name(torch_dtype)}")

    load_kwargs: dict[str, Any] = dict(dtype=torch_dtype, token=token, trust_remote_code=trust_remote_code)
    if device_map is not None:
        load_kwargs["device_map"] = device_map
    if quant is not None:
        load_kwargs["quantization_config"] = quant
    if attn_implementation is not None:
        load_kwargs["attn_implementation"] = attn_implementation
    load_kwargs.update(kwargs)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch_dtype.*")
            model = AutoModelForCausalLM.from_pretrained(path, **load_kwargs)
    except OSError as exc:
        if kind == "hub":
            raise _offline_error(os.fspath(model_name), exc) from None
        raise

    tokenizer = AutoTokenizer.from_pretrained(path, token=token, trust_remote_code=trust_remote_code)
    _fix_tokenizer(tokenizer, model, banner, max_seq_length)

    finish_model(model, banner, max_seq_length=max_seq_length, full_finetuning=full_finetuning, fast_path=fast_path)
    if show_banner:
        banner.show()
    return model, tokenizer


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

    from .patcher import patch_model

    if fast_path:
        patch_model(model, banner)
    else:
        banner.feature("fast path", False, "disabled by fast_path=False / NOTEBOOKKIT_FAST_PATH=0: stock Hugging Face code")
    from .export_hook import attach_export_methods

    attach_export_methods(model)


def _load_adapter_folder(path: str, adapter_cfg: dict, banner: Banner, **kw):
    from peft import PeftModel
    from transformers import AutoTokenizer

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
