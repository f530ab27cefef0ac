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


#: a unit in the last place, relative, of each dtype's rounding to nearest
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def assert_within_one_rounding(out: torch.Tensor, ref: torch.Tensor, size: torch.Tensor, count: int, what: str = "") -> None:
    """Assert that ``out`` (16- or 32-bit) is one fp32 sum of ``count`` terms rounded once to its dtype: ``ref`` the
    exact sum (float64), ``size`` the sum of the terms' magnitudes, elementwise
    ``|out - ref| <= u |ref| + (1 + u) g size + tiny`` with ``g = count 2^-24 / (1 - count 2^-24)`` (the fp32 sum's
    error in any order) and ``u`` the dtype's unit roundoff; two units for bf16 off CUDA (the interpreter's final
    cast truncates where the GPU rounds to nearest)."""
    dtype = out.dtype
    g = count * 2.0**-24 / (1 - count * 2.0**-24)
    unit = UNIT_ROUNDOFF[dtype] * (2 if dtype == torch.bfloat16 and not out.is_cuda else 1)
    ref, size = ref.to(torch.float64).flatten(), size.to(torch.float64).flatten()
    bound = unit * ref.abs() + (1 + unit) * g * size + torch.finfo(dtype).tiny
    excess = (out.flatten().double().to(ref.device) - ref).abs() - bound
    assert (excess <= 0).all(), f"{what}{int((excess > 0).sum())} of {ref.numel()} beyond the rounding bound"
