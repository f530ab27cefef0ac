"""The reference policy of DPO and GRPO: the same weights, no second model.

DPO's loss and GRPO's KL term compare the policy ``pi_theta`` with a frozen reference ``pi_ref``:

    DPO:  r(x, y) = beta * (log pi_theta(y | x) - log pi_ref(y | x))
    GRPO: KL_t    = exp(l_ref - l_theta) - (l_ref - l_theta) - 1      (k3, per token, when beta > 0)

With LoRA the base weights are frozen, so ``pi_ref`` is the same model with the adapters switched off
(``peft_model.disable_adapter()``): no second copy of the weights. TRL 1.16 does this with one twist:
given a ``PeftModel`` and ``ref_model=None`` it adds a second adapter named ``"ref"``, a frozen copy of
``"default"``, because the user's adapter may already carry trained weights (an SFT run before DPO),
and runs the reference with ``"ref"`` active.

* A freshly initialised adapter (PEFT's LoRA init sets ``B = 0``, so ``s * B A x = 0``) computes
  exactly what the base model computes. :func:`use_base_as_reference` deletes the copy, and TRL then
  runs the reference with the adapters disabled, which also skips the LoRA matmuls.
* A trained adapter keeps the copy: the reference is then the primed model, which is what DPO and
  GRPO mean by "the model before this run". The copy is adapter-sized (``r * (in + out)`` values per
  projection), not a copy of the model.

A model without adapters and no ``ref_model`` would make TRL load a second full model from the hub
name; :func:`refuse_second_model` stops that before anything is built.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["REFERENCE_ADAPTER", "adapter_is_fresh", "use_base_as_reference", "refuse_second_model", "describe_reference",
           "reference_policy"]

#: the name TRL gives its frozen copy of the trained adapter
REFERENCE_ADAPTER = "ref"


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def adapter_is_fresh(model: Any, adapter: str = "default") -> bool:
    """Whether ``adapter`` of a PEFT model still adds nothing: every LoRA ``B`` matrix is all zeros.

    Then the adapter model equals the base model exactly, and the base model (adapters disabled)
    is a valid reference for DPO / GRPO.
    """
    import torch

    found = False
    for module in model.modules():
        for attr in ("lora_B", "lora_embedding_B"):
            parts = getattr(module, attr, None)
            if parts is None or adapter not in parts:
                continue
            found = True
            weight = parts[adapter].weight if hasattr(parts[adapter], "weight") else parts[adapter]
            with torch.no_grad():
                if bool(weight.detach().ne(0).any()):
                    return False
    return found


def use_base_as_reference(model: Any) -> bool:
    """Delete TRL's frozen adapter copy when the trained adapter is still fresh (see the module notes).

    Returns True when the copy was deleted (the reference is now the model with adapters disabled).
    """
    if not _is_peft(model) or REFERENCE_ADAPTER not in model.peft_config:
        return False
    if not adapter_is_fresh(model):
        return False
    model.delete_adapter(REFERENCE_ADAPTER)
    return True


def refuse_second_model(model: Any, ref_model: Any, peft_config: Any, *, trainer: str, reference_off: str) -> None:
    """Raise before TRL loads a second full model as the reference.

    Args:
        model, ref_model, peft_config: what the trainer was given.
        trainer: the trainer's name, for the message.
        reference_off: the setting that makes the trainer need no reference (named in the fix).
    """
    if ref_model is not None or peft_config is not None or _is_peft(model) or isinstance(model, str):
        return
    raise ValueError(
        f"{trainer} was given a model without LoRA adapters and no ref_model, so TRL would load a second full copy "
        "of the model as the frozen reference. Add adapters first: model = FastLanguageModel.get_peft_model(model, "
        "r=16, ...); the reference is then the same weights with the adapters disabled (no copy). For full "
        f"fine-tuning pass ref_model= yourself, or set {reference_off}."
    )


def describe_reference(trainer: Any) -> str:
    """One line saying what the trainer uses as its reference policy."""
    model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
    if getattr(trainer, "ref_model", None) is not None:
        return f"a separate reference model ({type(trainer.ref_model).__name__})"
    if not _is_peft(model):
        return "none"
    if REFERENCE_ADAPTER in model.peft_config:
        return (f"a frozen copy of the trained adapter (adapter {REFERENCE_ADAPTER!r}), on the same base weights: "
                "the reference is the model before this run")
    return "the same weights with the LoRA adapters disabled (no copy)"


@contextlib.contextmanager
def _checkpointing_off(model: Any, kwargs: dict | None) -> Iterator[None]:
    """Hugging Face's gradient checkpointing off for the block, then back on (what TRL's
    ``disable_gradient_checkpointing`` does, reading the flag under its current name on the model a PEFT model
    wraps: left on, an offloaded plan would copy every layer input of the no-grad reference forward to the host)."""
    from notebookkit.compat import checkpointing_switches, is_checkpointing

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    was_on = is_checkpointing(base)
    disable, enable = checkpointing_switches(base)
    if was_on:
        disable()
    try:
        yield
    finally:
        if was_on:
            enable(kwargs)


@contextlib.contextmanager
def reference_policy(trainer: Any) -> Iterator[Any]:
    """Yield the model that scores ``pi_ref`` for ``trainer``, under ``torch.no_grad``: the ``ref_model`` it was
    given, else its own PEFT model with TRL's frozen ``"ref"`` adapter active when that exists, else with the
    adapters disabled (the same choice as TRL's trainers; gradient checkpointing off meanwhile, as TRL does)."""
    import torch
    from trl.trainer.utils import use_adapter

    with torch.no_grad():
        if getattr(trainer, "ref_model", None) is not None:
            yield trainer.accelerator.unwrap_model(trainer.ref_model)
            return
        model = trainer.accelerator.unwrap_model(trainer.model)
        if not _is_peft(model):
            raise ValueError(
                f"{type(trainer).__name__} scores its reference with the LoRA adapters disabled, but the model has no "
                "adapters and no ref_model was given; add adapters with FastLanguageModel.get_peft_model."
            )
        adapter = REFERENCE_ADAPTER if REFERENCE_ADAPTER in model.peft_config else None
        with _checkpointing_off(trainer.model, trainer.args.gradient_checkpointing_kwargs), \
                use_adapter(model, adapter_name=adapter):
            yield model
