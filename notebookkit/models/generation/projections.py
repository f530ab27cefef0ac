"""Linear projections of the decode path, LoRA adapters unmerged: ``Y_i = X W_i^T + b_i + s_i (X A_i^T) B_i^T``.

Projections that read one input (q/k/v; gate/up; o or down alone) go through the training path's
helpers of :mod:`notebookkit.kernels.lora_projection` without autograd
(:func:`~notebookkit.kernels.lora_projection.shared_input_forward`: the adapters of one rank share
``X A_cat^T``), with one difference for 4-bit base weights: when the decode kernel
``notebookkit.kernels.nf4_matvec`` is available and takes the input (CUDA, few rows), the base part
``X W^T`` reads the NF4 bytes directly instead of dequantising each whole weight per token, and the
low-rank part is added into its output (``grouped_projection_forward`` with the base outputs given).

Graph safety: the views (:func:`notebookkit.models.lora_fast_path.views`) are built anew on each call
outside a training forward pass, so adapter casts and ``A_cat`` are computed inside a captured step
and every replay reads the adapters' current values (GRPO trains them between generations).
A projection that the fused path cannot take (DoRA, several adapters, 8-bit, ...) runs its own module.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from notebookkit.kernels.lora_projection import (
    LoRAProjection,
    adapter_group,
    grouped_projection_forward,
    projection_forward,
    shared_input_forward,
)

from ..kernel_ops import kernel
from ..lora_fast_path import views

__all__ = ["project", "nf4_matvec_applies"]


def _nf4_kernels():
    return kernel("nf4_matvec", "nf4_matvec"), kernel("nf4_matvec", "nf4_matvec_supported")


def _nf4_takes(x2d: torch.Tensor, projs: Sequence[LoRAProjection]) -> bool:
    matvec, supported = _nf4_kernels()
    if matvec is None or supported is None:
        return False
    quantized = [p for p in projs if p.quantized]
    return bool(quantized) and all(supported(x2d, (p.weight, p.quant_state)) for p in quantized)


def nf4_matvec_applies(x2d: torch.Tensor, modules: Sequence[nn.Module]) -> bool:
    """Whether :func:`project` runs the NF4 matrix-vector kernel for these modules on this input."""
    found, _ = views(*modules)
    return found is not None and _nf4_takes(x2d, [v.projection for v in found])


def _nf4_bases(x2d: torch.Tensor, projs: Sequence[LoRAProjection]) -> Optional[list]:
    if not _nf4_takes(x2d, projs):
        return None
    matvec, _ = _nf4_kernels()
    return [matvec(x2d, (p.weight, p.quant_state)) if p.quantized else None for p in projs]


def project(x2d: torch.Tensor, modules: Sequence[nn.Module]) -> list[torch.Tensor]:
    """Outputs ``[N, out_i]`` of the linear ``modules`` (plain, 4-bit or PEFT LoRA) that all read ``x2d [N, in]``."""
    found, _ = views(*modules)
    if found is None:
        return [module(x2d) for module in modules]
    projs = tuple(v.projection for v in found)
    bases = _nf4_bases(x2d, projs)
    if bases is None:
        outs, _ = shared_input_forward(x2d, projs)
    else:
        group = adapter_group(projs, x2d.dtype)
        if group is not None:
            outs = grouped_projection_forward(x2d, group, None, bases)
        else:
            outs = [projection_forward(x2d, p, *p.adapters(x2d.dtype), None, base) for p, base in zip(projs, bases)]
    return [y if v.bias is None else y + v.bias for y, v in zip(outs, found)]
