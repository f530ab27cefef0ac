"""Q2: notebookkit's own 2-bit base-weight format, its quantiser and its dequantisation kernel.

Format (a frozen weight ``W [N, K]``, ``N`` = out_features, ``K`` = in_features, group size ``G``):

* ``codes``: uint8 ``[N, K / 4]``. Byte ``j`` of row ``n`` holds the 2-bit codes of columns
  ``4j .. 4j + 3``, column ``4j + t`` in bits ``2t, 2t + 1`` (lowest bits first).
* ``scale``, ``zero``: fp16 ``[N, K / G]``, one pair per group of ``G`` consecutive columns of a row
  (groups never straddle rows; ``G`` is a power of two >= 16 dividing ``K``; 64 by default).

Dequantisation (fp32 arithmetic, one rounding to the output dtype):

      W[n, k] = out_dtype( (code(n, k) - zero[n, k // G]) * scale[n, k // G] )

Asymmetric: the four levels ``(0..3 - zero) * scale`` need not be centred on 0, and ``zero`` is
a real number (not an integer code) so that the fit below can move it freely. There is no backward:
the base weight is frozen; the LoRA path's backward reads the codes again
(:mod:`notebookkit.kernels.q2_matmul`).

Why fp16 for ``scale`` and ``zero``: 2 x 16 bits per 64 weights is 0.5 bit/weight (2.5 bits/weight
in all: Llama-3.1-70B's 68.5 G projection weights in 21.4 GB); fp32 would make it 3.0. The precision
of the pair is not what limits the error: on Gaussian 512 x 1024 weights the least-squares fit gives
0.3288 relative error with fp32 parameters, 0.3276 stored as fp16 (zero refitted to the rounded
scale, below) and 0.3288 rounded to bf16. fp16 rather than bf16 because the T4 has no bf16 and
fp16's range is ample for a group's ``(max - min) / 3`` (weights beyond fp16's range are refused;
scales under 2^-14 lose bits as subnormals). A constant group gets ``scale = |value|`` and decodes
exactly (tested); an all-zero group decodes to zeros.

Quantiser (:func:`quantize_q2`), per group, vectorised over ``2^19`` weights at a time:

* ``"minmax"``: ``scale = (max - min) / 3``, ``zero = -min / scale``, ``code = clamp(round(w / scale
  + zero), 0, 3)``. The start of the two others.
* ``"hqq"``: half-quadratic optimisation (HQQ, Badri & Shaji 2023) of the zero point, scale fixed:
  rounds of codes ``q = clamp(round(w / s + z), 0, 3)``; error ``e = w / s - (q - z)`` (in units of
  one step, so ``beta`` does not depend on the weights' magnitude: HQQ's own ``beta`` acts on the
  raw error); the L_p (p < 1) proximal step ``e' = sign(e) relu(|e| - |e|^(p-1) / beta)`` (large
  errors -- clipped outliers -- kept, small ones shrunk to 0); closed-form zero ``z = mean(q - w / s
  + e')`` over the group; ``beta *= kappa``. Keeps each group's best round by squared error.
* ``"lsq"`` (default): alternating least squares from the min-max start: for the current codes, the
  closed-form ``(scale, zero)`` of ``w ~ a q + b`` (a 2x2 normal equation per group: ``scale = a``,
  ``zero = -b / a``), then codes reassigned; a group keeps its previous fit where a round is not
  better (so the error never grows). Unlike HQQ it moves the scale too.

Every fit ends by rounding ``scale`` to fp16 and refitting ``zero`` to it (closed form), then fp16.

Measured on this CPU (``python -m notebookkit.kernels.q2``; one thread, 2-core machine, timings
noisy to ~30%). ``W`` Gaussian (std 0.02), ``G = 64``; "frob" is ``||W - W^||_F / ||W||_F``, "out" is
``||X W^T - X W^^T|| / ||X W^T||`` for Gaussian ``X`` of 256 rows:

    method                1024x1024 frob / out   4096x4096 frob / out   time 4096^2
    minmax                0.4442 / 0.4423        0.4440 / 0.4435        0.56 s
    hqq 5 rounds          0.4355 / 0.4338        0.4355 / 0.4350        2.3 s
    hqq 20 rounds         0.4268 / 0.4252        0.4270 / 0.4264        7.8 s
    hqq 20, beta=1        0.4311 / 0.4297        0.4312 / 0.4305        7.2 s
    hqq 20, p=1           0.4297 / 0.4279        0.4298 / 0.4294        4.7 s
    hqq 5 + lsq 4         0.3296 / 0.3285        0.3297 / 0.3295        3.2 s
    lsq 2 rounds          0.3408 / 0.3400        0.3410 / 0.3409        1.1 s
    lsq 4 rounds          0.3277 / 0.3268        0.3279 / 0.3279        1.2 s
    lsq 8 rounds          0.3245 / 0.3236        0.3246 / 0.3246        1.9 s

(the machine was shared and loaded while measuring: ``lsq 4`` on 4096 x 4096 is 0.95 s best of two
on one thread, 0.68 s on two.)

Heavy-tailed weights (Student-t, 3 degrees of freedom, x 0.01; 1024 x 1024, frob / out): minmax
0.5498 / 0.5509, hqq 20 0.4739 / 0.4724, hqq 5 + lsq 4 0.3991 / 0.3972, lsq 4 0.4012 / 0.3998,
lsq 8 0.3973 / 0.3958. Not measured on real pretrained weights.

HQQ on the zero point alone gains 2-4% over min-max on Gaussian weights and 14% on heavy-tailed
ones (its L_p step is made for outliers); moving the scale is what pays more: ``lsq`` 4 rounds is 26% under min-max, and HQQ before it adds nothing. Default:
``lsq``, 4 rounds (8 rounds buy 1% more for ~50% more time). For Gaussian ``X`` the output error is
the Frobenius error by construction (``E ||X D^T||^2 = rows ||D||_F^2``): measured to check it.
The default fit of a 4096 x 4096 layer takes ~1 s on one CPU thread, not yet "well under a second"
(it is ~20 elementwise passes a round over cache-sized chunks; a fused kernel would do a round in one
pass): on the GPU it runs on the loaded shard, where it is not the bottleneck.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .runtime import interpreter_on, should_use_triton

__all__ = [
    "Q2Weight", "DEFAULT_GROUP_SIZE", "check_group_size", "pack_codes", "unpack_codes", "quantize_q2",
    "dequantize_q2", "dequantize_q2_reference", "AOT_SPECS",
]

DEFAULT_GROUP_SIZE = 64
LEVELS = 4  # 2-bit codes 0..3
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP16_MAX = 65504.0


@dataclass
class Q2Weight:
    """A 2-bit weight: ``codes`` uint8 ``[N, K/4]``, ``scale`` and ``zero`` fp16 ``[N, K/G]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    shape: tuple[int, int]
    group_size: int
    dtype: torch.dtype = torch.float16  # the dtype it was quantised from (default output dtype)

    def __post_init__(self) -> None:
        check_q2(self)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    def to(self, device: Any) -> "Q2Weight":
        return Q2Weight(self.codes.to(device), self.scale.to(device), self.zero.to(device), self.shape,
                        self.group_size, self.dtype)


