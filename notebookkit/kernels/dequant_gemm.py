"""Pieces shared by the GEMMs that dequantise a frozen low-bit weight inside the tile
(:mod:`notebookkit.kernels.q2_matmul`, :mod:`notebookkit.kernels.ternary_matmul`). Not an op of its own.

``dot_acc`` is their one ``tl.dot`` step, ``acc + a @ b`` with fp32 accumulation, where fp32 inputs are
multiplied as IEEE fp32 (``input_precision="ieee"``), not TF32; 16-bit inputs take the default.
``as_rows`` is how their launchers see an activation ``[..., features]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["dot_acc", "as_rows"]

# Device-only helper, compiled as part of the kernels that call it (tests/kernels/aot.py).
AOT_HELPERS = ["dot_acc"]


@triton.jit
def dot_acc(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` (fp32 accumulator ``acc``); ``IEEE``: fp32 ``a``, ``b`` multiplied as IEEE fp32, not TF32."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


def as_rows(a: torch.Tensor, features: int) -> torch.Tensor:
    """``a`` as a ``[rows, features]`` view (a copy only when its last dimension is strided)."""
    a2 = a.reshape(-1, features)
    if a2.stride(-1) != 1:
        a2 = a2.contiguous()
    return a2
