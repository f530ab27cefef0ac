"""A stacked 3-D weight in NF4 (a mixture of experts' ``gate_up_proj`` / ``down_proj``) as the grouped GEMMs
of :mod:`notebookkit.kernels.moe_experts` read it: the tiles are decoded in the kernels' weight loads, the
dense weight is never written. Not an op of its own: the descriptor, its plain-PyTorch decode of one expert,
and the Triton tile decode.

Storage: the NF4 format of :mod:`notebookkit.kernels.nf4` (bitsandbytes' ``Params4bit`` + ``QuantState``),
over the whole stacked parameter taken in its own row-major (flat) order: element ``i`` is the high nibble of
byte ``i >> 1`` when ``i`` is even, the low one when odd; blocks of ``B`` (64) elements, one absmax each, nested
(double quantisation) or plain fp32::

    W.flat[i] = c( NF4[code(i)] * absmax[i // B] )        fp32 product, one rounding to the compute dtype c
    absmax[b] = fp32( fp32(code2[q[b]] * absmax2[b // B2]) + offset )   (nested)

A block may straddle rows and experts; nothing here assumes it does not.

:class:`NF4Stacked` describes a logical ``[E, N, K]`` view of that parameter by element strides
``(se, sn, sk)`` (a contiguous ``[E, N, K]`` parameter: ``(N K, K, 1)``; gpt-oss's ``[E, K, N]`` stored
weight seen as ``[E, N, K]``: ``(N K, 1, N)``), so ``transpose(1, 2)`` is a stride swap, as for a tensor.
Element ``(e, n, k)`` is flat index ``e se + n sn + k sk``.

The tile decode (:func:`load_weight_tile`) loads one byte per element (two lanes read each byte: no
vectorised nibble split, since a tile's elements are strided in the flat order), its block's absmax
(:func:`notebookkit.kernels.nf4.block_absmax`) and the level from the 16-entry table; masked lanes are 0.
Launch the kernels that call it with ``enable_fp_fusion=False`` when the absmax is nested, as
:func:`~notebookkit.kernels.nf4.dequantize_nf4` does, so ``code2 * absmax2 + offset`` rounds twice (no FMA).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..expert_chunks import decoded_range
from .nf4 import block_absmax, dequantize_nf4, nf4_table, read_nf4_state

__all__ = ["NF4Stacked", "nf4_stacked", "load_weight_tile", "weight_operands"]

# Device-only helper, compiled as part of the kernels that call it (tests/kernels/aot.py).
AOT_HELPERS = ["load_weight_tile"]


class NF4Stacked(NamedTuple):
    """A logical ``[E, N, K]`` view (element strides ``strides``) of a stacked NF4 weight (module docstring)."""

    packed: torch.Tensor  # uint8 [ceil(n / 2)], flat
    absmax: torch.Tensor  # uint8 [n_blocks] codes (nested) or fp32 [n_blocks]
    code2: Optional[torch.Tensor]  # fp32 [256] (nested)
    absmax2: Optional[torch.Tensor]  # fp32 [ceil(n_blocks / blocksize2)] (nested)
    offset: Optional[torch.Tensor]  # fp32 [1] (nested)
    table: torch.Tensor  # fp32 [16], the NF4 levels
    blocksize: int
    blocksize2: int
    shape: tuple[int, int, int]
    strides: tuple[int, int, int]
    dtype: torch.dtype  # the dtype the weight was quantised from (the model's compute dtype)
    chunk_bytes: Optional[int] = None  # the budget of one decoded chunk (notebookkit.expert_chunks; None: the least)

    # the few tensor-like members moe_expert_mlp's checks read
    requires_grad = False

    @property
    def nested(self) -> bool:
        return self.code2 is not None

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def dim(self) -> int:
        return 3

    def stride(self, d: int) -> int:
        return self.strides[d]

    def transpose(self, a: int, b: int) -> "NF4Stacked":
        """The view with dimensions ``a`` and ``b`` swapped (``1, 2`` only: the expert stays first)."""
        if sorted((a % 3, b % 3)) != [1, 2]:
            raise ValueError(f"NF4Stacked.transpose swaps the last two dimensions only, got ({a}, {b}).")
        e, n, k = self.shape
        se, sn, sk = self.strides
        return self._replace(shape=(e, k, n), strides=(se, sk, sn))

    def flat_index(self, e: int) -> torch.Tensor:
        """int64 ``[N, K]``: the flat index of each element of expert ``e``."""
        _, n, k = self.shape
        se, sn, sk = self.strides
        dev = self.device
        return (e * se + torch.arange(n, device=dev)[:, None] * sn + torch.arange(k, device=dev)[None, :] * sk)

    def expert(self, e: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Expert ``e``'s ``[N, K]`` weight decoded in plain PyTorch (fp32, one rounding to ``dtype``, default
        the weight's own): the reference path's one-expert scratch."""
        idx = self.flat_index(e)
        byte = self.packed[idx >> 1].to(torch.int64)
        code = torch.where(idx & 1 == 0, byte >> 4, byte & 15)
        block = idx // self.blocksize
        if self.nested:
            absmax = self.code2[self.absmax[block].long()] * self.absmax2[block // self.blocksize2]
            absmax = absmax + self.offset
        else:
            absmax = self.absmax[block].to(torch.float32)
        return (self.table[code] * absmax).to(dtype or self.dtype)

    def decode_experts(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """Experts ``[lo, hi)`` decoded, an ``[hi - lo, N, K]`` view with this view's strides, by
        :func:`~notebookkit.kernels.nf4.dequantize_nf4` (the Triton kernel on CUDA: fp32 product, one rounding,
        the values :func:`load_weight_tile` gives). The experts are a flat range of the stored parameter; the
        decoded range starts and ends on a whole group of block scales (``blocksize * blocksize2`` elements
        when nested), so the sliced scales keep their indices; at most two groups more are decoded."""
        se = self.strides[0]
        total = self.packed.numel() * 2  # elements in the stored parameter, rounded up to whole bytes
        start, end = decoded_range(lo, hi, se, total, self.blocksize * (self.blocksize2 if self.nested else 1))
        n_blocks = -(-(end - start) // self.blocksize)
        first = start // self.blocksize
        state = SimpleNamespace(shape=(end - start,), blocksize=self.blocksize, dtype=self.dtype, quant_type="nf4",
                                absmax=self.absmax[first:first + n_blocks], offset=self.offset, state2=None)
        if self.nested:
            state.state2 = SimpleNamespace(code=self.code2, blocksize=self.blocksize2,
                                           absmax=self.absmax2[first // self.blocksize2:
                                                               -(-(first + n_blocks) // self.blocksize2)])
        flat = dequantize_nf4(self.packed[start // 2:(end + 1) // 2], state, out_dtype=dtype)
        _, n, k = self.shape
        return flat.as_strided((hi - lo, n, k), self.strides, lo * se - start)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The whole ``[E, N, K]`` view decoded (tests and stock-code fallbacks; the kernels never call it)."""
        return torch.stack([self.expert(e, dtype) for e in range(self.shape[0])])


def nf4_stacked(packed: torch.Tensor, quant_state: Any, transposed: bool = False,
                chunk_bytes: Optional[int] = None) -> NF4Stacked:
    """The :class:`NF4Stacked` of a 3-D weight quantised as one NF4 tensor (``quant_state.shape`` 3-D): the
    stored ``[E, N, K]``, or with ``transposed`` the stored ``[E, K, N]`` seen as ``[E, N, K]`` (gpt-oss);
    ``chunk_bytes``: the budget of one chunk the training-sized calls decode
    (:func:`~notebookkit.expert_chunks.decode_chunk_bytes`; ``None``: the least)."""
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    st = read_nf4_state(packed, quant_state)
    if len(st.shape) != 3:
        raise ValueError(f"nf4_stacked: a stacked expert weight is 3-D [experts, out, in]; this NF4 weight has "
                         f"shape {st.shape}.")
    e, a, b = st.shape
    view = NF4Stacked(packed.reshape(-1).contiguous(), st.absmax.contiguous(), st.code2, st.absmax2, st.offset,
                      nf4_table(packed.device), st.blocksize,
                      st.blocksize2, (e, a, b), (a * b, b, 1), st.dtype, chunk_bytes)
    return view.transpose(1, 2) if transposed else view


def weight_operands(w: Any) -> tuple[Any, ...]:
    """The arguments a grouped kernel takes for a weight operand ``w`` (a 3-D tensor view or an
    :class:`NF4Stacked`): ``(w_ptr, stride_we, stride_wn, stride_wk, q_absmax_ptr, q_table_ptr, q_code2_ptr,
    q_absmax2_ptr, q_offset_ptr)`` and the constexprs ``{"NF4", "NESTED", "QBLOCK", "QBLOCK2"}``. A tensor's
    NF4 pointers are unused (the tensor itself)."""
    if isinstance(w, NF4Stacked):
        t = w.table
        q = (w.absmax, t, w.code2, w.absmax2, w.offset) if w.nested else (w.absmax, t, t, t, t)
        return ((w.packed, *w.strides, *q),
                {"NF4": True, "NESTED": w.nested, "QBLOCK": w.blocksize, "QBLOCK2": w.blocksize2})
    return ((w, w.stride(0), w.stride(1), w.stride(2), w, w, w, w, w),
            {"NF4": False, "NESTED": False, "QBLOCK": 64, "QBLOCK2": 256})


@triton.jit
def load_weight_tile(w_ptr, offs, mask, q_absmax_ptr, q_table_ptr, q_code2_ptr, q_absmax2_ptr, q_offset_ptr,
                     NF4: tl.constexpr, NESTED: tl.constexpr, QBLOCK: tl.constexpr, QBLOCK2: tl.constexpr):
    """The weight's elements at flat indices ``offs`` (int64, any shape) where ``mask``, else 0: loaded as
    they are, or with ``NF4`` decoded in fp32 as ``NF4[code(offs)] * absmax[offs // QBLOCK]``."""
    if NF4:
        byte = tl.load(w_ptr + (offs >> 1), mask=mask, other=0).to(tl.int32)
        code = tl.where((offs & 1) == 0, byte >> 4, byte & 15)
        absmax = block_absmax(q_absmax_ptr, q_code2_ptr, q_absmax2_ptr, q_offset_ptr, offs // QBLOCK, mask,
                              QBLOCK2, NESTED)
        w = tl.where(mask, tl.load(q_table_ptr + code) * absmax, 0.0)
    else:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    return w
