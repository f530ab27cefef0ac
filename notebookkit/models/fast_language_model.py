"""``FastLanguageModel``: the notebook-facing API (load, add LoRA, switch inference/training)."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch.nn as nn

from .common.banner import Banner, get_banner
from .loading import arguments, loader
from .lora_setup import (already_adapted, check_lora_arguments, describe_adapters, expert_targets, lora_config, note_setup,
                         wrap_with_lora)
from .patching.checkpointing import apply_checkpointing
from .patching.lora_fast_path import describe_lora

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
                ``q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj``. On a mixture-of-experts
                model (Qwen3-MoE, gpt-oss) whose targets name the MLP's projections, the experts' stacked
                weights are adapted too: PEFT maps the names onto Qwen3-MoE's experts itself; for gpt-oss
                notebookkit adds ``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``
                (unless you pass ``target_parameters`` yourself).
            lora_alpha: LoRA scaling numerator (scaling = alpha / r, or alpha / sqrt(r) with rsLoRA).
            lora_dropout: dropout on the LoRA input. Only ``0`` runs the fused kernels; other values
                run stock PEFT code (the banner says so).
            bias: ``"none"`` (fused path), ``"all"`` or ``"lora_only"`` (stock PEFT code).
            use_gradient_checkpointing: ``False``, ``True`` (recompute), ``"offload"`` (alias
                ``"unsloth"``: layer inputs parked in pinned host memory), ``"offload_mlp"`` (the MLPs'
                gate/up outputs parked there too: less recompute, ``2 * tokens * intermediate_size``
                16-bit values of host memory a layer) or ``"auto"`` (let ``notebookkit.memory`` pick the
                fastest plan that fits, parking MLP outputs where the host link keeps up).
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
            return already_adapted(model, banner, fp8_base_matmul, show_banner)
        # Every check before anything changes, so a bad value leaves the model as it was.
        where = "get_peft_model"
        r, mode, max_seq_length, planning_batch_size = check_lora_arguments(
            where, r, lora_alpha, lora_dropout, bias, use_gradient_checkpointing, max_seq_length,
            planning_batch_size, max_memory,
        )
        # A string is PEFT's: "all-linear", or a regular expression matched against module names.
        if isinstance(target_modules, str):
            targets: Any = target_modules
        else:
            targets = list(target_modules) if target_modules is not None else list(DEFAULT_TARGET_MODULES)
        kwargs = expert_targets(model, targets, kwargs)
        config = lora_config(
            r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, bias=bias, target_modules=targets,
            use_rslora=use_rslora, modules_to_save=modules_to_save, init_lora_weights=init_lora_weights,
            layers_to_transform=layers_to_transform, loftq_config=loftq_config,
            keywords_of=FastLanguageModel.get_peft_model, **kwargs,
        )
        note_setup(model, banner, max_memory, mode)
        peft_model = wrap_with_lora(model, config, random_state, banner, fp8_base_matmul, max_seq_length)

        apply_checkpointing(
            peft_model, use_gradient_checkpointing, banner, batch_size=planning_batch_size, max_memory=max_memory
        )
        describe_lora(peft_model, banner)
        described = targets if isinstance(targets, str) else ", ".join(targets)
        if kwargs.get("target_parameters"):
            described += " + " + ", ".join(kwargs["target_parameters"])
        describe_adapters(peft_model, banner, r, lora_alpha, use_rslora, described)
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
        from .patching.patcher import patch_model

        banner = get_banner(model) or Banner()
        return patch_model(model, banner)

    @staticmethod
    def unpatch(model: nn.Module, keep_nf4_decode: bool = True) -> int:
        """Restore stock Hugging Face forwards everywhere; returns the number of modules restored.

        4-bit layers keep notebookkit's NF4 decode on CPU tensors unless ``keep_nf4_decode=False``
        (bitsandbytes' own CPU forward is wrong on AVX-512 CPUs for some shapes)."""
        from .patching.patcher import unpatch_model

        return unpatch_model(model, keep_nf4_decode=keep_nf4_decode)
