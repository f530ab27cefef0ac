"""``FastLanguageModel``: the notebook-facing API (load, add LoRA, switch inference/training)."""

from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn as nn

from . import arguments, compat
from .banner import Banner, get_banner
from .checkpointing import apply_checkpointing, normalize_mode
from .export_hook import attach_export_methods
from .lora_fast_path import describe_lora, set_fp8_base_matmul
from .patch_linear4bit import guard_lora_merges
from . import loader

DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class FastLanguageModel:
    """Load Hugging Face causal LMs onto notebookkit's fused kernels and train them with LoRA.

    Typical use::

        model, tokenizer = FastLanguageModel.from_pretrained("notebookkit/tiny-llama", max_seq_length=512)
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16)
        # ... train with TRL's SFTTrainer / DPOTrainer / GRPOTrainer ...
        FastLanguageModel.for_inference(model)
        model.generate(**tokenizer("Hello", return_tensors="pt"), max_new_tokens=20)
    """

    from_pretrained = staticmethod(loader.from_pretrained)  # same signature and docstring as the loader

    @staticmethod
    def get_peft_model(
        model: nn.Module,
        r: int = 16,
        target_modules: Optional[Sequence[str]] = None,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        bias: str = "none",
        use_gradient_checkpointing: Union[bool, str] = "auto",
        random_state: int = 3407,
        use_rslora: bool = False,
        loftq_config: Any = None,
        modules_to_save: Optional[Sequence[str]] = None,
        layers_to_transform: Optional[Sequence[int]] = None,
        init_lora_weights: Any = True,
        max_seq_length: Optional[int] = None,
        planning_batch_size: Optional[int] = None,
        max_memory: Any = None,
        show_banner: bool = True,
        fp8_base_matmul: bool = False,
        **kwargs: Any,
    ):
        """Attach LoRA adapters (PEFT) to a model loaded by ``from_pretrained``.

        Args:
            model: the model returned by ``FastLanguageModel.from_pretrained``.
            r: LoRA rank.
            target_modules: projection names to adapt; default all seven
                ``q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj``.
            lora_alpha: LoRA scaling numerator (scaling = alpha / r, or alpha / sqrt(r) with rsLoRA).
            lora_dropout: dropout on the LoRA input. Only ``0`` runs the fused kernels; other values
                run stock PEFT code (the banner says so).
            bias: ``"none"`` (fused path), ``"all"`` or ``"lora_only"`` (stock PEFT code).
            use_gradient_checkpointing: ``False``, ``True`` (recompute), ``"offload"`` (alias
                ``"unsloth"``: layer inputs parked in pinned host memory) or ``"auto"`` (let
                ``notebookkit.memory`` pick the fastest plan that fits).
            random_state: seed for the LoRA initialisation.
            use_rslora: rank-stabilised scaling ``alpha / sqrt(r)``.
            loftq_config: a ``peft.LoftQConfig`` (initialises from the quantisation residual).
            modules_to_save: extra modules trained in full and saved with the adapter (e.g. ``lm_head``).
            max_seq_length: override the length limit given to ``from_pretrained``.
            planning_batch_size: per-device batch size the ``"auto"`` checkpointing plan should fit.
            max_memory: VRAM the ``"auto"`` plan may use: ``"16GB"``, ``"15 GiB"``, a card name
                (``"t4"``, ``"l4"``, ``"a100-40gb"``) or bytes; default the GPU's free memory. Use it
                to leave room for something else, or to plan for a smaller card than this one.
            fp8_base_matmul: compute the frozen base-weight GEMM ``x W^T`` of the forward pass and
                of the checkpointing recompute with FP8 e4m3 operands (rowwise scales,
                ``torch._scaled_mm``): about twice the bf16 GEMM throughput on GPUs with FP8 tensor
                cores (compute capability 8.9+: L4, RTX 4090, H100, H200), at a few percent of
                relative error per product. The LoRA path and the backward stay 16-bit, and so does
                the model in eval mode (generation, evaluation). A GPU
                without FP8 (T4, A100) raises ``ValueError``; on CPU it is emulated (tests only).

        Returns:
            a ``peft.PeftModel`` whose layers run the fused LoRA kernels where possible, in
            training mode (as after :meth:`for_training`: ``model.train()``, KV cache off).
        """
        arguments.require_model(model, "get_peft_model")
        banner = get_banner(model) or Banner()
        if hasattr(model, "peft_config"):
            return _already_adapted(model, banner, fp8_base_matmul, show_banner)
        # Every check before anything changes, so a bad value leaves the model as it was.
        where = "get_peft_model"
        r, mode, max_seq_length, planning_batch_size = _check_lora_arguments(
            where, r, lora_alpha, lora_dropout, bias, use_gradient_checkpointing, max_seq_length,
            planning_batch_size, max_memory,
        )
        # A string is PEFT's: "all-linear", or a regular expression matched against module names.
        if isinstance(target_modules, str):
            targets: Any = target_modules
        else:
            targets = list(target_modules) if target_modules is not None else list(DEFAULT_TARGET_MODULES)
        lora_config = _lora_config(
            r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, bias=bias, target_modules=targets,
            use_rslora=use_rslora, modules_to_save=modules_to_save, init_lora_weights=init_lora_weights,
            layers_to_transform=layers_to_transform, loftq_config=loftq_config, **kwargs,
        )
        _note_setup(model, banner, max_memory, mode)
        peft_model = _wrap_with_lora(model, lora_config, random_state, banner, fp8_base_matmul, max_seq_length)

        apply_checkpointing(
            peft_model, use_gradient_checkpointing, banner, batch_size=planning_batch_size, max_memory=max_memory
        )
        describe_lora(peft_model, banner)
        _describe_adapters(peft_model, banner, r, lora_alpha, use_rslora, targets)
        if show_banner:
            banner.show()
        # Ready to train, as the name promises: the fused loss and checkpointing act in training mode
        # only, and a manual loop that forgot model.train() would materialise the [N, V] logits.
        return FastLanguageModel.for_training(peft_model)

    @staticmethod
    def for_inference(model: nn.Module) -> nn.Module:
        """Switch to generation: eval mode, KV cache on, no checkpointing, and the fast ``model.generate``.

        ``model.generate(...)`` then runs notebookkit's decode path (``notebookkit.models.generation``):
        a static KV cache sized from the request (up to ``max_seq_length``), the prompt on the fused
        kernels and each new token as one replayed CUDA graph, LoRA adapters unmerged. It takes
        Hugging Face's arguments and returns the same ids; what it does not implement (beam search,
        output dicts, logits processors passed in, ...) runs Hugging Face's ``generate``, with a
        warning that says why. The banner's ``fast generation`` line says whether this model runs it.
        ``for_training`` restores Hugging Face's ``generate`` and keeps the cache (GRPO switches every
        step); ``notebookkit.models.generation.release(model)`` frees it. Returns the model.
        """
        from .generation import bind_generate, describe_generation

        arguments.require_model(model, "for_inference")
        model.eval()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if getattr(base.config, "use_cache", None) is not None:
            base.config.use_cache = True
        gen = getattr(base, "generation_config", None)
        if gen is not None and getattr(gen, "use_cache", None) is not None:
            gen.use_cache = True
        bound = bind_generate(model)
        banner = get_banner(model)
        if banner is not None:
            describe_generation(model, banner, bound)
        return model

    @staticmethod
    def for_training(
        model: nn.Module, use_gradient_checkpointing: Union[bool, str, None] = None, max_memory: Any = None
    ) -> nn.Module:
        """Switch back to training mode (KV cache off, Hugging Face's ``generate`` back). Optionally change
        the checkpointing mode (``"auto"`` re-plans, within ``max_memory`` when given). The static KV
        cache of ``for_inference`` is kept for the next generation (``notebookkit.models.generation.release``
        frees it)."""
        from .generation import unbind_generate

        arguments.require_model(model, "for_training")
        if max_memory is not None:
            arguments.max_memory_bytes(max_memory, "for_training")
        unbind_generate(model)  # Hugging Face's generate again; the generation cache is kept
        model.train()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if getattr(base.config, "use_cache", None) is not None:
            base.config.use_cache = False
        if use_gradient_checkpointing is not None:
            apply_checkpointing(model, use_gradient_checkpointing, get_banner(model), max_memory=max_memory)
        return model

    @staticmethod
    def patch(model: nn.Module) -> Banner:
        """(Re)apply the fused path to a model in place; returns its banner."""
        from .patcher import patch_model

        banner = get_banner(model) or Banner()
        return patch_model(model, banner)

    @staticmethod
    def unpatch(model: nn.Module, keep_nf4_decode: bool = True) -> int:
        """Restore stock Hugging Face forwards everywhere; returns the number of modules restored.

        4-bit layers keep notebookkit's NF4 decode on CPU tensors unless ``keep_nf4_decode=False``
        (bitsandbytes' own CPU forward is wrong on AVX-512 CPUs for some shapes)."""
        from .patcher import unpatch_model

        return unpatch_model(model, keep_nf4_decode=keep_nf4_decode)


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


