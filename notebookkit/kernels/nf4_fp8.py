"""NF4 weight -> FP8 e4m3 with rowwise scales, in one pass (the FP8 forward of a QLoRA base GEMM).

The FP8 forward (:mod:`notebookkit.kernels.fp8_matmul`) needs the base weight ``W [O, K]`` as
``(Q_w, s_w)``: one fp32 scale per output row and e4m3 codes. For an NF4 weight the plain route is
two kernels, ``dequantize_nf4`` (writes ``W`` in the compute dtype) and ``quantize_rowwise_fp8``
(reads it back). This kernel does both per row without the 16-bit round trip:

    W[o, k]  = round_c( NF4[code(o, k)] * absmax[block(o, k)] )       c = compute dtype (bf16, fp16, fp32)
    s_w[o]   = max(max_k |W[o, k]|, AMAX_FLOOR) * fp32(1 / 448)
    Q_w[o,k] = round_e4m3(clamp(W[o, k] * fp32(1 / s_w[o]), +-448))

which is, bit for bit, ``quantize_rowwise_fp8(dequantize_nf4(W, out_dtype=c))``: the same fp32
product as the dequantisation kernel (no FMA), the same rounding to the compute dtype, then the
same quantisation. Memory traffic per element: half a byte read and one byte written, instead of
half a byte read, two written, two read and one written.

It applies when the rows are whole NF4 blocks (``K`` a multiple of the blocksize, true for every
real model: 64 divides all hidden and intermediate sizes) and a row fits one program
(``K <= ONE_PASS_MAX_K``); otherwise, and on CPU without the interpreter, the two-step route runs.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from . import fp8_matmul
from .fp8_matmul import AMAX_FLOOR, FP8_DTYPE, INV_FP8_MAX, check_fp8_out, quantize_rowwise_fp8, row_scale, to_e4m3
from .nf4 import block_absmax, decode_nf4_blocks, dequantize_nf4, nf4_kernel_operands, read_nf4_state, unwrap_nf4_weight
from .runtime import should_use_triton

__all__ = ["quantize_nf4_rowwise_fp8", "quantize_nf4_rowwise_fp8_reference", "AOT_SPECS"]

_COMPUTE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@triton.jit
def _nf4_to_fp8_rowwise_kernel(
    packed_ptr,  # *u8, the NF4 bytes of W [O, K] (two codes per byte, high nibble first)
    absmax_ptr,  # *fp32 [n_blocks] (plain) or *u8 [n_blocks] (nested codes)
    table_ptr,  # *fp32 [16] NF4 levels
    code2_ptr,  # *fp32 [256] dynamic map (nested only)
    absmax2_ptr,  # *fp32 second-level scales (nested only)
    offset_ptr,  # *fp32 [1] mean offset (nested only)
    q_ptr,  # *fp8e4nv [O, K]
    scale_ptr,  # *fp32 [O]
    blocks_per_row,  # NF4 blocks in a row of W (K // BLOCKSIZE)
    n_bytes,  # bytes of packed (bounds the loads)
    BLOCKSIZE: tl.constexpr,
    BLOCKSIZE2: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,  # next power of two >= blocks_per_row
    NESTED: tl.constexpr,
    COMPUTE: tl.constexpr,  # 0 fp32, 1 fp16, 2 bf16
    FLOOR: tl.constexpr,
    INV_MAX: tl.constexpr,
    EXPLICIT_ROUNDING: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    local = tl.arange(0, ROW_BLOCKS)
    block_ok = local < blocks_per_row
    blocks = row * blocks_per_row + local
    absmax = block_absmax(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, blocks, block_ok, BLOCKSIZE2, NESTED)
    absmax = tl.where(block_ok, absmax, 0.0)
    w = decode_nf4_blocks(packed_ptr, table_ptr, blocks, block_ok, absmax, n_bytes, ROW_BLOCKS, BLOCKSIZE)

    # the dequantised weight in the compute dtype, as dequantize_nf4 writes it
    if COMPUTE == 2 and EXPLICIT_ROUNDING:  # bf16 RTNE on the bits (the interpreter truncates a cast)
        bits = w.to(tl.uint32, bitcast=True)
        w = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif COMPUTE == 2:
        w = w.to(tl.bfloat16).to(tl.float32)
    elif COMPUTE == 1:
        w = w.to(tl.float16).to(tl.float32)

    scale = row_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0),
                       tl.sum(tl.sum((w != w).to(tl.int32), axis=1), axis=0), FLOOR, INV_MAX)
    tl.store(scale_ptr + row, scale)
    v = tl.clamp(w * tl.math.div_rn(1.0, scale), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    offs = row * blocks_per_row * BLOCKSIZE + local[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    tl.store(q_ptr + offs, to_e4m3(v, q_ptr.dtype.element_ty, EXPLICIT_ROUNDING), mask=block_ok[:, None])


def quantize_nf4_rowwise_fp8_reference(
    weight: Any, quant_state: Any, compute_dtype: torch.dtype, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-step route: ``quantize_rowwise_fp8(dequantize_nf4(weight, out_dtype=compute_dtype), out)``."""
    dense = dequantize_nf4(weight, quant_state, out_dtype=compute_dtype)
    return quantize_rowwise_fp8(dense.reshape(dense.shape[0], -1), out)