def check_group_size(group_size: Any, in_features: int | None = None) -> int:
    """The group size as an int, or a ValueError that says what to pass."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"Q2 group_size must be an int (a power of two >= 16, e.g. 64), got {group_size!r}.")
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(
            f"Q2 group_size must be a power of two >= 16 (16, 32, 64, 128, ...), got {group_size}: the kernels "
            "tile a group with tl.arange and need >= 16 columns for tl.dot."
        )
    if in_features is not None and in_features % group_size:
        raise ValueError(
            f"Q2 group_size {group_size} does not divide in_features {in_features}: groups must not straddle rows. "
            f"Pick a group size that divides it (the largest power of two that does is "
            f"{in_features & -in_features if in_features else 0}), or keep this layer in 16-bit."
        )
    return group_size


def check_q2(q: Q2Weight) -> None:
    """Raise ValueError when the parts of a Q2 weight do not belong together."""
    if len(q.shape) != 2:
        raise ValueError(f"A Q2 weight is a matrix [out_features, in_features], got shape {q.shape}.")
    n, k = (int(s) for s in q.shape)
    g = check_group_size(q.group_size, k)
    if q.codes.dtype != torch.uint8 or tuple(q.codes.shape) != (n, k // 4):
        raise ValueError(f"Q2 codes must be uint8 [{n}, {k // 4}], got {q.codes.dtype} {tuple(q.codes.shape)}.")
    for name, t in (("scale", q.scale), ("zero", q.zero)):
        if t.dtype != torch.float16 or tuple(t.shape) != (n, k // g):
            raise ValueError(f"Q2 {name} must be float16 [{n}, {k // g}], got {t.dtype} {tuple(t.shape)}.")
        if t.device != q.codes.device:
            raise ValueError(f"Q2 {name} is on {t.device} but the codes are on {q.codes.device}: move them together.")


# --------------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------------


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Integer codes 0..3 ``[N, K]`` (K % 4 == 0) -> uint8 ``[N, K/4]``, column ``4j + t`` in bits ``2t``."""
    if codes.dim() != 2 or codes.shape[1] % 4:
        raise ValueError(f"pack_codes takes [N, K] codes with K a multiple of 4, got {tuple(codes.shape)}.")
    c = codes.to(torch.uint8).reshape(codes.shape[0], -1, 4)
    if (c > 3).any():
        raise ValueError("pack_codes: 2-bit codes must be in 0..3.")
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/4]`` -> uint8 codes ``[N, K]`` (inverse of :func:`pack_codes`)."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 3).reshape(packed.shape[0], -1)


