"""FP8 (e4m3) matmul with rowwise scales, for the frozen base-weight GEMM of a LoRA forward pass.

For ``X [N, K]`` (tokens) and a frozen base weight ``W [O, K]``, each row ``z`` of ``X`` (one token)
and of ``W`` (one output channel) is quantised with its own fp32 scale (``FP8_MAX = 448``, the
largest finite ``float8_e4m3fn``)::

    scale(z) = max(max_k |z_k|, AMAX_FLOOR) * fp32(1 / FP8_MAX)                fp32, > 0
    q(z)     = round_e4m3(clamp(z * fp32(1 / scale(z)), -FP8_MAX, FP8_MAX))  float8_e4m3fn

    forward  Y = diag(s_x) (Q_x Q_w^T) diag(s_w)    i.e.  Y[n, o] = s_x[n] s_w[o] sum_k q_x[n, k] q_w[o, k]

returned in ``X``'s dtype. ``torch._scaled_mm`` runs it on FP8 tensor cores (Ada/Hopper: about
twice the bf16 throughput), with the tensor cores' fast accumulation (``USE_FAST_ACCUM``). Where ``_scaled_mm`` cannot run (a
dimension that is not a multiple of 16, a GPU older than sm_89, another device), the same
quantised product is emulated: ``(Q_x s_x) (Q_w s_w)^T`` in fp32, cast to ``X``'s dtype.

There is no backward here: the LoRA autograd functions use this op for the base part of their
forward only (and of the checkpointing recompute); their backward (``dX = dY W + U A`` and the
adapter gradients) is unchanged and stays in the 16-bit compute dtype with the dequantised ``W``.

Error: ``round_e4m3`` keeps 3 mantissa bits, a relative rounding error of at most ``2^-4`` per
element (normal range; values below ``2^-6 * scale`` are subnormal and have an absolute error of at
most ``2^-10 * scale``). See ``tests/kernels/test_fp8_matmul.py`` for the bound on ``Y``.

Quantisation: a Triton kernel (one program per row; a row of up to 16K elements is read once and
kept in registers: one read of the 16-bit row, one write of fp8 bytes) on CUDA, or under
``use_triton(True)`` with the interpreter; :func:`quantize_rowwise_fp8_reference` (plain PyTorch,
fp32) on CPU. On a GPU the hardware conversion rounds to e4m3 (RTNE); under the interpreter the
kernel rounds explicitly (integer RTNE on the fp32 bits, then an exact cast), because the Triton 3.9
interpreter's own conversion drops the carry into the exponent (31.8 becomes 16, not 32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from notebookkit.kernels.runtime import should_use_triton

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "AMAX_FLOOR",
    "fp8_supported",
    "quantize_rowwise_fp8",
    "quantize_rowwise_fp8_reference",
    "fp8_linear",
    "fp8_linear_reference",
    "fp8_matmul_quantized",
    "scaled_mm_applies",
    "scaled_mm_applies_to",
    "check_fp8_out",
    "USE_FAST_ACCUM",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Floor of a row's amax: an all-zero row gets scale AMAX_FLOOR / 448 (a normal fp32 number, so no
# 0/0 and no denormal that a flush-to-zero GPU would turn into 0) and quantises to zeros.
AMAX_FLOOR = 1e-12
# The scale multiplies by the fp32 reciprocal of 448 (what PyTorch's CUDA kernels do for a division
# by a scalar), so the Triton kernel, PyTorch on CPU and PyTorch on CUDA give the same bits.
INV_FP8_MAX = 1.0 / FP8_MAX
_MIN_CAPABILITY = (8, 9)
# torch._scaled_mm's use_fast_accum: on Hopper the tensor cores then accumulate the whole K sum in
# their own reduced-precision accumulator instead of promoting partial sums to fp32 (the faster
# cuBLAS kernels). As in common FP8 training recipes, the forward product uses it (its error stays
# below the e4m3 rounding of the operands); set False for exact fp32 accumulation.
USE_FAST_ACCUM = True


# --------------------------------------------------------------------------------------------------
# Support
# --------------------------------------------------------------------------------------------------


def fp8_supported(device: torch.device | str | int | None = None) -> tuple[bool, str]:
    """Whether the FP8 forward can run on ``device``, and why (a sentence for the notebook).

    CUDA needs compute capability 8.9 or newer (Ada: L4, RTX 4090, L40S; Hopper: H100, H200;
    Blackwell): older GPUs (a T4 is sm_75, an A100 sm_80) have no FP8 tensor cores. CPU is allowed:
    the same math is emulated in fp32 (correct, not faster; meant for tests).
    """
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return False, (
            f"this PyTorch ({torch.__version__}) has no float8_e4m3fn / torch._scaled_mm; "
            "upgrade PyTorch (2.5 or newer) or turn the FP8 forward off."
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type == "cpu":
        return True, "CPU: the FP8 product is emulated in fp32 (same numbers as on a GPU, no speed-up)."
    if device.type != "cuda":
        return False, (
            f"the FP8 forward runs on NVIDIA GPUs (compute capability 8.9+) and, emulated, on CPU; "
            f"not on {device.type!r}. Turn it off on this device."
        )
    if not torch.cuda.is_available():
        return False, "CUDA is not available in this runtime, so there is no GPU to run FP8 matmuls on."
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    name = torch.cuda.get_device_name(index)
    if (major, minor) < _MIN_CAPABILITY:
        return False, (
            f"{name} (sm_{major}{minor}) has no FP8 tensor cores: FP8 matmuls need compute capability "
            f"8.9 or newer (L4, RTX 4090, L40S, H100, H200). Leave the FP8 forward off on this GPU; "
            f"the 16-bit base matmuls are the fastest path here."
        )
    return True, f"{name} (sm_{major}{minor}) has FP8 tensor cores."


def scaled_mm_applies(x2d: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``torch._scaled_mm`` can run ``x2d [N, K] @ weight[O, K]^T`` (else: emulation).

    ``_scaled_mm`` wants ``K`` and ``O`` multiples of 16 (cuBLAS/CUTLASS FP8 alignment; ``N`` is
    free), an FP8-capable GPU (sm_89+) or the CPU. The CPU kernel takes any shape, but the rule is
    the same everywhere so that a shape runs the same path on every device.
    """
    return scaled_mm_applies_to(x2d, weight.shape[0])


