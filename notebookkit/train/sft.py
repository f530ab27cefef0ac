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

Which LM head computes the loss. TRL 1.15+ ``SFTTrainer.compute_loss`` never reads the model's
loss: it calls ``model(**batch, fused_lm_head=True)``, a forward TRL installs at construction that
runs the backbone and TRL's own chunked log-prob function on ``lm_head.weight`` (per-token
log-probs, entropy and top-1 flags, for the ``entropy`` / ``mean_token_accuracy`` metrics), and
divides ``-sum(log p)`` by ``num_items_in_batch`` (or the batch's label count). :class:`FastSFTTrainer`
(what :func:`make_sft_trainer` builds) is that ``SFTTrainer`` with one method changed: in training
its ``compute_loss`` calls the model with ``labels`` and ``num_items_in_batch``, so a notebookkit model
returns the same quantity from ``notebookkit.kernels.fused_linear_cross_entropy``,

    loss = sum_{t : y_{t+1} != -100} ( logsumexp(h_t W^T) - (h_t W^T)[y_{t+1}] ) / N ,

with ``N = num_items_in_batch`` (the label count of the whole accumulated step, so gradient
accumulation equals one big batch) or the micro-batch's label count, clamped at 1, exactly as TRL
(its gradients too: the kernel returns dL/dh and dL/dW). Completion-only and assistant-only
losses are already in ``labels`` (-100 elsewhere) when the batch arrives, so they hold unchanged.
The per-token entropy and top-1 flags are not computed on that path, so the training logs lack
``entropy`` and ``mean_token_accuracy`` (evaluation keeps them: it runs TRL's head). Settings that
need TRL's per-token values (``loss_type="dft"``, label smoothing, a ``compute_loss_func``, MoE
router losses, sequence/context parallelism, prompt-learning adapters) or a model whose head is
not notebookkit's run TRL's own path; the trainer prints one banner line saying which.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

__all__ = ["sft_config", "make_sft_trainer", "precision_flags", "FastSFTTrainer", "fused_loss_blocker"]


def precision_flags(model: Any = None) -> dict[str, bool]:
    """``fp16`` / ``bf16`` Trainer flags for the model's dtype on this machine (both off on CPU)."""
    import torch

    from ..models.common.precision import is_bfloat16_supported

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
        dtype = torch.bfloat16 if is_bfloat16_supported() else torch.float16
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


FUSED_CE_FEATURE = "fused CE loss"


def fused_loss_blocker(trainer: Any) -> str | None:
    """Why ``trainer`` cannot compute its SFT training loss with notebookkit's fused cross-entropy.

    ``None`` when it can: the loss is TRL's plain negative log-likelihood and the model (or the
    base model under a PEFT adapter) runs notebookkit's patched causal-LM forward. Otherwise a
    short reason for the banner line.
    """
    from ..base_layers.rebinding import patch_tag
    from ..models.patching.patch_lm_head import adds_router_loss

    args = trainer.args
    loss_type = getattr(args, "loss_type", "nll")
    if loss_type not in (None, "nll"):
        return f"loss_type={loss_type!r} weights every token by its probability (TRL's per-token head)"
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "a compute_loss_func is set (it needs the model's full logits)"
    if getattr(trainer, "label_smoother", None) is not None:
        return "label_smoothing_factor > 0 needs the full logits"
    pc = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    if pc is not None and (getattr(pc, "sp_enabled", False) or getattr(pc, "cp_enabled", False)):
        return "sequence / context parallelism shards the labels (TRL's path)"
    model = trainer.model
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        return "prompt-learning adapters prepend virtual tokens (TRL's path)"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(trainer, "aux_loss_enabled", False) and not (adds_router_loss(base)
                                                            and hasattr(trainer, "router_aux_loss_coef")):
        return "the MoE router auxiliary loss is on and only TRL's LM head adds it for this model"
    if patch_tag(base) != "causal_lm":
        from ..models.common.banner import get_banner

        banner = get_banner(model)
        if banner is not None and FUSED_CE_FEATURE in banner.features and not banner.is_on(FUSED_CE_FEATURE):
            return banner.features[FUSED_CE_FEATURE][1]
        return "the model's causal-LM head is not notebookkit's (load it with FastLanguageModel)"
    return None


def _count_train_tokens(trainer: Any, inputs: dict[str, Any]) -> None:
    """Keep TRL's cumulative ``num_tokens`` metric (the dashboard's tokens/s) on the fused path."""
    import torch

    from .trl_compat import trl_add_train_tokens, trl_counts_train_tokens

    if not trl_counts_train_tokens(trainer):
        return
    if "attention_mask" in inputs:
        local = inputs["attention_mask"].sum()
    elif "position_ids" in inputs:  # padding-free: one packed row, every position is a token
        local = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
    else:
        return
    trl_add_train_tokens(trainer, trainer.accelerator.gather_for_metrics(local).sum().item())


def fused_sft_loss(trainer: Any, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
    """The SFT training loss of one micro-batch from the model's own (fused cross-entropy) forward.

    Equals TRL's ``SFTTrainer.compute_loss`` for ``loss_type="nll"``: the summed next-token
    negative log-likelihood over labels != -100, divided by ``num_items_in_batch`` when the Trainer
    passes it (else by the micro-batch's label count, at least 1), times the process count when
    ``average_tokens_across_devices`` is on (DDP then averages the gradients back). A mixture of experts
    whose router loss TRL turned on (``trainer.aux_loss_enabled``) adds, as TRL does,
    ``router_aux_loss_coef * aux_loss / steps`` (``steps``: the accumulation steps when the Trainer passes
    ``num_items_in_batch``, else 1; not scaled by the process count), computed in the model's head, and
    logs ``aux_loss``.
    """
    import torch

    call = dict(inputs)
    call["use_cache"] = False
    if num_items_in_batch is not None:
        n = num_items_in_batch
        if not isinstance(n, torch.Tensor) and not n > 0:
            n = torch.tensor(0.0)  # no label in the whole step: 0 / 1, like TRL
        call["num_items_in_batch"] = n
    processes = 1
    if getattr(trainer.args, "average_tokens_across_devices", False) and num_items_in_batch is not None:
        tp = trainer.get_tp_size() if hasattr(trainer, "get_tp_size") else 1
        processes = trainer.accelerator.num_processes // tp
    router_loss = getattr(trainer, "aux_loss_enabled", False)
    if router_loss:
        steps = 1
        if num_items_in_batch is not None:
            steps = getattr(trainer, "current_gradient_accumulation_steps", trainer.args.gradient_accumulation_steps)
        call["output_router_logits"] = True
        call["aux_loss_weight"] = trainer.router_aux_loss_coef / steps / processes  # the loss is scaled back below
    outputs = model(**call)
    loss = getattr(outputs, "loss", None) if not isinstance(outputs, tuple) else outputs[0]
    if loss is None:
        raise RuntimeError(
            "The model returned no loss for a batch with labels, so notebookkit's fused SFT loss cannot be used. "
            "Build the trainer with fused_loss=False (TRL computes the loss itself) or reload the model with "
            "FastLanguageModel.from_pretrained."
        )
    loss = loss * processes if processes != 1 else loss
    if router_loss:
        from .trl_compat import logged_metrics

        aux = trainer.accelerator.gather_for_metrics(outputs.aux_loss.detach()).mean().item()
        logged_metrics(trainer, "train")["aux_loss"].append(aux)
    _count_train_tokens(trainer, inputs)
    return loss


def _report_fused_loss(trainer: Any, show: bool) -> None:
    """Record (and print once per change) the banner line saying which head computes the SFT loss."""
    from ..models.common.banner import Banner, get_banner

    off = trainer.fused_loss_off
    if off is None:
        why = (
            "SFT training loss via fused linear cross-entropy, no full logits (FastSFTTrainer); TRL's train "
            "metrics entropy / mean_token_accuracy are off (eval keeps them; fused_loss=False restores TRL's head)"
        )
    else:
        from ..models.patching.patch_lm_head import trl_own_lm_head

        head = "TRL's own chunked LM head (no full logits either)" if trl_own_lm_head() else "TRL's compute_loss"
        why = f"SFT training loss by {head}: {off}"
    banner = get_banner(trainer.model)
    target = banner if banner is not None else Banner()
    unchanged = target.features.get(FUSED_CE_FEATURE) == (off is None, why)
    target.feature(FUSED_CE_FEATURE, off is None, why)
    if show and not unchanged and trainer.is_world_process_zero():
        print(f"notebookkit: {target.line(FUSED_CE_FEATURE)}", flush=True)


def _checked_arguments(sft_trainer: type, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``SFTTrainer.__init__`` keyword arguments from a call's ``args`` / ``kwargs``: older TRL keywords
    moved (:func:`~notebookkit.train.legacy_keywords.move_old_sft_keywords`), then the data sets and
    batch settings checked (:mod:`notebookkit.train.sft_inputs`). Raises before anything is built."""
    import inspect

    from .legacy_keywords import move_old_sft_keywords
    from .sft_inputs import check_batch_settings, check_sft_dataset

    names = [p for p in inspect.signature(sft_trainer.__init__).parameters if p != "self"]
    if len(args) > len(names):
        raise TypeError(f"SFTTrainer takes at most {len(names)} positional arguments, got {len(args)}.")
    duplicated = sorted(set(names[: len(args)]) & set(kwargs))
    if duplicated:
        raise TypeError(f"SFTTrainer got {duplicated} both by position and by keyword.")
    arguments = move_old_sft_keywords({**dict(zip(names, args)), **kwargs})
    config = arguments.get("args")
    if config is not None:
        check_batch_settings(config)
    if (getattr(config, "dataset_kwargs", None) or {}).get("skip_prepare_dataset"):
        return arguments  # the caller prepared the rows for the collator
    checks = dict(
        tokenizer=arguments.get("processing_class"),
        dataset_text_field=getattr(config, "dataset_text_field", "text"),
        formatting_func=arguments.get("formatting_func"),
        chat_template=getattr(config, "chat_template_path", None),
    )
    if arguments.get("train_dataset") is not None:
        check_sft_dataset(arguments["train_dataset"], name="train_dataset", **checks)
    evaluation = arguments.get("eval_dataset")
    if isinstance(evaluation, dict):
        for key, dataset in evaluation.items():
            check_sft_dataset(dataset, name=f"eval_dataset[{key!r}]", **checks)
    elif evaluation is not None:
        check_sft_dataset(evaluation, name="eval_dataset", **checks)
    return arguments


_TRAINER_CLASS: Any = None


def _fast_sft_trainer_class() -> type:
    global _TRAINER_CLASS
    if _TRAINER_CLASS is not None:
        return _TRAINER_CLASS
    from trl import SFTTrainer

    class FastSFTTrainer(SFTTrainer):
        """TRL's ``SFTTrainer`` whose training loss runs notebookkit's fused linear cross-entropy.

        Same arguments as ``trl.SFTTrainer``; also the keywords of older TRL releases that the most
        used notebooks pass (``tokenizer=``, ``dataset_text_field=``, ``max_seq_length=``,
        ``packing=``, ...: :mod:`notebookkit.train.legacy_keywords`). The data sets and batch
        sizes are checked before TRL sees them (:mod:`notebookkit.train.sft_inputs`), so a data set
        with no rows or no column SFTTrainer reads fails at construction, with the model untouched.
        Plus:

        Args:
            fused_loss: ``True`` (default) computes the training loss with the model's fused
                cross-entropy (same value and gradients as TRL's; no ``entropy`` /
                ``mean_token_accuracy`` in the training logs). ``False`` keeps TRL's own LM head.
            show_banner: print the one-line banner saying which head computes the loss.

        Evaluation, ``return_outputs=True`` and the settings listed by :func:`fused_loss_blocker`
        run TRL's own ``compute_loss`` unchanged.
        """

        def __init__(self, *args: Any, fused_loss: bool = True, show_banner: bool = True, **kwargs: Any) -> None:
            arguments = _checked_arguments(SFTTrainer, args, kwargs)
            super().__init__(**arguments)
            self.fused_loss_off = fused_loss_blocker(self) if fused_loss else "fused_loss=False was passed"
            _report_fused_loss(self, show_banner)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if self.fused_loss_off is not None or return_outputs or not self.model.training or "labels" not in inputs:
                return super().compute_loss(
                    model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
                )
            return fused_sft_loss(self, model, inputs, num_items_in_batch)

    FastSFTTrainer.__module__ = __name__
    FastSFTTrainer.__qualname__ = "FastSFTTrainer"
    _TRAINER_CLASS = FastSFTTrainer
    return FastSFTTrainer


def __getattr__(name: str) -> Any:
    if name == "FastSFTTrainer":  # built on first use: importing TRL takes seconds
        return _fast_sft_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    fused_loss: bool = True,
    show_banner: bool = True,
    **config_kwargs: Any,
) -> Any:
    """Build a :class:`FastSFTTrainer` (TRL's ``SFTTrainer``, fused loss) with the :func:`sft_config` preset.

    Args:
        model, tokenizer: from ``FastLanguageModel.from_pretrained`` / ``get_peft_model``.
        train_dataset, eval_dataset: ``messages`` (chat), ``text`` or ``prompt``/``completion`` rows.
        args: a ready ``SFTConfig``; otherwise one is built from ``config_kwargs``.
        callbacks: e.g. ``[LiveDashboard()]``.
        responses_only: train only on assistant turns (calls ``train_on_responses_only``).
        instruction_part, response_part: markers for ``responses_only`` (detected when left out).
        fused_loss: compute the training loss with notebookkit's fused cross-entropy (``False``:
            TRL's own LM head, which also logs ``entropy`` / ``mean_token_accuracy``).
        show_banner: print the one-line banner saying which head computes the loss.
    """
    trainer_class = _fast_sft_trainer_class()
    if args is None:
        args = sft_config(model=model, **config_kwargs)
    elif config_kwargs:
        raise TypeError("Pass either args= or SFTConfig keyword arguments, not both.")
    trainer = trainer_class(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                            processing_class=tokenizer, callbacks=callbacks, fused_loss=fused_loss,
                            show_banner=show_banner)
    if responses_only:
        from ..data.responses_only import train_on_responses_only

        train_on_responses_only(trainer, instruction_part=instruction_part, response_part=response_part)
    return trainer
