"""What the notebookkit subclasses of TRL's preference and RL trainers share: reading their arguments the way
Python binds them (so the checks see every data set, given by position or by keyword), printing their
one-line banner, and saying once when a batch runs TRL's own loss."""

from __future__ import annotations

import inspect
from typing import Any

from notebookkit.marks import LOSS_FALLBACKS

__all__ = ["bind_trainer_arguments", "first_row", "print_banner", "fall_back_once", "unsupported_inputs",
           "shared_fallback_reason"]


def bind_trainer_arguments(trainer_class: type, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``trainer_class.__init__``'s arguments as a name -> value dict, positions resolved as Python would.

    Raises ``TypeError`` as the call itself would (too many positions, an argument given twice, an
    unknown keyword), before the trainer is built.
    """
    arguments = dict(inspect.signature(trainer_class.__init__).bind(None, *args, **kwargs).arguments)
    arguments.pop("self", None)
    return arguments


def print_banner(trainer: Any, line: str) -> None:
    """Print ``notebookkit: <line>`` on the main process."""
    if trainer.is_world_process_zero():
        print(f"notebookkit: {line}", flush=True)


def first_row(dataset: Any, name: str, trainer: str, error: type[Exception]) -> tuple[dict[str, Any], list[str]]:
    """``(first row, column names)`` of a data set a trainer was given.

    Raises ``TypeError`` for something that is not a ``datasets.Dataset`` / ``IterableDataset`` and
    ``error`` for a data set without rows, each with the message of :mod:`notebookkit.train.sft_inputs`
    (naming ``trainer``).
    """
    from .sft_inputs import dataset_type_error, first_dataset_row

    problem = dataset_type_error(name, dataset, trainer)
    if problem is not None:
        raise problem
    try:
        row = first_dataset_row(name, dataset)
    except ValueError as err:
        raise error(str(err)) from None
    return row, list(getattr(dataset, "column_names", None) or row)


def fall_back_once(trainer: Any, reason: str) -> None:
    """Warn, once per trainer and reason, that a micro-batch's loss runs TRL's own computation instead of
    notebookkit's fused path (``reason`` names the setting and what to change to get the fused path)."""
    import warnings

    said = trainer.__dict__.setdefault(LOSS_FALLBACKS, set())
    if reason in said:
        return
    said.add(reason)
    warnings.warn(f"{type(trainer).__name__}: {reason}; this loss runs TRL's own computation (correct, but not "
                  "notebookkit's chunked log-prob path).", UserWarning, stacklevel=3)


def unsupported_inputs(inputs: dict[str, Any], known: set[str]) -> list[str]:
    """The keys of a trainer's batch that the fused path does not read (images, position ids, ...)."""
    return sorted(k for k, v in inputs.items() if k not in known and v is not None)


def shared_fallback_reason(trainer: Any, router_setting: str) -> "str | None":
    """The settings no fused preference / RL loss implements: several processes (the fused path calls the
    unwrapped model, outside DDP's gradient hooks) and a mixture-of-experts router loss (``router_setting``
    names the option that turns it on). A sentence, or None."""
    processes = trainer.accelerator.num_processes
    if processes > 1:
        return f"training runs on {processes} processes (the fused path is single-process)"
    if trainer.aux_loss_enabled:
        return f"the model's mixture-of-experts router loss is on ({router_setting})"
    return None
