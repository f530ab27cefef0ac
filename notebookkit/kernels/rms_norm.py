"""RMSNorm, fused forward and backward (the Llama, Gemma and gpt-oss flavours).

Math, per row ``x`` of length ``N`` (all reductions in fp32)::

    rstd = 1 / sqrt(mean(x**2) + eps)            one fp32 value per row, saved for backward
    n    = x * rstd                              fp32

    Llama (HF ``LlamaRMSNorm``, also Mistral/Qwen2/Qwen3 and Qwen3/Gemma3 q/k norms):
        y = cast(n, x.dtype) * w                 the cast happens *before* the weight multiply
    Gemma (HF ``GemmaRMSNorm``, ``flavour="gemma"``):
        y = cast(n * (1 + w), x.dtype)           everything in fp32, one cast at the end
    gpt-oss (HF ``GptOssRMSNorm``, ``flavour="gpt_oss"``; its norm weights are kept in fp32):
        y = cast(n * w, x.dtype)                 the weight multiply in fp32, one cast at the end

Backward, with ``a = w`` (Llama, gpt-oss) or ``a = 1 + w`` (Gemma) and ``dn = dy * a``::

    dx = rstd * (dn - n * mean(dn * n))          per row
    dw = sum_rows(dy * cast(n, x.dtype))         Llama
    dw = sum_rows(dy * n)                        Gemma, gpt-oss

``dw`` is only computed when the weight requires grad: each program of the backward kernel walks a
strided set of row tiles, keeps an fp32 partial sum of ``dw`` in registers and writes it to one row of
an ``[programs, N]`` fp32 buffer that is summed at the end. ``dx`` can be written into ``dy``'s
buffer (``inplace_backward=True``) so the backward allocates nothing activation-sized.

The normalised dimension is the last one; any leading dims are rows, so the same op serves the
hidden-state norms (``[B, T, hidden]``) and per-head q/k norms (``[B, T, H, head_dim]``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from notebookkit.kernels.runtime import mark_written, should_use_triton

__all__ = ["NORM_FLAVOURS", "rms_norm", "rms_norm_reference", "rms_norm_forward", "rms_norm_backward",
           "flavour_flags", "normed_dtype"]

_MAX_COLS = 65536

# How each flavour meets the weight (module docstring): the kernels' (CAST_FIRST, UNIT_OFFSET)
NORM_FLAVOURS = {"llama": (True, False), "gemma": (False, True), "gpt_oss": (False, False)}


def flavour_flags(flavour: str) -> dict:
    """The kernels' constexprs of an RMSNorm ``flavour`` (a key of :data:`NORM_FLAVOURS`)."""
    if flavour not in NORM_FLAVOURS:
        raise ValueError(f"rms_norm: unknown flavour {flavour!r}; choose one of {sorted(NORM_FLAVOURS)}.")
    cast_first, unit_offset = NORM_FLAVOURS[flavour]
    return {"CAST_FIRST": cast_first, "UNIT_OFFSET": unit_offset}