def scaled_mm_applies_to(x2d: torch.Tensor, out_features: int) -> bool:
    """:func:`scaled_mm_applies` for a weight of ``out_features`` rows (e.g. a packed NF4 weight,
    whose tensor shape is not ``[O, K]``)."""
    K, O = x2d.shape[1], int(out_features)
    if K % 16 or O % 16 or K == 0 or O == 0 or x2d.shape[0] == 0:
        return False
    if x2d.device.type == "cpu":
        return True
    if x2d.device.type == "cuda":
        return torch.cuda.get_device_capability(x2d.device) >= _MIN_CAPABILITY
    return False


# --------------------------------------------------------------------------------------------------
# Triton kernel: rowwise quantisation
# --------------------------------------------------------------------------------------------------


@triton.jit
def to_e4m3(v, FP8_TY: tl.constexpr, EXPLICIT_ROUNDING: tl.constexpr):
    """fp32 ``v`` (already clamped to +-448) -> float8_e4m3fn, round-to-nearest-even.

    On a GPU the hardware conversion rounds (RTNE, as PyTorch's cast). Under the interpreter the
    value is first rounded in fp32, so that the cast is exact: normal range (|v| >= 2^-6): RTNE on
    the fp32 bits keeping 3 mantissa bits (a carry correctly bumps the exponent); subnormal range
    (spacing 2^-9): adding 1.5 * 2^14, whose fp32 ulp is 2^-9, rounds. The sign is put back after,
    so that a tiny negative value gives -0 as in torch.
    """
    if EXPLICIT_ROUNDING:
        v_bits = v.to(tl.int32, bitcast=True)
        bits = (v_bits + (0x7FFFF + ((v_bits >> 20) & 1))) & -1048576  # -1048576 == ~0xFFFFF
        normal = bits.to(tl.float32, bitcast=True)
        sub = (tl.abs(v) + 24576.0) - 24576.0
        sub = tl.where(v_bits < 0, -sub, sub)
        v = tl.where(tl.abs(v) >= 0.015625, normal, sub)
    return v.to(FP8_TY)


