"""NF4 dequantisation of bitsandbytes 4-bit weights, bit-exact with the NF4 format (as bitsandbytes'
CUDA ``dequantize_4bit`` decodes it; its CPU decode is wrong on AVX-512 CPUs for some shapes).

Storage, as bitsandbytes writes it (``Params4bit`` + ``QuantState``), for a weight ``W`` of ``n``
elements taken in row-major (flat) order:

* ``packed``: ``ceil(n / 2)`` bytes (shape ``[ceil(n/2), 1]``, any storage dtype viewed as uint8).
  Byte ``j`` holds two 4-bit codes: element ``2j`` in the high nibble, element ``2j + 1`` in the low
  nibble (for odd ``n`` the last low nibble is padding).
* ``NF4``: the 16 NormalFloat4 levels (quantiles of N(0, 1) scaled to [-1, 1]), in fp32.
* one absmax per block of ``B = quant_state.blocksize`` consecutive elements (64 by default). Either
  plain fp32 (``absmax[b]``), or, with ``compress_statistics=True`` ("nested" / double quantisation),
  an 8-bit code ``c[b]`` in blocks of ``B2 = state2.blocksize`` (256) with its own fp32 scale and the
  dynamic 8-bit map ``code2 = state2.code``, plus the mean ``offset`` that was subtracted before:

      absmax[b] = fp32( fp32(code2[c[b]] * absmax2[b // B2]) + offset )        (two roundings, no FMA)

Forward (all arithmetic in fp32, one rounding to the output dtype at the end):

      W.flat[i] = out_dtype( NF4[code(i)] * absmax[i // B] )

There is no backward: the base weight is frozen; LoRA backward passes call this function again
instead of keeping the dequantised weight alive.

The Triton kernel tiles ``ROWS`` quantisation blocks per program: it loads the bytes of a block once
(vectorised), splits the nibbles, scales both halves by the block's absmax and interleaves them back
with ``tl.join`` so the store is contiguous. The kernel is launched with ``enable_fp_fusion=False``
so the nested ``code2 * absmax2 + offset`` is not contracted into an FMA (bitsandbytes rounds twice).
Under ``TRITON_INTERPRET=1`` the fp32 -> bf16 cast truncates (triton 3.9), so there the kernel rounds
to nearest-even by hand (``BF16_BITS``); on a GPU the hardware conversion is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .runtime import interpreter_on, should_use_triton

__all__ = ["NF4_LEVELS", "dequantize_nf4", "dequantize_nf4_reference", "AOT_SPECS"]

# The 16 NF4 levels. Each literal is the exact decimal of an fp32 number, so fp32(literal) is exact.
NF4_LEVELS: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TABLES: dict[torch.device, torch.Tensor] = {}


def nf4_table(device: torch.device) -> torch.Tensor:
    """The 16 NF4 levels as fp32 on ``device``, made once per device (no host-to-device copy per call, so a
    caller inside a captured CUDA graph may use it)."""
    table = _TABLES.get(device)
    if table is None:
        table = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
        _TABLES[device] = table
    return table


# --------------------------------------------------------------------------------------------------
# Reading a QuantState
# --------------------------------------------------------------------------------------------------


@dataclass
class _NF4State:
    """The fields of a bitsandbytes ``QuantState`` that NF4 dequantisation needs, checked."""

    absmax: torch.Tensor  # fp32 [n_blocks], or uint8 codes when nested
    shape: tuple[int, ...]
    dtype: torch.dtype
    blocksize: int
    nested: bool
    code2: torch.Tensor | None = None  # fp32 [256]
    absmax2: torch.Tensor | None = None  # fp32 [ceil(n_blocks / blocksize2)]
    blocksize2: int = 256
    offset: torch.Tensor | None = None  # fp32 [1]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n


def read_nf4_state(packed: torch.Tensor, quant_state: Any) -> _NF4State:
    """The decoded fields of a bitsandbytes NF4 ``QuantState`` for ``packed``; a readable error when they do not fit."""
    if quant_state is None:
        raise ValueError(
            "dequantize_nf4 needs the bitsandbytes QuantState of the weight: pass `weight.quant_state` "
            "(or pass the Params4bit weight itself, which carries it)."
        )
    if getattr(quant_state, "packing_format_for_cpu", False):
        raise ValueError(
            "This 4-bit weight is no longer in NF4 layout: bitsandbytes repacked it in place for its CPU "
            "inference kernel (its Linear4bit.forward does that the first time it runs in eval mode without "
            "gradients on a CPU with AVX512-BF16), reordering the 4-bit codes and rounding the block scales "
            "to bfloat16. notebookkit cannot read it, and the rounded scales cannot be undone. Reload the "
            "model with FastLanguageModel.from_pretrained: notebookkit's 4-bit layers never repack."
        )
    quant_type = getattr(quant_state, "quant_type", "nf4")
    if quant_type != "nf4":
        raise ValueError(
            f"dequantize_nf4 only reads NF4 weights, but this QuantState has quant_type={quant_type!r}. "
            "Load the model with bnb_4bit_quant_type='nf4' (FastLanguageModel.from_pretrained(..., "
            "load_in_4bit=True) does)."
        )
    shape = tuple(int(s) for s in quant_state.shape)
    blocksize = int(quant_state.blocksize)
    if blocksize < 2 or blocksize & (blocksize - 1):
        raise ValueError(f"NF4 blocksize must be a power of two >= 2 (bitsandbytes uses 64), got {blocksize}.")
    dtype = quant_state.dtype if quant_state.dtype is not None else torch.float32
    state2 = getattr(quant_state, "state2", None)
    st = _NF4State(
        absmax=quant_state.absmax,
        shape=shape,
        dtype=dtype,
        blocksize=blocksize,
        nested=state2 is not None,
    )
    n = st.numel
    n_blocks = -(-n // blocksize)
    if packed.numel() * packed.element_size() != (n + 1) // 2:
        raise ValueError(
            f"The packed NF4 data holds {packed.numel() * packed.element_size()} bytes, but a weight of shape "
            f"{shape} needs {(n + 1) // 2}. Pass the weight's own QuantState (weight.quant_state)."
        )
    if st.absmax.numel() != n_blocks:
        raise ValueError(
            f"QuantState.absmax has {st.absmax.numel()} entries, expected {n_blocks} "
            f"(= ceil({n} / blocksize {blocksize})). The QuantState does not belong to this weight."
        )
    device = packed.device
    if st.absmax.device != device:
        raise ValueError(
            f"The NF4 weight is on {device} but its QuantState is on {st.absmax.device}; move both "
            "to one device (model.to(device) moves them together)."
        )
    if st.nested:
        if st.absmax.dtype != torch.uint8:
            raise ValueError(f"A nested QuantState stores absmax as uint8 codes, got {st.absmax.dtype}.")
        st.code2 = state2.code.to(device=device, dtype=torch.float32)
        st.absmax2 = state2.absmax.to(device=device, dtype=torch.float32)
        st.blocksize2 = int(state2.blocksize)
        if st.blocksize2 < 1 or st.absmax2.numel() != -(-n_blocks // st.blocksize2):
            raise ValueError(
                f"QuantState.state2 does not match: {st.absmax2.numel()} second-level scales for "
                f"{n_blocks} absmax codes in blocks of {st.blocksize2}."
            )
        offset = quant_state.offset
        if offset is None:
            raise ValueError("A nested QuantState must carry `offset` (the mean absmax that was subtracted).")
        st.offset = torch.as_tensor(offset, dtype=torch.float32, device=device).reshape(1)
    else:
        st.absmax = st.absmax.to(torch.float32)
    return st


def unwrap_nf4_weight(weight: Any, quant_state: Any) -> tuple[torch.Tensor, Any]:
    """``(packed uint8 bytes, quant state)`` of an NF4 weight given as ``Params4bit`` or as bytes plus its state."""
    if quant_state is None:
        quant_state = getattr(weight, "quant_state", None)
    # Params4bit is a Parameter subclass; .data is the plain uint8 (or quant_storage) tensor.
    packed = weight.data if isinstance(weight, torch.nn.Parameter) else weight
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    return packed, quant_state


def _resolve_out(st: _NF4State, device: torch.device, out_dtype: torch.dtype | None, out: torch.Tensor | None):
    if out is not None:
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out has dtype {out.dtype} but out_dtype={out_dtype} was asked for.")
        out_dtype = out.dtype
        if out.numel() != st.numel or not out.is_contiguous() or out.device != device:
            raise ValueError(
                f"out must be a contiguous tensor of {st.numel} elements on {device} "
                f"(shape {st.shape}); got shape {tuple(out.shape)} on {out.device}."
            )
    if out_dtype is None:
        out_dtype = st.dtype
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"NF4 dequantisation writes float16, bfloat16 or float32, not {out_dtype}.")
    if out is None:
        out = torch.empty(st.shape, dtype=out_dtype, device=device)
    return out, out_dtype


# --------------------------------------------------------------------------------------------------
# Reference (plain PyTorch, the CPU path and the test oracle)
# --------------------------------------------------------------------------------------------------


def dequantize_nf4_reference(weight: torch.Tensor, quant_state: Any = None, out_dtype: torch.dtype | None = None,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch NF4 dequantisation (same arguments and bits as :func:`dequantize_nf4`)."""
    packed, quant_state = unwrap_nf4_weight(weight, quant_state)
    st = read_nf4_state(packed, quant_state)
    out, out_dtype = _resolve_out(st, packed.device, out_dtype, out)
    n = st.numel
    flat = packed.reshape(-1)
    codes = torch.stack(((flat >> 4), (flat & 0xF)), dim=1).reshape(-1)[:n].long()
    values = nf4_table(packed.device)[codes]
    if st.nested:
        scale2 = st.absmax2.repeat_interleave(st.blocksize2)[: st.absmax.numel()]
        absmax = st.code2[st.absmax.long()] * scale2
        absmax = absmax + st.offset
    else:
        absmax = st.absmax
    absmax = absmax.repeat_interleave(st.blocksize)[:n]
    out.view(-1).copy_((values * absmax).to(out_dtype))
    return out.view(st.shape)


