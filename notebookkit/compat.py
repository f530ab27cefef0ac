"""Every private name of another library that notebookkit reads or writes, in one place (TRL's: its own
module in the train layer, :mod:`notebookkit.train.trl_compat`, the one place for those).

Where a public interface does the job, notebookkit uses it: a plainly causal forward skips Hugging
Face's masks by passing an already prepared 4-D mask, which ``transformers.masking_utils`` returns
as it is (:func:`notebookkit.models.patching.patch_attention.plain_causal_mask`), instead of swapping the
shared config's attention implementation. What is left has no public equivalent in the supported
versions. Each entry says what it touches and on which versions that was read in the library's
source; ``tests/models/test_compat.py`` fails when an installed version stops behaving that way.

Supported ranges (``pyproject.toml``): transformers ``>=4.56,<6``, accelerate ``>=1.0,<2``, TRL
``>=0.24,<2`` (the TRL-facing entries read the Trainer's public fields only).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

# ---- transformers: gradient checkpointing -------------------------------------------------------
# Checked on transformers 4.56.2, 5.17.0, 5.24.0. ``PreTrainedModel._set_gradient_checkpointing(
# enable, gradient_checkpointing_func)`` sets ``gradient_checkpointing`` and ``_gradient_checkpointing_func``
# on every module that has the flag; ``GradientCheckpointingLayer`` (the decoder layers) then calls
# ``self._gradient_checkpointing_func(partial(forward, **kwargs), *args)`` in training. The public
# ``gradient_checkpointing_enable`` takes one function for every layer (and, depending on the version,
# changes input gradients too); the per-layer plan (keep / recompute / offload) needs one per layer.


def enable_gradient_checkpointing(model: Any, checkpoint_function: Callable[..., Any]) -> None:
    """Turn Hugging Face's gradient checkpointing on for ``model`` with ``checkpoint_function``."""
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint_function)


def set_layer_checkpoint_function(layer: Any, checkpoint_function: Callable[..., Any]) -> None:
    """The function one decoder layer (a ``GradientCheckpointingLayer``) checkpoints its forward with."""
    layer._gradient_checkpointing_func = checkpoint_function


# ---- transformers: the attention implementation a config asks for -------------------------------
# Checked on transformers 4.56.2, 5.17.0, 5.24.0: ``PretrainedConfig._attn_implementation`` (a
# property over ``_attn_implementation_internal``) is the resolved ``attn_implementation``
# ("sdpa", "eager", "flash_attention_2", ...). Read only, never written.


def attention_implementation(config: Any) -> Optional[str]:
    """The attention implementation ``config`` resolved (``"sdpa"``, ``"eager"``...), or ``None``."""
    return getattr(config, "_attn_implementation", None)


# ---- accelerate: forward hooks of device_map placement ------------------------------------------
# Checked on accelerate 1.0.0 and 1.15.0: ``add_hook_to_module`` keeps the module's forward as
# ``module._old_forward``, stores the hook as ``module._hf_hook`` and sets ``module.forward`` to a
# wrapper that calls ``module._old_forward`` between the hook's pre- and post-forward.

ACCELERATE_FORWARD = "_old_forward"


def accelerate_wrapped(module: Any) -> bool:
    """True when accelerate's hooks wrap ``module.forward`` (``device_map`` placement, offload hooks):
    the forward it runs is then ``module.__dict__[ACCELERATE_FORWARD]``."""
    return "_hf_hook" in module.__dict__ and ACCELERATE_FORWARD in module.__dict__


# ---- transformers: the generation config of one generate() call -------------------------------
# Checked on transformers 4.56.2, 5.17.0, 5.24.0: ``GenerationMixin._prepare_generation_config(
# generation_config, **kwargs)`` returns ``(config, model_kwargs)``: a copy of the given config (or
# the model's), the model's ``generation_config`` values filled in where it leaves them unset, the
# keyword arguments applied on top, and the keywords that are no generation setting (inputs for the
# forward: ``attention_mask``, ...). ``generate`` itself resolves its settings this way; the fast
# decode path (notebookkit.models.generation) must read the same values.


def prepare_generation_config(model: Any, generation_config: Any, kwargs: dict) -> tuple[Any, dict]:
    """``(generation config, model kwargs)`` of ``model.generate(generation_config=..., **kwargs)``."""
    return model._prepare_generation_config(generation_config, **kwargs)


# ---- bitsandbytes: the notice about its CPU 4-bit matmul kernel ---------------------------------
# Checked on bitsandbytes 0.50.2: importing it (PEFT does, whenever it is installed) on a CPU with
# AVX512-BF16 fetches ``gemm_4bit_forward`` from the Hub's ``kernels`` package and, when that is missing
# or offline, logs "Failed to load CPU gemm_4bit_forward ..." on the logger of
# ``bitsandbytes.backends.cpu.ops``. notebookkit never runs that kernel (it decodes NF4 itself on every
# path), so this one message says nothing to a notebookkit user; every other record of that logger passes.
BNB_CPU_OPS_LOGGER = "bitsandbytes.backends.cpu.ops"
BNB_CPU_KERNEL_NOTICE = "Failed to load CPU gemm_4bit_forward"