@triton.jit
def row_scale(amax, nan_count, FLOOR: tl.constexpr, INV_MAX: tl.constexpr):
    """``max(amax, FLOOR) * fp32(1/448)``; NaN when the row holds a NaN (as torch.amax)."""
    scale = tl.maximum(amax, FLOOR) * INV_MAX
    return tl.where(nan_count > 0, float("nan"), scale)


@triton.jit
def _quantize_rowwise_kernel(X, Q, S, K, stride_x, stride_q, FLOOR: tl.constexpr, INV_MAX: tl.constexpr,
                             BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, EXPLICIT_ROUNDING: tl.constexpr):
    # one program per row; ONE_PASS (K <= BLOCK_K): the row is read once and kept in registers,
    # else an amax pass and a quantise pass over BLOCK_K chunks.
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    q_row = Q + row * stride_q
    if ONE_PASS:
        offs = tl.arange(0, BLOCK_K)
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(x), axis=0), tl.sum((x != x).to(tl.int32), axis=0), FLOOR, INV_MAX)
        tl.store(S + row, scale)
        v = tl.clamp(x * tl.math.div_rn(1.0, scale), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_row + offs, to_e4m3(v, Q.dtype.element_ty, EXPLICIT_ROUNDING), mask=mask)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        nans = tl.zeros([BLOCK_K], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
            nans += (x != x).to(tl.int32)
        scale = row_scale(tl.max(amax, axis=0), tl.sum(nans, axis=0), FLOOR, INV_MAX)
        tl.store(S + row, scale)
        inv_scale = tl.math.div_rn(1.0, scale)  # IEEE 1 / scale, once per row
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            mask = offs < K
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            v = tl.clamp(x * inv_scale, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
            tl.store(q_row + offs, to_e4m3(v, Q.dtype.element_ty, EXPLICIT_ROUNDING), mask=mask)


# Rows up to this many elements are quantised in one pass (read once, kept in registers).
ONE_PASS_MAX_K = 16384
# Explicit fp32 rounding before the cast: off on GPUs (hardware RTNE). The interpreter always
# rounds explicitly (its own fp32 -> fp8 conversion drops the carry into the exponent).
GPU_EXPLICIT_ROUNDING = False


def _launch_config(K: int) -> tuple[int, bool, int]:
    """(BLOCK_K, one pass?, num_warps) for rows of ``K`` elements."""
    if K <= ONE_PASS_MAX_K:
        block = max(16, triton.next_power_of_2(K))
        return block, True, 4 if block <= 2048 else (8 if block <= 8192 else 16)
    return 4096, False, 8


def _quantize_triton(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    if out is None:
        q = torch.empty((M, K), dtype=FP8_DTYPE, device=x.device)
        scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    else:
        q, scale = out
    if M == 0:
        return q, scale
    block, one_pass, warps = _launch_config(K)
    explicit = GPU_EXPLICIT_ROUNDING if x.is_cuda else True
    _quantize_rowwise_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0), FLOOR=AMAX_FLOOR, INV_MAX=INV_FP8_MAX,
                                   BLOCK_K=block, ONE_PASS=one_pass, EXPLICIT_ROUNDING=explicit, num_warps=warps)
    return q, scale


def check_fp8_out(out: tuple[torch.Tensor, torch.Tensor], rows: int, cols: int, device: torch.device, op: str) -> None:
    """Raise unless ``out = (q, scale)`` can take the rowwise FP8 quantisation of a ``[rows, cols]``
    matrix: ``q`` float8_e4m3fn ``[rows, cols]`` and ``scale`` float32 ``[rows, 1]``, both contiguous
    (a block of whole rows of a larger row-major buffer is) and on ``device``."""
    q, scale = out
    ok = (q.dtype == FP8_DTYPE and tuple(q.shape) == (rows, cols) and q.is_contiguous()
          and scale.dtype == torch.float32 and tuple(scale.shape) == (rows, 1) and scale.is_contiguous()
          and q.device == device and scale.device == device)
    if not ok:
        raise ValueError(
            f"{op}: out must be (q float8_e4m3fn [{rows}, {cols}], scale float32 [{rows}, 1]), both contiguous "
            f"(whole rows of a row-major buffer) on {device}; got q {q.dtype} {tuple(q.shape)} strides "
            f"{q.stride()} on {q.device}, scale {scale.dtype} {tuple(scale.shape)} strides {scale.stride()} "
            f"on {scale.device}."
        )


# --------------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------------


def quantize_rowwise_fp8_reference(
    x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch :func:`quantize_rowwise_fp8` (fp32 math; the CPU path and the test oracle).

    With ``out`` the results are copied into it (an exact copy of the same bits) and ``out`` is returned.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True) if x.shape[1] else xf.new_zeros(x.shape[0], 1)
    scale = amax.clamp_min(AMAX_FLOOR).mul_(INV_FP8_MAX)
    q = (xf * scale.reciprocal()).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    if out is None:
        return q, scale
    out[0].copy_(q)
    out[1].copy_(scale)
    return out


def quantize_rowwise_fp8(
    x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each row of ``x [M, K]`` to FP8 e4m3 with its own scale.

    ``scale = max(amax_row(|x|), 1e-12) * fp32(1/448)`` and ``q = round_e4m3(clamp(x * fp32(1 / scale), ±448))``, in
    fp32, so ``q * scale`` approximates ``x`` to a relative ``2^-4`` per element. A zero row gives
    zeros (no NaN).

    Args:
        x: ``[M, K]``, floating point.
        out: optional ``(q, scale)`` to write into instead of new tensors: ``q`` float8_e4m3fn
            ``[M, K]`` and ``scale`` float32 ``[M, 1]``, contiguous, e.g. the rows ``r0 .. r0 + M`` of
            a larger ``[O_total, K]`` / ``[O_total, 1]`` pair. Each row is quantised on its own, so
            the bits are those of quantising ``x`` alone (this is how a group of projections reading
            one input puts its weights into one FP8 buffer for one ``_scaled_mm``).

    Returns:
        ``(q, scale)``: ``q`` is ``float8_e4m3fn [M, K]`` (row-major), ``scale`` is ``float32 [M, 1]``
        (positive); ``out`` itself when given.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_rowwise_fp8 expects a [rows, cols] matrix, got shape {tuple(x.shape)}.")
    if not x.is_floating_point():
        raise ValueError(f"quantize_rowwise_fp8 expects a floating-point tensor, got {x.dtype}.")
    if out is not None:
        check_fp8_out(out, x.shape[0], x.shape[1], x.device, "quantize_rowwise_fp8")
    if x.shape[1] and should_use_triton(x):
        return _quantize_triton(x, out)
    return quantize_rowwise_fp8_reference(x, out)


def _emulated_product(qx, sx, qw, sw, dtype: torch.dtype) -> torch.Tensor:
    return ((qx.float() * sx) @ (qw.float() * sw).t()).to(dtype)


def fp8_linear_reference(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Emulated :func:`fp8_linear`: quantise with the reference, multiply in fp32, cast to ``x2d.dtype``."""
    qx, sx = quantize_rowwise_fp8_reference(x2d)
    qw, sw = quantize_rowwise_fp8_reference(weight)
    return _emulated_product(qx, sx, qw, sw, x2d.dtype)


def fp8_linear(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x2d @ weight.T`` with both operands quantised to FP8 e4m3, rowwise (per token, per output).

    Args:
        x2d: activations ``[N, K]`` (fp32, fp16 or bf16).
        weight: the dense base weight ``[O, K]`` (any floating dtype; an NF4 weight must be
            dequantised first).

    Returns:
        ``[N, O]`` in ``x2d.dtype``. Runs ``torch._scaled_mm`` (FP8 tensor cores on sm_89+, PyTorch's
        kernel on CPU) when ``K`` and ``O`` are multiples of 16, else the same quantised product
        emulated in fp32. No autograd. (The LoRA forward calls :func:`fp8_matmul_quantized`
        directly, so that an input read by several projections is quantised once.)
    """
    if x2d.dim() != 2 or weight.dim() != 2 or x2d.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fp8_linear needs x [N, K] and weight [O, K] with the same K; got {tuple(x2d.shape)} and "
            f"{tuple(weight.shape)}."
        )
    N, K = x2d.shape
    O = weight.shape[0]
    if N == 0 or K == 0 or O == 0:
        return x2d.new_zeros(N, O)
    return fp8_matmul_quantized(quantize_rowwise_fp8(x2d), quantize_rowwise_fp8(weight), x2d.dtype)


def fp8_matmul_quantized(
    x_q: tuple[torch.Tensor, torch.Tensor], w_q: tuple[torch.Tensor, torch.Tensor], out_dtype: torch.dtype
) -> torch.Tensor:
    """``diag(s_x) (Q_x Q_w^T) diag(s_w)`` in ``out_dtype`` from already quantised operands.

    ``x_q = (Q_x [N, K], s_x [N, 1])`` and ``w_q = (Q_w [O, K], s_w [O, 1])`` as returned by
    :func:`quantize_rowwise_fp8` (or :func:`notebookkit.kernels.nf4_fp8.quantize_nf4_rowwise_fp8`).
    ``torch._scaled_mm`` where it applies, else the same product emulated in fp32.
    """
    qx, sx = x_q
    qw, sw = w_q
    if not scaled_mm_applies(qx, qw):
        return _emulated_product(qx, sx, qw, sw, out_dtype)
    # Rowwise _scaled_mm on CUDA: mat1 row-major, mat2 column-major (qw.t() of a row-major [O, K]),
    # fp32 scales [N, 1] and [1, O]; bf16 is the output dtype every FP8-capable build supports, so
    # other dtypes take bf16 and are cast (a 2^-9 rounding, far below the FP8 error).
    mm_dtype = out_dtype if (qx.device.type == "cpu" or out_dtype == torch.bfloat16) else torch.bfloat16
    y = torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.t(), out_dtype=mm_dtype, use_fast_accum=USE_FAST_ACCUM)
    return y if y.dtype == out_dtype else y.to(out_dtype)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py): (kernel, signature, constexprs, options)
# FP8 needs sm_89+, so the specs target Hopper only (the flag is refused on a T4).
# --------------------------------------------------------------------------------------------------
def _aot_specs() -> list:
    def spec(dt):
        signature = {"X": f"*{dt}", "Q": "*fp8e4nv", "S": "*fp32", "K": "i32", "stride_x": "i32", "stride_q": "i32"}
        return (_quantize_rowwise_kernel, signature, {"FLOOR": AMAX_FLOOR, "INV_MAX": INV_FP8_MAX, "BLOCK_K": 4096, "ONE_PASS": True,
                 "EXPLICIT_ROUNDING": False},
                {"num_warps": 8, "targets": [90]})

    return [spec("bf16"), spec("fp16"), spec("fp32")]


AOT_SPECS = _aot_specs()