# --------------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------------


@triton.jit
def program_rows(COUNT: tl.constexpr, INT64: tl.constexpr):
    """The ``COUNT`` rows this program handles, ``pid * COUNT + [0, COUNT)``: int64 when ``INT64`` (row
    offsets past 2**31), int32 otherwise."""
    pid = tl.program_id(0)
    if INT64:
        return pid.to(tl.int64) * COUNT + tl.arange(0, COUNT).to(tl.int64)
    return pid * COUNT + tl.arange(0, COUNT)


@triton.jit
def block_absmax(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, blocks, block_ok,
                  BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr):
    """fp32 absmax of NF4 blocks ``blocks``: stored as is, or nested as
    ``code2[c[b]] * absmax2[b // BLOCKSIZE2] + offset`` (fp32 product, then the sum, as bitsandbytes)."""
    if NESTED:
        c = tl.load(absmax_ptr + blocks, mask=block_ok, other=0).to(tl.int32)
        s2 = tl.load(absmax2_ptr + blocks // BLOCKSIZE2, mask=block_ok, other=0.0)
        absmax = tl.load(code2_ptr + c) * s2
        absmax = absmax + tl.load(offset_ptr)
    else:
        absmax = tl.load(absmax_ptr + blocks, mask=block_ok, other=0.0).to(tl.float32)
    return absmax


@triton.jit
def decode_nf4_blocks(packed_ptr, table_ptr, blocks, block_ok, absmax, n_bytes,
                       N_BLOCKS: tl.constexpr, BLOCKSIZE: tl.constexpr):
    """fp32 values ``[N_BLOCKS, BLOCKSIZE]`` of NF4 blocks: ``table[code] * absmax[block]``, two codes a
    byte, high nibble first. Bytes past ``n_bytes`` or of blocks not ``block_ok`` read as code 0."""
    HALF: tl.constexpr = BLOCKSIZE // 2
    byte_idx = blocks[:, None] * HALF + tl.arange(0, HALF)[None, :]
    byte_ok = block_ok[:, None] & (byte_idx < n_bytes)
    byte = tl.load(packed_ptr + byte_idx, mask=byte_ok, other=0).to(tl.int32)
    hi = tl.load(table_ptr + (byte >> 4)) * absmax[:, None]
    lo = tl.load(table_ptr + (byte & 15)) * absmax[:, None]
    return tl.reshape(tl.join(hi, lo), (N_BLOCKS, BLOCKSIZE))


@triton.jit
def _nf4_dequant_kernel(
    packed_ptr,  # *u8   ceil(n/2) bytes
    absmax_ptr,  # *fp32 [n_blocks] (plain) or *u8 [n_blocks] (nested codes)
    table_ptr,  # *fp32 [16] NF4 levels
    code2_ptr,  # *fp32 [256] dynamic map (nested only)
    absmax2_ptr,  # *fp32 second-level scales (nested only)
    offset_ptr,  # *fp32 [1] mean offset (nested only)
    out_ptr,  # *fp16 / *bf16 / *fp32, n elements
    n,
    n_bytes,
    n_blocks,
    BLOCKSIZE: tl.constexpr,
    BLOCKSIZE2: tl.constexpr,
    ROWS: tl.constexpr,
    NESTED: tl.constexpr,
    INT64: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    rows = program_rows(ROWS, INT64)
    row_ok = rows < n_blocks
    absmax = block_absmax(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, rows, row_ok, BLOCKSIZE2, NESTED)
    vals = decode_nf4_blocks(packed_ptr, table_ptr, rows, row_ok, absmax, n_bytes, ROWS, BLOCKSIZE)

    offs = rows[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    if BF16_BITS:
        # Round fp32 -> bf16 to nearest-even by hand and store the bits (out_ptr is int16 here).
        bits = vals.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(out_ptr + offs, bits.to(tl.int16), mask=offs < n)
    else:
        tl.store(out_ptr + offs, vals.to(out_ptr.dtype.element_ty), mask=offs < n)


def nf4_kernel_operands(packed: torch.Tensor, st: _NF4State) -> tuple[torch.Tensor, ...]:
    """The pointer operands of an NF4 kernel: ``(packed bytes, absmax, NF4 table, code2, absmax2, offset)``,
    flat and contiguous. Without nested absmax the last three are unused by the kernel (any fp32
    tensor will do: the table)."""
    packed = packed.reshape(-1)
    if not packed.is_contiguous():
        packed = packed.contiguous()
    table = nf4_table(packed.device)
    if st.nested:
        return packed, st.absmax.contiguous(), table, st.code2.contiguous(), st.absmax2.contiguous(), st.offset
    return packed, st.absmax.contiguous(), table, table, table, table


def _launch_config(blocksize: int) -> tuple[int, int]:
    """(ROWS, num_warps): about 4096 outputs per program."""
    rows = max(1, 4096 // blocksize)
    return rows, 4


def dequantize_nf4(
    weight: torch.Tensor,
    quant_state: Any = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantise a bitsandbytes NF4 weight to a dense fp16 / bf16 / fp32 tensor.

    Args:
        weight: the packed 4-bit data: a ``bitsandbytes.nn.Params4bit`` (its ``quant_state`` is used
            when ``quant_state`` is not given) or its ``.data`` (uint8, usually shape ``[n/2, 1]``).
        quant_state: the weight's ``bitsandbytes.functional.QuantState`` (NF4, any power-of-two
            blocksize, nested/double-quantised absmax or plain fp32 absmax).
        out_dtype: dtype of the result; defaults to ``quant_state.dtype`` (the dtype the weight was
            quantised from).
        out: optional preallocated contiguous output of ``quant_state.shape`` numel to write into.

    Returns:
        The dense weight of shape ``quant_state.shape``: ``NF4[code] * absmax`` in fp32, rounded once
        to the output dtype; bit-identical to bitsandbytes' CUDA ``dequantize_4bit`` in that dtype.

    CUDA tensors run the Triton kernel; CPU tensors run the PyTorch reference unless Triton is
    forced (``notebookkit.kernels.runtime.use_triton(True)`` with ``TRITON_INTERPRET=1``).
    """
    packed, quant_state = unwrap_nf4_weight(weight, quant_state)
    if not should_use_triton(packed):
        return dequantize_nf4_reference(packed, quant_state, out_dtype=out_dtype, out=out)
    st = read_nf4_state(packed, quant_state)
    out, out_dtype = _resolve_out(st, packed.device, out_dtype, out)
    n = st.numel
    if n == 0:
        return out.view(st.shape)
    packed, absmax, table, code2, absmax2, offset = nf4_kernel_operands(packed, st)
    n_blocks = absmax.numel()
    rows, num_warps = _launch_config(st.blocksize)
    # Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest-even (the GPU
    # rounds correctly), so under the interpreter the kernel rounds by hand and stores the bits.
    bf16_bits = out_dtype == torch.bfloat16 and interpreter_on() and not packed.is_cuda
    grid = (triton.cdiv(n_blocks, rows),)
    _nf4_dequant_kernel[grid](
        packed,
        absmax,
        table,
        code2,
        absmax2,
        offset,
        out.view(torch.int16) if bf16_bits else out,
        n,
        (n + 1) // 2,
        n_blocks,
        BLOCKSIZE=st.blocksize,
        BLOCKSIZE2=st.blocksize2,
        ROWS=rows,
        NESTED=st.nested,
        INT64=n + st.blocksize * rows >= 2**31,
        BF16_BITS=bf16_bits,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )
    return out.view(st.shape)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py, e.g. for sm_75)
# --------------------------------------------------------------------------------------------------


def _aot_specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """(kernel, signature, constexprs, compile options) for fp16 / bf16 outputs, nested or not."""
    specs = []
    for out_ty in ("fp16", "bf16"):
        for nested in (True, False):
            signature = {
                "packed_ptr": "*u8",
                "absmax_ptr": "*u8" if nested else "*fp32",
                "table_ptr": "*fp32",
                "code2_ptr": "*fp32",
                "absmax2_ptr": "*fp32",
                "offset_ptr": "*fp32",
                "out_ptr": f"*{out_ty}",
                "n": "i32",
                "n_bytes": "i32",
                "n_blocks": "i32",
            }
            rows, num_warps = _launch_config(64)
            constexprs = {
                "BLOCKSIZE": 64, "BLOCKSIZE2": 256, "ROWS": rows, "NESTED": nested, "INT64": False, "BF16_BITS": False,
            }
            options = {"num_warps": num_warps, "enable_fp_fusion": False}
            specs.append((_nf4_dequant_kernel, signature, constexprs, options))
    return specs


AOT_SPECS = _aot_specs()
