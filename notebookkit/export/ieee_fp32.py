"""Matrix products at full IEEE fp32 precision for a block: what every merge's ``W + s B A`` runs under.

TF32 keeps 10 mantissa bits, which shows in a 16-bit merged weight wherever ``s B A`` is small, so
the merges switch reduced-precision fp32 products off for their products and restore the caller's
settings afterwards.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["ieee_fp32_matmul"]


@contextlib.contextmanager
def ieee_fp32_matmul():
    """fp32 matrix products at full fp32 precision inside the block (TF32 / bf16 reduced precision off, on CUDA
    and on oneDNN CPUs), the caller's settings back afterwards. torch >= 2.9 keeps these per backend
    (``torch.backends.<backend>.matmul.fp32_precision``, what ``tf32=True`` training sets through transformers);
    reading them through the older ``torch.get_float32_matmul_precision`` would raise after that, so the block
    uses the per-backend settings where they exist."""
    backends = [getattr(getattr(torch.backends, name, None), "matmul", None) for name in ("cuda", "mkldnn")]
    backends = [b for b in backends if b is not None and hasattr(b, "fp32_precision")]
    if not backends:  # torch < 2.9
        before_legacy = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before_legacy)
        return
    before = [b.fp32_precision for b in backends]
    for backend in backends:
        backend.fp32_precision = "ieee"
    try:
        yield
    finally:
        for backend, precision in zip(backends, before):
            backend.fp32_precision = precision