class _DropBnbCpuKernelNotice:
    def filter(self, record: Any) -> bool:
        return not str(record.msg).startswith(BNB_CPU_KERNEL_NOTICE)


def quiet_bitsandbytes_cpu_kernel_notice() -> None:
    """Drop bitsandbytes' notice about its CPU 4-bit kernel (must run before bitsandbytes is imported)."""
    import logging

    logger = logging.getLogger(BNB_CPU_OPS_LOGGER)
    if not any(isinstance(f, _DropBnbCpuKernelNotice) for f in logger.filters):
        logger.addFilter(_DropBnbCpuKernelNotice())


# ---- transformers / TRL / PEFT: the deprecated ``is_gradient_checkpointing`` --------------------
# Checked on transformers 5.24.0 (deprecated there in favour of ``is_activation_checkpointing``; 4.56 and
# 5.17 have only the old name), TRL 1.16.0 (``unwrap_model_for_generation`` and
# ``disable_gradient_checkpointing`` read the old name: GRPO's generation, DPO's reference pass) and PEFT
# 0.21.2 (``PeftModel.__init__`` reads it). The FutureWarning is addressed to those libraries' authors; a
# notebook user can do nothing about it. notebookkit reads the flag through :func:`is_checkpointing` and
# silences this one message only around the calls into those libraries.
CHECKPOINTING_FLAG_DEPRECATION = r"`is_gradient_checkpointing` is deprecated"


def is_checkpointing(model: Any) -> bool:
    """Hugging Face's gradient-checkpointing flag of ``model``, under its new name where it has one."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if name in dir(type(model)):
            return bool(getattr(model, name))
    return False


def checkpointing_switches(model: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(disable, enable)``: Hugging Face's checkpointing switches of ``model`` under their current names
    (``activation_checkpointing_*`` where it has them; the ``gradient_checkpointing_*`` aliases warn that they go
    in transformers v6)."""
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    return disable, enable


def quiet_checkpointing_flag_deprecation():
    """Context manager: ignore the FutureWarning another library's read of ``is_gradient_checkpointing`` raises."""
    import warnings

    manager = warnings.catch_warnings()

    class _Quiet:
        def __enter__(self):
            manager.__enter__()
            warnings.filterwarnings("ignore", message=CHECKPOINTING_FLAG_DEPRECATION, category=FutureWarning)
            return self

        def __exit__(self, *exc):
            return manager.__exit__(*exc)

    return _Quiet()


# ---- transformers / TRL: the Trainer's checkpointing switch -----------------------------------
# Checked on transformers 4.56.2 / 5.17.0 (``TrainingArguments.gradient_checkpointing``) and 5.24.0
# (``activation_checkpointing``; the old name is a deprecated alias that warns whenever it is not None). TRL 1.16's
# configs default ``gradient_checkpointing=True``, so a ``GRPOConfig`` / ``DPOConfig`` / ``SFTConfig`` built without
# naming the new field warns on 5.24. The value stays TRL's default (on): when the Trainer turns checkpointing on,
# notebookkit re-applies the plan ``get_peft_model`` chose (``checkpointing._guard_trainer_override``).
def trainer_checkpointing_flag() -> dict[str, bool]:
    """``{"activation_checkpointing": True}`` (``gradient_checkpointing`` where that is the field's name): TRL's
    default for the Trainer's checkpointing switch, under the name this transformers reads without a warning."""
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    return {"activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": True}


# ---- transformers: the mark of a loaded parameter -------------------------------------------------
# Checked on transformers 5.17.0, 5.24.0. After ``from_pretrained`` has set the checkpoint's tensors, it
# initialises every parameter that lacks ``_is_hf_initialized = True`` (the mark it puts on each tensor it
# loaded). A parameter replaced while loading (the NF4 experts of
# :mod:`notebookkit.models.loading.stream_nf4_experts`) must carry the mark over, or its codes are overwritten.
HF_INITIALIZED_MARK = "_is_hf_initialized"


def carry_loaded_mark(source: Any, target: Any) -> None:
    """Give ``target`` the loaded-parameter mark of ``source`` (False when it has none)."""
    setattr(target, HF_INITIALIZED_MARK, getattr(source, HF_INITIALIZED_MARK, False))


# ---- torch: the cache of freed pinned host memory ---------------------------------------------
# Read in torch 2.13's source (``torch.cuda.graphs`` calls it; a CPU-only build has no such binding); on the GPU
# machine's torch 2.11 checked by ``tests/models/test_compat.py``'s GPU case (passed in session 32). PyTorch's pinned-memory
# allocator keeps the page-locked blocks of freed pinned tensors for later pinned allocations and hands them back
# to the system only in ``torch._C._host_emptyCache()`` (the host twin of ``torch.cuda.empty_cache``; no public
# name in these versions). Offloaded checkpointing frees its pinned buffers before an export and on a re-plan
# (checkpointing's ``release_host_buffers``); without this call the pages would stay locked in the process.
def empty_pinned_host_cache() -> bool:
    """Hand PyTorch's cached page-locked host blocks back to the system; False where this torch cannot."""
    import torch

    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is None or not torch.cuda.is_available():
        return False
    empty()
    return True