def _already_adapted(model: nn.Module, banner: Banner, fp8_base_matmul: bool, show_banner: bool) -> nn.Module:
    """``get_peft_model`` on a model that has adapters: unchanged, but ``fp8_base_matmul=True`` still applies."""
    banner.note("get_peft_model called on a model that already has LoRA adapters; returning it unchanged "
                "(only fp8_base_matmul=True is applied)")
    if fp8_base_matmul:  # the one thing a second call may still switch on
        set_fp8_base_matmul(model, True)
        describe_lora(model, banner)
    if show_banner:
        banner.show()
    return model


def _check_lora_arguments(
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


def _lora_config(
    *, r: int, lora_alpha: int, lora_dropout: float, bias: str, target_modules: Any, use_rslora: bool,
    modules_to_save: Optional[Sequence[str]], init_lora_weights: Any, layers_to_transform: Optional[Sequence[int]],
    loftq_config: Any, **kwargs: Any,
):
    """The ``peft.LoraConfig`` of a causal LM (LoftQ initialisation when ``loftq_config`` is given);
    a misspelt keyword is named before PEFT touches the model."""
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
        known = [k for k in inspect.signature(FastLanguageModel.get_peft_model).parameters if k != "kwargs"]
        raise arguments.unknown_keyword_error("get_peft_model", keyword, known, "peft.LoraConfig") from None


def _note_setup(model: nn.Module, banner: Banner, max_memory: Any, mode: str) -> None:
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


def _wrap_with_lora(model: nn.Module, lora_config: Any, random_state: int, banner: Banner, fp8_base_matmul: bool,
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
    object.__setattr__(peft_model, "notebookkit_banner", banner)
    attach_export_methods(peft_model)
    return peft_model


def _describe_adapters(peft_model: nn.Module, banner: Banner, r: int, lora_alpha: int, use_rslora: bool,
                       targets: Any) -> None:
    """The banner's LoRA line: rank, scaling, targets and the trainable share of parameters."""
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    banner.header.append(
        f"LoRA r={r}, alpha={lora_alpha}{' (rsLoRA)' if use_rslora else ''} on "
        f"{targets if isinstance(targets, str) else ', '.join(targets)}: "
        f"{trainable:,} trainable of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%)"
    )
