"""SFT presets: an ``SFTConfig`` with sensible defaults for one small GPU (or a CPU in CI), and a
one-call ``SFTTrainer`` builder.

Supervised fine-tuning minimises the mean next-token cross-entropy over the label tokens,

    L(theta) = - (1 / N) * sum_{t : y_t != -100} log p_theta(y_t | x_<t) ,

and the LoRA adapters receive dL/dA, dL/dB through the model's fused backward. The effective batch is
``per_device_train_batch_size * gradient_accumulation_steps`` sequences per optimizer step; TRL divides
the summed token loss by the number of label tokens in the whole accumulated batch, so gradient
accumulation matches one big batch.

The preset only picks defaults (precision from the model's dtype, 8-bit AdamW on CUDA, no
checkpoint saving, no external loggers) and drops arguments the installed TRL does not know, so the
same notebook runs on the CI's TRL and on an older Colab one.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

__all__ = ["sft_config", "make_sft_trainer", "precision_flags"]


def precision_flags(model: Any = None) -> dict[str, bool]:
    """``fp16`` / ``bf16`` Trainer flags for the model's dtype on this machine (both off on CPU)."""
    import torch

    if not torch.cuda.is_available():
        return {"fp16": False, "bf16": False}
    dtype = None
    if model is not None:
        try:
            dtype = model.get_input_embeddings().weight.dtype
        except Exception:
            dtype = getattr(model, "dtype", None)
        if dtype == torch.float32:
            return {"fp16": False, "bf16": False}
    if dtype is None:
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"fp16": dtype == torch.float16, "bf16": dtype == torch.bfloat16}


def _accepted_fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def sft_config(
    output_dir: str = "outputs",
    *,
    max_steps: int = 60,
    num_train_epochs: float = 1.0,
    learning_rate: float = 2e-4,
    per_device_train_batch_size: int = 2,
    gradient_accumulation_steps: int = 4,
    warmup_steps: int = 5,
    lr_scheduler_type: str = "linear",
    weight_decay: float = 0.01,
    seed: int = 3407,
    max_length: int | None = 1024,
    packing: bool = False,
    logging_steps: int = 1,
    eval_steps: int | None = None,
    optim: str | None = None,
    model: Any = None,
    **overrides: Any,
) -> Any:
    """A TRL ``SFTConfig`` for LoRA fine-tuning.

    Args:
        output_dir: where checkpoints and logs would go (nothing is saved unless you ask).
        max_steps: optimizer steps; ``-1`` trains ``num_train_epochs`` instead.
        learning_rate, warmup_steps, lr_scheduler_type, weight_decay: the schedule (2e-4 is the usual LoRA rate).
        per_device_train_batch_size, gradient_accumulation_steps: sequences per step =
            their product.
        seed: seeds data order and dropout.
        max_length: longest sequence in tokens (use the length profile's suggestion).
        packing: pack several examples per row without padding (padding-free, position ids
            restart per example).
        logging_steps: log the loss every N steps (the dashboard reads these logs).
        eval_steps: evaluate on ``eval_dataset`` every N steps (``None``: no evaluation during training).
        optim: optimizer; ``adamw_8bit`` on CUDA, ``adamw_torch`` on CPU when left out.
        model: when given, fp16/bf16 is chosen from its dtype.
        **overrides: any other ``SFTConfig`` field. Unknown fields are dropped with a warning.
    """
    import torch
    from trl import SFTConfig

    cuda = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir,
        max_steps=max_steps,
        num_train_epochs=num_train_epochs,
        learning_rate=learning_rate,
        per_device_train_batch_size=per_device_train_batch_size,
        per_device_eval_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        warmup_steps=warmup_steps,
        lr_scheduler_type=lr_scheduler_type,
        weight_decay=weight_decay,
        seed=seed,
        data_seed=seed,
        max_length=max_length,
        packing=packing,
        logging_steps=logging_steps,
        optim=optim or ("adamw_8bit" if cuda else "adamw_torch"),
        report_to="none",
        save_strategy="no",
        dataloader_num_workers=0,
        use_cpu=not cuda,
        **precision_flags(model),
    )
    if eval_steps:
        kwargs.update(eval_strategy="steps", eval_steps=eval_steps)
    kwargs.update(overrides)
    fields = _accepted_fields(SFTConfig)
    if "max_length" not in fields and "max_seq_length" in fields:  # older TRL
        kwargs["max_seq_length"] = kwargs.pop("max_length")
    if "eval_strategy" in kwargs and "eval_strategy" not in fields and "evaluation_strategy" in fields:
        kwargs["evaluation_strategy"] = kwargs.pop("eval_strategy")
    unknown = sorted(k for k in kwargs if k not in fields)
    if unknown:
        warnings.warn(f"sft_config: this TRL's SFTConfig has no {unknown}; they are ignored.", stacklevel=2)
        for k in unknown:
            kwargs.pop(k)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
        return SFTConfig(**kwargs)


def make_sft_trainer(
    model: Any,
    tokenizer: Any,
    train_dataset: Any,
    eval_dataset: Any = None,
    *,
    args: Any = None,
    callbacks: list | None = None,
    responses_only: bool = False,
    instruction_part: str | None = None,
    response_part: str | None = None,
    **config_kwargs: Any,
) -> Any:
    """Build a TRL ``SFTTrainer`` with the :func:`sft_config` preset.

    Args:
        model, tokenizer: from ``FastLanguageModel.from_pretrained`` / ``get_peft_model``.
        train_dataset, eval_dataset: ``messages`` (chat), ``text`` or ``prompt``/``completion`` rows.
        args: a ready ``SFTConfig``; otherwise one is built from ``config_kwargs``.
        callbacks: e.g. ``[LiveDashboard()]``.
        responses_only: train only on assistant turns (calls ``train_on_responses_only``).
        instruction_part, response_part: markers for ``responses_only`` (detected when left out).
    """
    from trl import SFTTrainer

    if args is None:
        args = sft_config(model=model, **config_kwargs)
    elif config_kwargs:
        raise TypeError("Pass either args= or SFTConfig keyword arguments, not both.")
    kwargs: dict[str, Any] = dict(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    trainer = SFTTrainer(**kwargs)
    if responses_only:
        from ..data.responses_only import train_on_responses_only

        train_on_responses_only(trainer, instruction_part=instruction_part, response_part=response_part)
    return trainer
