"""Adapted linears outside the fused blocks (the vision towers' PEFT LoRA layers) -> the LoRA projection kernels.

For a frozen base weight ``W`` (16-bit or NF4), a frozen bias ``b`` and one active adapter::

    y = x W^T + b + s (x A^T) B^T           kernels.lora_projection.shared_input_lora (b added by the base GEMM)

Stock PEFT computes the low-rank term in the adapters' dtype. With fp32 adapters under a 16-bit
model (PEFT's default) it casts ``x`` to fp32 in every adapted linear, keeps that copy for the
backward of ``A`` and runs fp32 GEMMs. The kernels cast the adapters to the compute dtype once per
step instead, keep only ``x`` itself (which the base GEMM keeps anyway) and dequantise an NF4 base
weight on the fly. The gradients of ``A`` and ``B`` come back in the adapters' dtype.

The decoder's linears are inside fused blocks already (``lora_qkv``, ``lora_o``, ``lora_mlp``);
this is for the ones that are not: Qwen2.5-VL's and SigLIP's attention and MLP linears (they have
biases) and Qwen2.5-VL's merger. A layer the kernels cannot take (LoRA dropout, DoRA, several
active adapters, a trainable bias) keeps running PEFT's forward, decided on every call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from notebookkit.base_layers.kernel_ops import kernel, why_missing
from notebookkit.base_layers.rebinding import rebind

from .lora_fast_path import projection_view, views

__all__ = ["lora_linear_ready", "patch_lora_linears"]


def lora_linear_ready(module: nn.Module) -> str | None:
    """Why ``module`` is not a PEFT LoRA linear the kernels can take now, or ``None``."""
    if not (hasattr(module, "base_layer") and hasattr(module, "lora_A")):
        return "not a PEFT LoRA layer"
    _, reason = projection_view(module)
    return reason or why_missing("lora_projection", "shared_input_lora")


def _make_forward(shared_input_lora):
    """The patched forward (module docstring), with the kernel looked up once, at patch time."""

    def lora_linear_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        parts, _ = views(self) if not args and not kwargs else (None, None)
        if parts is None:  # PEFT's own forward when the kernels cannot take the layer now
            return type(self).forward(self, x, *args, **kwargs)
        view = parts[0]
        (y,) = shared_input_lora(x, (view.projection,), (view.bias,))
        return y

    return lora_linear_forward


def patch_lora_linears(*parts: nn.Module) -> int:
    """Rebind every PEFT LoRA linear in ``parts`` that the kernels take; returns how many."""
    forward = _make_forward(kernel("lora_projection", "shared_input_lora"))
    count, seen = 0, set()
    for part in parts:
        for module in part.modules():
            if id(module) not in seen and lora_linear_ready(module) is None:
                seen.add(id(module))
                rebind(module, forward, "lora_linear")
                count += 1
    return count
