"""RMSNorm instances -> ``notebookkit.kernels.rms_norm``.

Llama style:    ``y = (x * rstd).to(dtype) * w``,          ``rstd = 1 / sqrt(mean(x**2) + eps)`` in fp32.
Gemma style:    ``y = (x * rstd * (1 + w)).to(dtype)``, everything in fp32 before the cast.
gpt-oss style:  ``y = (x * rstd * w).to(dtype)``, the same without the offset (its weights are kept in fp32).

The kernel's autograd function supplies the backward (d/dx and d/dw); we only rebind ``forward`` of
each norm instance and read ``eps`` from the instance (``variance_epsilon`` or ``eps``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from notebookkit.base_layers.kernel_ops import kernel
from notebookkit.base_layers.rebinding import rebind


def is_rms_norm(module: nn.Module) -> bool:
    """True for the RMSNorm modules of the supported families (by class name and shape)."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and rms_norm_eps(module) is not None
        and getattr(module, "with_scale", True) is not False
    )


def rms_norm_eps(module: nn.Module) -> Optional[float]:
    """The epsilon of an RMSNorm module (``variance_epsilon`` or ``eps``), ``None`` when it has neither."""
    for attr in ("variance_epsilon", "eps"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _make_forward(eps: float, flavour: str):
    rms_norm = kernel("rms_norm", "rms_norm")

    def rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, eps, flavour=flavour)

    return rms_norm_forward


def patch_norms(model: nn.Module, flavour: str) -> int:
    """Rebind every RMSNorm of ``model`` to the kernel's ``flavour`` (``Family.norm``); returns how many were
    patched (0 if the kernel is missing)."""
    if kernel("rms_norm", "rms_norm") is None:
        return 0
    count = 0
    for module in model.modules():
        if is_rms_norm(module):
            rebind(module, _make_forward(rms_norm_eps(module), flavour), "rms_norm")
            count += 1
    return count
