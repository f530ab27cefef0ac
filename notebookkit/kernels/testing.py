"""Helpers shared by the kernel tests (CPU interpreter and GPU): errors against float64 and NaN poison."""

from __future__ import annotations

import torch

# Relative-error bounds per dtype (issue "Fused Triton kernels").
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN/Inf anywhere in ``out`` gives ``inf``."""
    out64 = out.detach().to(torch.float64)
    ref64 = ref.detach().to(device=out64.device, dtype=torch.float64)
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    return num / denom if denom > 0 else num


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "", factor: float = 1.0) -> None:
    """Assert ``rel_err(out, ref)`` is within the dtype's bound (times ``factor``)."""
    err = rel_err(out, ref)
    bound = TOLERANCE[dtype] * factor
    assert err <= bound, f"{what}: relative error {err:.3e} > {bound:.1e} ({dtype})"


def poisoned(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer filled with NaN, so a kernel that skips elements is caught."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def devices() -> list[str]:
    """Devices to test on: CPU (interpreter) always, CUDA when present."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
