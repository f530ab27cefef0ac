"""``FastLanguageModel``: the notebook-facing API (load, add LoRA, switch inference/training)."""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn as nn

from .banner import Banner, get_banner
from .checkpointing import apply_checkpointing, normalize_mode
from .export_hook import attach_export_methods
from .lora_fast_path import describe_lora, set_fp8_base_matmul
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
        from peft import LoraConfig
        from peft import get_peft_model as peft_get_peft_model

        banner = get_banner(model) or Banner()
        if hasattr(model, "peft_config"):
            banner.note("get_peft_model called on a model that already has LoRA adapters; returning it unchanged "
                        "(only fp8_base_matmul=True is applied)")
            if fp8_base_matmul:  # the one thing a second call may still switch on
                set_fp8_base_matmul(model, True)
                describe_lora(model, banner)
            if show_banner:
                banner.show()
            return model
        if bias not in ("none", "all", "lora_only"):
            raise ValueError(f"bias={bias!r} must be 'none', 'all' or 'lora_only'.")
        if lora_dropout < 0 or lora_dropout >= 1:
            raise ValueError(f"lora_dropout={lora_dropout} must be in [0, 1).")
        normalize_mode(use_gradient_checkpointing)  # validate early
        # Before PEFT wraps anything, so an unsupported GPU raises with the model unchanged. The flag
        # lives on the base linears, which PEFT keeps as each LoRA layer's base_layer.
        set_fp8_base_matmul(model, bool(fp8_base_matmul))
        if max_seq_length is not None:
            object.__setattr__(model, "max_seq_length", int(max_seq_length))

        targets = list(target_modules) if target_modules is not None else list(DEFAULT_TARGET_MODULES)
        config_kwargs: dict[str, Any] = dict(
            r=r,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            bias=bias,
            target_modules=targets,
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
        lora_config = LoraConfig(**config_kwargs)

        torch.manual_seed(random_state)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            peft_model = peft_get_peft_model(model, lora_config)
        object.__setattr__(peft_model, "notebookkit_banner", banner)
        attach_export_methods(peft_model)

        apply_checkpointing(
            peft_model, use_gradient_checkpointing, banner, batch_size=planning_batch_size, max_memory=max_memory
        )
        describe_lora(peft_model, banner)
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in peft_model.parameters())
        banner.header.append(
            f"LoRA r={r}, alpha={lora_alpha}{' (rsLoRA)' if use_rslora else ''} on {', '.join(targets)}: "
            f"{trainable:,} trainable of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%)"
        )
        if show_banner:
            banner.show()
        # Ready to train, as the name promises: the fused loss and checkpointing act in training mode
        # only, and a manual loop that forgot model.train() would materialise the [N, V] logits.
        return FastLanguageModel.for_training(peft_model)

    @staticmethod
    def for_inference(model: nn.Module) -> nn.Module:
        """Switch to generation: eval mode, KV cache on, no checkpointing. Returns the model."""
        model.eval()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if getattr(base.config, "use_cache", None) is not None:
            base.config.use_cache = True
        gen = getattr(base, "generation_config", None)
        if gen is not None and getattr(gen, "use_cache", None) is not None:
            gen.use_cache = True
        return model

    @staticmethod
    def for_training(
        model: nn.Module, use_gradient_checkpointing: Union[bool, str, None] = None, max_memory: Any = None
    ) -> nn.Module:
        """Switch back to training mode (KV cache off). Optionally change the checkpointing mode
        (``"auto"`` re-plans, within ``max_memory`` when given)."""
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
    def unpatch(model: nn.Module) -> int:
        """Restore stock Hugging Face forwards everywhere; returns the number of modules restored."""
        from .patcher import unpatch_model

        return unpatch_model(model)
