"""Which implementation an op runs: the Triton kernel or its plain-PyTorch reference.

Rule (the package docstring of :mod:`notebookkit.kernels` says it in short):

* CUDA tensors run the Triton kernels.
* CPU tensors run the PyTorch reference, unless Triton is forced on (``use_triton(True)`` or the
  environment variable ``NOTEBOOKKIT_KERNELS=triton``); that needs ``TRITON_INTERPRET=1`` set
  before ``triton`` is first imported, which is how the kernel tests run Triton on a CPU.
* ``use_triton(False)`` or ``NOTEBOOKKIT_KERNELS=torch`` forces the reference everywhere
  (used by parity tests and as a debugging escape hatch).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

import torch

_state = threading.local()


def interpreter_on() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _forced() -> bool | None:
    forced = getattr(_state, "forced", None)
    if forced is not None:
        return forced
    env = os.environ.get("NOTEBOOKKIT_KERNELS", "").lower()
    if env == "triton":
        return True
    if env == "torch":
        return False
    return None


def should_use_triton(tensor: torch.Tensor) -> bool:
    """Decide the path for an op whose main input is ``tensor``."""
    forced = _forced()
    if forced is False:
        return False
    if tensor.is_cuda:
        return True
    if forced:
        if not interpreter_on():
            raise RuntimeError(
                "Triton kernels were forced on for CPU tensors, but TRITON_INTERPRET=1 is not set. "
                "Set it in the environment before starting Python (before triton is imported), "
                "or use the default PyTorch path on CPU."
            )
        return True
    return False


@contextlib.contextmanager
def use_triton(enabled: bool) -> Iterator[None]:
    """Force the Triton kernels (``True``) or the PyTorch references (``False``) in a block."""
    previous = getattr(_state, "forced", None)
    _state.forced = enabled
    try:
        yield
    finally:
        _state.forced = previous


def mark_written(*tensors: torch.Tensor) -> None:
    """Tell autograd that ``tensors`` were written behind its back (a Triton kernel wrote into them),
    so a node that saved one of them raises at backward instead of using stale values."""
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        for t in tensors:
            bump(t)


_SM_COUNTS: dict[torch.device, int] = {}


def sm_count(device: torch.device) -> int:
    """The SM count of a CUDA device, read once a device; an H200's 132 elsewhere (the interpreter), so a launch
    rule sized to the SMs picks under the interpreter what it picks on that card."""
    count = _SM_COUNTS.get(device)
    if count is None:
        count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        _SM_COUNTS[device] = count
    return count