def normed_dtype(x_dtype: torch.dtype, weight_dtype: torch.dtype, flavour: str) -> torch.dtype:
    """The output dtype, as Hugging Face's modules give it: Llama's ``cast(n) * w`` promotes to the weight's
    dtype; the other flavours cast once at the end, to ``x``'s."""
    return torch.promote_types(x_dtype, weight_dtype) if flavour_flags(flavour)["CAST_FIRST"] else x_dtype


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD,
    n_rows, n_cols, stride_x, stride_y, eps,
    CAST_FIRST: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)

    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y, rstd = normalized_rows(x, W, cols, n_cols, eps, CAST_FIRST, UNIT_OFFSET, X.dtype.element_ty)
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def normalized_rows(x, W, cols, n_cols, eps, CAST_FIRST: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                    x_dtype: tl.constexpr):
    """``(y, rstd)`` of the module docstring's forward for fp32 rows ``x`` ``[BLOCK_M, BLOCK_N]`` (masked columns
    zero) whose input dtype is ``x_dtype``; also the norm half of :mod:`.add_rms_norm`."""
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w = w + 1.0
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    n = x * rstd[:, None]
    if CAST_FIRST:
        y = n.to(x_dtype).to(tl.float32) * w[None, :]
    else:
        y = n * w[None, :]
    return y, rstd


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,
    n_rows, n_cols, n_tiles, stride_dy, stride_x, stride_dx,
    CAST_FIRST: tl.constexpr, UNIT_OFFSET: tl.constexpr, COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w = w + 1.0
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)

    # NUM_STAGES > 1 lets the compiler prefetch the next tile's dy/x while this one is reduced.
    for tile in tl.range(pid, n_tiles, n_progs, num_stages=NUM_STAGES):
        rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64 offsets below
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        n = x * rstd[:, None]
        if COMPUTE_DW:
            if CAST_FIRST:
                dw_acc += tl.sum(dy * n.to(X.dtype.element_ty).to(tl.float32), axis=0)
            else:
                dw_acc += tl.sum(dy * n, axis=0)
        if COMPUTE_DX:
            dn = dy * w[None, :]
            proj = tl.sum(dn * n, axis=1) / n_cols
            dx = (dn - n * proj[:, None]) * rstd[:, None]
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=col_ok)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------
def row_tiles(n_rows: int, n_cols: int, op: str = "rms_norm") -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of a row-wise norm kernel (this one, ``add_rms_norm``'s): a whole row
    per tile, ~4K elements per program. ``op`` names the caller in the error for too wide a row."""
    if n_cols > _MAX_COLS:
        raise ValueError(
            f"{op}: the normalised dimension has {n_cols} elements; the fused kernel keeps a whole "
            f"row in registers and supports at most {_MAX_COLS}. Use {op}_reference for wider rows."
        )
    block_n = triton.next_power_of_2(n_cols)
    block_m = max(1, min(4096 // block_n, triton.next_power_of_2(max(n_rows, 1))))
    tile = block_m * block_n
    num_warps = 1 if tile <= 256 else 2 if tile <= 1024 else 4 if tile <= 2048 else 8 if tile <= 8192 else 16
    return block_m, block_n, num_warps


# Backward launch shape, from a sweep on an H200 (benchmarks/tune_rms_norm.py, bf16):
# * dw reduced (trainable weight): each program keeps one fp32 partial row of dw, so fewer, fatter
#   programs win: tiles of 8K elements, 8 programs per SM (16 for narrow q/k-norm rows). 8192 x 4096:
#   0.080 -> 0.070 ms; 262144 x 128: 0.116 -> 0.074 ms.
# * frozen weight (LoRA): one tile per program, two pipelining stages: 98% of copy bandwidth.
def _bwd_launch(n_rows: int, n_cols: int, compute_dw: bool, device: torch.device, config: dict | None = None):
    """(BLOCK_M, BLOCK_N, num_warps, n_programs, num_stages) of the backward kernel.

    ``config`` overrides any of ``block_m``, ``num_warps``, ``programs_per_sm``, ``num_stages``
    (used by the tuning sweep only).
    """
    config = config or {}
    block_m, block_n, num_warps = row_tiles(n_rows, n_cols)
    if compute_dw:
        wide = block_n >= 1024
        block_m = max(1, min(8192 // block_n, triton.next_power_of_2(max(n_rows, 1))))
        num_warps, per_sm, stages = (8, 8, 1) if wide else (4, 16, 1)
    else:
        per_sm, stages = 0, 2
    block_m = config.get("block_m", block_m)
    num_warps = config.get("num_warps", num_warps)
    per_sm = config.get("programs_per_sm", per_sm)
    n_tiles = triton.cdiv(n_rows, block_m)
    n_progs = min(n_tiles, per_sm * _sm_count(device)) if compute_dw else n_tiles
    return block_m, block_n, num_warps, n_progs, config.get("num_stages", stages)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # interpreter: programs run one after another, a few are enough


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``[rows, N]`` view with unit column stride (a copy only if needed)."""
    t2 = t.reshape(-1, t.shape[-1])
    if t2.shape[1] > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def rms_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    flavour: str = "llama",
    out: torch.Tensor | None = None,
    rstd: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. Returns ``(y, rstd)``; ``y`` has ``x``'s shape, ``rstd`` is fp32 ``[rows]``.

    ``out``/``rstd`` may be given (any values, e.g. NaN) and are fully overwritten. The output dtype is
    :func:`normed_dtype`'s.
    """
    flags = flavour_flags(flavour)
    n_cols = x.shape[-1]
    x2 = _as_rows(x)
    weight = weight.contiguous()
    n_rows = x2.shape[0]
    if out is None:
        out = torch.empty(x.shape, dtype=normed_dtype(x.dtype, weight.dtype, flavour), device=x.device)
    y2 = out.view(-1, n_cols)
    if rstd is None:
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return out, rstd
    block_m, block_n, num_warps = row_tiles(n_rows, n_cols)
    grid = (triton.cdiv(n_rows, block_m),)
    _rms_norm_fwd_kernel[grid](
        x2, weight, y2, rstd, n_rows, n_cols, x2.stride(0), y2.stride(0), eps,
        **flags, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return out, rstd


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    flavour: str = "llama",
    compute_dx: bool = True,
    compute_dw: bool = True,
    dx_out: torch.Tensor | None = None,
    _config: dict | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward kernel. Returns ``(dx, dw)`` (``None`` for what was not asked).

    ``dx_out`` is where ``dx`` goes (``x``'s shape and dtype, rows with unit column stride); it may be
    ``dy`` itself (each tile reads its ``dy`` rows before writing ``dx``). ``dw`` has ``weight``'s dtype.
    """
    flags = flavour_flags(flavour)
    n_cols = x.shape[-1]
    x2 = _as_rows(x)
    dy2 = _as_rows(dy)
    weight = weight.contiguous()
    n_rows = x2.shape[0]
    dx = None
    if compute_dx:
        if dx_out is None:
            dx_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dx = dx_out
        dx2 = dx_out.view(-1, n_cols)
    else:
        dx2 = x2  # never written (COMPUTE_DX=False)
    if n_rows == 0:
        dw = torch.zeros_like(weight) if compute_dw else None
        return dx, dw
    block_m, block_n, num_warps, n_progs, num_stages = _bwd_launch(n_rows, n_cols, compute_dw, x.device, _config)
    n_tiles = triton.cdiv(n_rows, block_m)
    partial = (
        torch.empty((n_progs, n_cols), dtype=torch.float32, device=x.device) if compute_dw else rstd
    )
    _rms_norm_bwd_kernel[(n_progs,)](
        dy2, x2, weight, rstd, dx2, partial,
        n_rows, n_cols, n_tiles, dy2.stride(0), x2.stride(0), dx2.stride(0),
        **flags, COMPUTE_DX=compute_dx, COMPUTE_DW=compute_dw,
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=num_stages, num_warps=num_warps,
    )
    dw = partial.sum(0).to(weight.dtype) if compute_dw else None
    return dx, dw


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, flavour, inplace_backward):
        x2 = _as_rows(x)
        y, rstd = rms_norm_forward(x2, weight, eps, flavour)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.flavour = flavour
        ctx.inplace_backward = inplace_backward
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dx or need_dw):
            return None, None, None, None, None
        dy2 = dy.reshape(x2.shape)
        dx_out = None
        if need_dx and ctx.inplace_backward and dy2.dtype == x2.dtype and dy2.is_contiguous():
            dx_out = dy2
        dx, dw = rms_norm_backward(
            dy2, x2, weight, rstd, ctx.flavour, compute_dx=need_dx, compute_dw=need_dw, dx_out=dx_out
        )
        if dx is not None:
            if dx_out is not None:
                mark_written(dy)
            dx = dx.view(ctx.x_shape)
        return dx, dw, None, None, None


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, flavour: str = "llama"
) -> torch.Tensor:
    """Plain-PyTorch RMSNorm with the same casting as the kernel (the CPU path and the test oracle).

    Reductions run in fp32 (in fp64 for fp64 inputs, so it doubles as a float64 oracle).
    """
    flags = flavour_flags(flavour)
    acc = _acc_dtype(x.dtype)
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if flags["CAST_FIRST"]:
        return weight * (xf * rstd).to(x.dtype)
    scale = weight.to(acc) + 1.0 if flags["UNIT_OFFSET"] else weight.to(acc)
    return (xf * rstd * scale).to(x.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    flavour: str = "llama",
    inplace_backward: bool = False,
) -> torch.Tensor:
    """Root-mean-square normalisation over the last dimension, fused forward and backward.

    Args:
        x: activations ``[..., N]`` in fp32, fp16 or bf16 (any leading dims, e.g. ``[B, T, hidden]``
            or per-head ``[B, T, H, head_dim]`` for Qwen3/Gemma3 q/k norms).
        weight: ``[N]`` scale (the norm module's ``weight``).
        eps: added to the mean square (``variance_epsilon`` / ``eps`` of the HF module).
        flavour: how the weight meets the normalised row ``n``: ``"llama"`` ``cast(n) * w``, ``"gemma"``
            ``cast(n * (1 + w))`` in fp32, ``"gpt_oss"`` ``cast(n * w)`` in fp32.
        inplace_backward: let the backward write ``dx`` into the incoming gradient's buffer (no new
            activation-sized allocation). Only safe when this output's gradient is used by nothing
            else, e.g. a pre-norm feeding linear projections; leave ``False`` when the output is
            added to something else that needs the same gradient (Gemma-2/3 post-norms).

    Returns:
        ``y`` with ``x``'s shape (dtype ``x.dtype``; for Llama the promotion of ``x`` and ``weight``
        dtypes, exactly as HF: :func:`normed_dtype`). CUDA tensors run the Triton kernels, CPU tensors the PyTorch reference
        (see ``notebookkit.kernels.runtime``).
    """
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight has shape {tuple(weight.shape)} but x's last dimension is {x.shape[-1]}; "
            "pass the norm's 1-D weight of that size."
        )
    if should_use_triton(x):
        if weight.device != x.device:
            raise ValueError(f"rms_norm: x is on {x.device} but weight is on {weight.device}; move them together.")
        flavour_flags(flavour)  # an unknown flavour fails here, before the autograd function
        return _RMSNormFunction.apply(x, weight, float(eps), flavour, bool(inplace_backward))
    return rms_norm_reference(x, weight, eps, flavour)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py): (kernel, signature, constexprs, options)
