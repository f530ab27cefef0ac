"""What the notebookkit subclasses of TRL's preference and RL trainers share: reading their arguments
the way Python binds them (so the checks see every data set, given by position or by keyword) and
printing their one-line banner."""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["bind_trainer_arguments", "print_banner"]


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