# --------------------------------------------------------------------------------------------------
# Quantiser
# --------------------------------------------------------------------------------------------------


def _codes(wg: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(wg / s + z), 0, LEVELS - 1)


def _safe(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s > 0, s, torch.ones_like(s))


def _sq_err(wg, q, s, z) -> torch.Tensor:
    return ((q - z) * s - wg).square().sum(-1, keepdim=True)


def _minmax(wg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    s = torch.where(hi > lo, (hi - lo) / (LEVELS - 1), lo.abs())  # constant group: code 0 is its value
    z = -lo / _safe(s)
    return s, z


def _hqq(wg, s, z, iters: int, p: float, beta: float, kappa: float):
    """HQQ rounds on the zero point (scale fixed), in step units; keeps the best round per group."""
    s_ = _safe(s)
    ws = wg / s_
    q = _codes(wg, s_, z)
    best_z, best_err = z, _sq_err(wg, q, s, z)
    for _ in range(iters):
        e = ws - (q - z)
        a = e.abs()
        e = torch.sign(e) * torch.relu(a - a.clamp_min(1e-12).pow(p - 1) / beta)
        z = (q - ws + e).mean(-1, keepdim=True)
        beta *= kappa
        q = _codes(wg, s_, z)
        err = _sq_err(wg, q, s, z)
        better = err < best_err
        best_z, best_err = torch.where(better, z, best_z), torch.where(better, err, best_err)
    return s, best_z


def _refit(wg, s, z, rounds: int = 2):
    """Least-squares ``(scale, zero)`` for the codes of the current fit (``w ~ a q + b``), codes
    reassigned after each round; a group keeps its previous fit where the refit is not better."""
    q = _codes(wg, _safe(s), z)
    err = _sq_err(wg, q, s, z)
    wm = wg.mean(-1, keepdim=True)
    wc = wg - wm
    for _ in range(rounds):
        qm = q.mean(-1, keepdim=True)
        qc = q - qm
        var = (qc * qc).mean(-1, keepdim=True)
        cov = (qc * wc).mean(-1, keepdim=True)
        ok = var > 0
        a = cov / torch.where(ok, var, torch.ones_like(var))
        ok = ok & (a > 0)
        s_new = torch.where(ok, a, s)
        z_new = torch.where(ok, (a * qm - wm) / _safe(a), z)
        q_new = _codes(wg, _safe(s_new), z_new)
        err_new = _sq_err(wg, q_new, s_new, z_new)
        better = err_new < err
        s, z, err = torch.where(better, s_new, s), torch.where(better, z_new, z), torch.minimum(err, err_new)
        q = torch.where(better, q_new, q)
    return s, z


def _round_params(wg, s, z):
    """Round ``(scale, zero)`` to fp16 as stored, then refit ``zero`` to the rounded scale."""
    s16 = s.to(torch.float16).float()
    s_ = _safe(s16)
    q = _codes(wg, s_, z)
    z = torch.where(s16 > 0, (q - wg / s_).mean(-1, keepdim=True), z)
    return s16, z.to(torch.float16).float()


_METHODS = {"minmax": 0, "hqq": 20, "lsq": 4}  # method -> default rounds
_CHUNK = 1 << 19  # weights fitted at a time: ~2 MB of fp32, so the fit's passes stay in cache (10x faster)


def _fit(wg, method: str, iters: int, lsq_after: int, p: float, beta: float, kappa: float):
    s, z = _minmax(wg)
    if method == "hqq" and iters > 0:
        s, z = _hqq(wg, s, z, iters, p, beta, kappa)
    rounds = iters if method == "lsq" else lsq_after
    if rounds > 0:
        s, z = _refit(wg, s, z, rounds)
    s, z = _round_params(wg, s, z)
    return _codes(wg, _safe(s), z), s, z


def quantize_q2(
    weight: torch.Tensor,
    group_size: int = DEFAULT_GROUP_SIZE,
    *,
    method: str = "lsq",
    iters: int | None = None,
    p: float = 0.7,
    beta: float = 10.0,
    kappa: float = 1.01,
    _lsq_after: int = 0,
) -> Q2Weight:
    """Quantise a 16/32-bit weight ``[out, in]`` to :class:`Q2Weight` (see the module docstring).

    Args:
        weight: float16 / bfloat16 / float32 ``[N, K]``, ``K`` a multiple of ``group_size``; any device
            (the fit runs in fp32 where the weight is, ``2^19`` weights at a time).
        group_size: columns per (scale, zero) pair: a power of two >= 16 dividing ``K``.
        method: ``"lsq"`` (default: min-max, then alternating least-squares rounds of scale and zero),
            ``"hqq"`` (min-max, then half-quadratic rounds on the zero point) or ``"minmax"``.
        iters: rounds of the method (default 4 for ``"lsq"``, 20 for ``"hqq"``).
        p, beta, kappa: HQQ's L_p exponent, shrinkage weight (in step units) and its growth per round.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"quantize_q2 takes a 2-D weight [out_features, in_features], got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}.")
    if weight.dtype not in _IN_DTYPES:
        raise ValueError(f"quantize_q2 takes a float16, bfloat16 or float32 weight, got {weight.dtype} "
                         "(dequantise a quantised checkpoint to 16-bit first).")
    if method not in _METHODS:
        raise ValueError(f"quantize_q2 method must be one of {sorted(_METHODS)}, got {method!r}.")
    iters = _METHODS[method] if iters is None else int(iters)
    n, k = weight.shape
    g = check_group_size(group_size, k)
    w = weight.detach()
    if not torch.isfinite(w).all() or w.abs().max().item() > _FP16_MAX:
        raise ValueError("quantize_q2: the weight has NaN/Inf or values beyond float16's range (65504); "
                         "its scales cannot be stored in float16.")
    codes = torch.empty((n, k // 4), dtype=torch.uint8, device=w.device)
    scale = torch.empty((n, k // g), dtype=torch.float16, device=w.device)
    zero = torch.empty_like(scale)
    step = max(1, _CHUNK // max(k, 1))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        wg = w[r0:r1].float().reshape(r1 - r0, k // g, g)
        q, s, z = _fit(wg, method, iters, _lsq_after, p, beta, kappa)
        codes[r0:r1] = pack_codes(q.to(torch.uint8).reshape(r1 - r0, k))
        scale[r0:r1] = s.reshape(r1 - r0, k // g)
        zero[r0:r1] = z.reshape(r1 - r0, k // g)
    return Q2Weight(codes, scale, zero, (n, k), g, weight.dtype)


# --------------------------------------------------------------------------------------------------
# Reference (plain PyTorch, the CPU path and the test oracle)
# --------------------------------------------------------------------------------------------------


def _resolve_out(q: Q2Weight, out_dtype: torch.dtype | None, out: torch.Tensor | None):
    if out is not None:
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out has dtype {out.dtype} but out_dtype={out_dtype} was asked for.")
        out_dtype = out.dtype
        if tuple(out.shape) != tuple(q.shape) or not out.is_contiguous() or out.device != q.device:
            raise ValueError(f"out must be a contiguous {tuple(q.shape)} tensor on {q.device}, "
                             f"got {tuple(out.shape)} on {out.device}.")
    out_dtype = out_dtype or q.dtype
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"Q2 dequantisation writes float16, bfloat16 or float32, not {out_dtype}.")
    if out is None:
        out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    return out, out_dtype


def dequantize_q2_reference(q: Q2Weight, out_dtype: torch.dtype | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch Q2 dequantisation (same arguments and bits as :func:`dequantize_q2`)."""
    check_q2(q)
    out, out_dtype = _resolve_out(q, out_dtype, out)
    n, k = q.shape
    g = q.group_size
    codes = unpack_codes(q.codes).float().reshape(n, k // g, g)
    w = (codes - q.zero.float().unsqueeze(-1)) * q.scale.float().unsqueeze(-1)
    out.copy_(w.reshape(n, k).to(out_dtype))
    return out


# --------------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------------


@triton.jit
def q2_decode_tile(codes_ptr, scale_ptr, zero_ptr, rows, row_ok, k0, K, GROUP: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """fp32 ``[R, BLOCK_K]`` of rows ``rows`` (int64), columns ``k0 .. k0 + BLOCK_K`` of a Q2 weight
    with ``K`` columns; ``BLOCK_K`` divides ``GROUP`` (one group per row in the tile). Rows not
    ``row_ok`` read as 0."""
    QK: tl.constexpr = BLOCK_K // 4
    byte = tl.load(codes_ptr + rows[:, None] * (K // 4) + (k0 // 4 + tl.arange(0, QK))[None, :],
                   mask=row_ok[:, None], other=0).to(tl.int32)
    grp = rows * (K // GROUP) + k0 // GROUP
    s = tl.load(scale_ptr + grp, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    z = tl.load(zero_ptr + grp, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    w0 = ((byte & 3).to(tl.float32) - z) * s
    w1 = (((byte >> 2) & 3).to(tl.float32) - z) * s
    w2 = (((byte >> 4) & 3).to(tl.float32) - z) * s
    w3 = (((byte >> 6) & 3).to(tl.float32) - z) * s
    # join(join(w0, w2), join(w1, w3)) is [R, QK, 2, 2] in the order w0, w1, w2, w3 along the last two
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (rows.shape[0], BLOCK_K))


@triton.jit
def _q2_dequant_kernel(
    codes_ptr, scale_ptr, zero_ptr,  # the Q2 weight: *u8 [N, K/4] codes, *fp16 [N, K/G] scale and zero
    out_ptr,  # *fp16 / *bf16 / *fp32 [N, K] (int16 bits when BF16_BITS)
    N, K,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16_BITS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    row_ok = rows < N
    vals = q2_decode_tile(codes_ptr, scale_ptr, zero_ptr, rows, row_ok, k0, K, GROUP, BLOCK_K)
    offs = rows[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :]
    if BF16_BITS:
        bits = vals.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(out_ptr + offs, bits.to(tl.int16), mask=row_ok[:, None])
    else:
        tl.store(out_ptr + offs, vals.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _launch_config(group_size: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): a tile of 4096 outputs, BLOCK_K dividing the group."""
    block_k = min(group_size, 128)
    return 4096 // block_k, block_k, 4


def dequantize_q2(q: Q2Weight, out_dtype: torch.dtype | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantise a :class:`Q2Weight` to a dense ``[N, K]`` fp16 / bf16 / fp32 tensor:
    ``(code - zero) * scale`` in fp32, rounded once (default dtype: the one it was quantised from).

    CUDA tensors run the Triton kernel; CPU tensors run :func:`dequantize_q2_reference` unless
    Triton is forced (``runtime.use_triton(True)`` with ``TRITON_INTERPRET=1``)."""
    if not should_use_triton(q.codes):
        return dequantize_q2_reference(q, out_dtype, out)
    check_q2(q)
    out, out_dtype = _resolve_out(q, out_dtype, out)
    n, k = q.shape
    if n == 0:
        return out
    block_n, block_k, num_warps = _launch_config(q.group_size)
    bf16_bits = out_dtype == torch.bfloat16 and interpreter_on() and not q.codes.is_cuda
    grid = (triton.cdiv(n, block_n), k // block_k)
    _q2_dequant_kernel[grid](
        q.codes, q.scale, q.zero, out.view(torch.int16) if bf16_bits else out, n, k,
        GROUP=q.group_size, BLOCK_N=block_n, BLOCK_K=block_k, BF16_BITS=bf16_bits, num_warps=num_warps,
    )
    return out


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py, e.g. for sm_75)
# --------------------------------------------------------------------------------------------------


def _aot_specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    specs = []
    for out_ty in ("fp16", "bf16"):
        block_n, block_k, num_warps = _launch_config(DEFAULT_GROUP_SIZE)
        signature = {"codes_ptr": "*u8", "scale_ptr": "*fp16", "zero_ptr": "*fp16", "out_ptr": f"*{out_ty}",
                     "N": "i32", "K": "i32"}
        constexprs = {"GROUP": DEFAULT_GROUP_SIZE, "BLOCK_N": block_n, "BLOCK_K": block_k, "BF16_BITS": False}
        specs.append((_q2_dequant_kernel, signature, constexprs, {"num_warps": num_warps}))
    return specs


AOT_SPECS = _aot_specs()


# --------------------------------------------------------------------------------------------------
# Measurement behind the defaults (``python -m notebookkit.kernels.q2``)
# --------------------------------------------------------------------------------------------------


def _measure(shapes=((1024, 1024), (4096, 4096)), rows: int = 256, seed: int = 0) -> None:
    import time

    torch.set_num_threads(1)
    settings = [
        ("minmax", dict(method="minmax")),
        ("hqq 5 it", dict(method="hqq", iters=5)),
        ("hqq 20 it", dict(method="hqq", iters=20)),
        ("hqq 20 it beta=1", dict(method="hqq", iters=20, beta=1.0)),
        ("hqq 20 it p=1", dict(method="hqq", iters=20, p=1.0)),
        ("hqq 5 it + lsq 4", dict(method="hqq", iters=5, _lsq_after=4)),
        ("lsq 2", dict(method="lsq", iters=2)),
        ("lsq 4", dict(method="lsq", iters=4)),
        ("lsq 8", dict(method="lsq", iters=8)),
    ]
    for n, k in shapes:
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(n, k, generator=g) * 0.02
        x = torch.randn(rows, k, generator=g)
        y = x @ w.t()
        for name, kw in settings:
            t0 = time.perf_counter()
            q = quantize_q2(w, **kw)
            dt = time.perf_counter() - t0
            wh = dequantize_q2_reference(q, torch.float32)
            frob = ((w - wh).norm() / w.norm()).item()
            outerr = ((y - x @ wh.t()).norm() / y.norm()).item()
            print(f"{n}x{k}  {name:22s} frob {frob:.4f}  out {outerr:.4f}  {dt:.2f} s", flush=True)


if __name__ == "__main__":
    _measure()