# --------------------------------------------------------------------------------------------------
def _aot_specs() -> list:
    def fwd(dt, flavour, block_m, block_n, warps, w_dt=None):
        return (
            _rms_norm_fwd_kernel,
            {"X": f"*{dt}", "W": f"*{w_dt or dt}", "Y": f"*{dt}", "RSTD": "*fp32", "n_rows": "i32",
             "n_cols": "i32", "stride_x": "i32", "stride_y": "i32", "eps": "fp32"},
            {**flavour_flags(flavour), "BLOCK_M": block_m, "BLOCK_N": block_n},
            {"num_warps": warps},
        )

    def bwd(dt, flavour, dx, dw, block_m, block_n, warps, w_dt=None):
        return (
            _rms_norm_bwd_kernel,
            {"DY": f"*{dt}", "X": f"*{dt}", "W": f"*{w_dt or dt}", "RSTD": "*fp32", "DX": f"*{dt}",
             "DW_PARTIAL": "*fp32", "n_rows": "i32", "n_cols": "i32", "n_tiles": "i32",
             "stride_dy": "i32", "stride_x": "i32", "stride_dx": "i32"},
            {**flavour_flags(flavour), "COMPUTE_DX": dx, "COMPUTE_DW": dw, "BLOCK_M": block_m, "BLOCK_N": block_n,
             "NUM_STAGES": 2},
            {"num_warps": warps},
        )

    # one entry per code path, alternating dtypes (fp16 and bf16 both reach sm_75); gpt-oss's weights are fp32
    return [
        fwd("fp16", "llama", 1, 4096, 8),
        fwd("bf16", "gemma", 1, 4096, 8),
        fwd("fp16", "gpt_oss", 1, 4096, 8, w_dt="fp32"),
        fwd("fp16", "llama", 32, 128, 8),  # q/k norm shape (head_dim 128)
        bwd("fp16", "llama", True, True, 1, 4096, 8),
        bwd("bf16", "gemma", True, True, 1, 4096, 8),
        bwd("fp16", "gpt_oss", True, False, 1, 4096, 8, w_dt="fp32"),
        bwd("bf16", "llama", True, False, 32, 128, 8),
        bwd("fp16", "gemma", False, True, 32, 128, 8),
    ]


AOT_SPECS = _aot_specs()