def _fused_applies(packed: torch.Tensor, st, compute_dtype: torch.dtype) -> bool:
    if len(st.shape) != 2 or compute_dtype not in _COMPUTE_CODES:
        return False
    O, K = st.shape
    if O == 0 or K == 0 or K % st.blocksize or K > fp8_matmul.ONE_PASS_MAX_K:
        return False
    return should_use_triton(packed)


def quantize_nf4_rowwise_fp8(
    weight: Any, quant_state: Any, compute_dtype: torch.dtype, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 codes and rowwise scales of an NF4 weight ``[O, K]`` dequantised to ``compute_dtype``.

    Args:
        weight: the packed NF4 data (a ``Params4bit`` or its ``.data``).
        quant_state: its bitsandbytes ``QuantState`` (plain or nested absmax).
        compute_dtype: the dtype the forward computes in (the dense weight it stands for).
        out: optional ``(Q_w, s_w)`` to write into (float8_e4m3fn ``[O, K]`` and float32 ``[O, 1]``,
            contiguous: e.g. rows ``r0 .. r0 + O`` of a group's ``[O_total, K]`` buffer), as for
            :func:`notebookkit.kernels.fp8_matmul.quantize_rowwise_fp8`. Same bits as without it.

    Returns:
        ``(Q_w float8_e4m3fn [O, K], s_w float32 [O, 1])``, equal bit for bit to
        :func:`quantize_nf4_rowwise_fp8_reference`; ``out`` itself when given.
    """
    packed, quant_state = unwrap_nf4_weight(weight, quant_state)
    st = read_nf4_state(packed, quant_state)
    if out is not None and len(st.shape) == 2:
        check_fp8_out(out, int(st.shape[0]), int(st.shape[1]), packed.device, "quantize_nf4_rowwise_fp8")
    if not _fused_applies(packed, st, compute_dtype):
        return quantize_nf4_rowwise_fp8_reference(packed, quant_state, compute_dtype, out)
    O, K = st.shape
    packed, absmax, table, code2, absmax2, offset = nf4_kernel_operands(packed, st)
    if out is None:
        q = torch.empty((O, K), dtype=FP8_DTYPE, device=packed.device)
        scale = torch.empty((O, 1), dtype=torch.float32, device=packed.device)
    else:
        q, scale = out  # contiguous: the kernel writes row o at o * K
    blocks_per_row = K // st.blocksize
    row_blocks = triton.next_power_of_2(blocks_per_row)
    elements = row_blocks * st.blocksize
    _nf4_to_fp8_rowwise_kernel[(O,)](
        packed, absmax, table, code2, absmax2, offset, q, scale, blocks_per_row, packed.numel(),
        BLOCKSIZE=st.blocksize,
        BLOCKSIZE2=st.blocksize2,
        ROW_BLOCKS=row_blocks,
        NESTED=st.nested,
        COMPUTE=_COMPUTE_CODES[compute_dtype],
        FLOOR=AMAX_FLOOR,
        INV_MAX=INV_FP8_MAX,
        EXPLICIT_ROUNDING=fp8_matmul.GPU_EXPLICIT_ROUNDING if packed.is_cuda else True,
        num_warps=4 if elements <= 2048 else (8 if elements <= 8192 else 16),
        enable_fp_fusion=False,
    )
    return q, scale


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py): FP8 needs sm_89+, Hopper only.
# --------------------------------------------------------------------------------------------------
def _aot_specs() -> list:
    specs = []
    for nested in (True, False):
        signature = {
            "packed_ptr": "*u8", "absmax_ptr": "*u8" if nested else "*fp32", "table_ptr": "*fp32",
            "code2_ptr": "*fp32", "absmax2_ptr": "*fp32", "offset_ptr": "*fp32", "q_ptr": "*fp8e4nv",
            "scale_ptr": "*fp32", "blocks_per_row": "i32", "n_bytes": "i32",
        }
        constexprs = {
            "BLOCKSIZE": 64, "BLOCKSIZE2": 256, "ROW_BLOCKS": 64, "NESTED": nested, "COMPUTE": 2,
            "FLOOR": AMAX_FLOOR, "INV_MAX": INV_FP8_MAX, "EXPLICIT_ROUNDING": False,
        }
        specs.append((_nf4_to_fp8_rowwise_kernel, signature, constexprs,
                      {"num_warps": 8, "enable_fp_fusion": False, "targets": [90]}))
    return specs


AOT_SPECS = _aot_specs()
