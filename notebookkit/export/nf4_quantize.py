"""NF4 quantisation (QLoRA's 4-bit NormalFloat), written from the format's definition, in the layout
bitsandbytes stores and transformers loads (``Params4bit`` + ``QuantState``, nested absmax).

For a weight of ``n`` elements taken in row-major (flat) order, blocks of ``B = 64``:

    absmax[b] = max |w_i| over block b                                   (fp32, exact)
    code(i)   = argmin_k | w_i / absmax[b] - NF4[k] |                     (nearest level; a tie takes the lower)
    byte j    = code(2j) << 4 | code(2j + 1)                              (high nibble first; odd n: low nibble 0)

Nested absmax ("double quantisation", bitsandbytes' ``compress_statistics=True``): the scales are
centred on their mean and stored as 8-bit codes into the signed dynamic map ``D`` (256 values),
with one fp32 scale per ``B2 = 256`` codes:

    offset     = mean(absmax)
    absmax2[c] = max |absmax[b] - offset| over block c of B2 scales
    q[b]       = argmin_k | (absmax[b] - offset) / absmax2[b // B2] - D[k] |

Codes are chosen with the exact fp32 ``absmax``; decoding (:func:`notebookkit.kernels.nf4.dequantize_nf4`)
uses the stored one, ``fp32(fp32(D[q[b]] * absmax2[b // B2]) + offset)``, so the decoded value is
``NF4[code(i)] * absmax_decoded[b]``. The squared rounding error ``sum (decoded - w)^2`` is measured
while quantising (the export's warning reports it).

The signed dynamic map (Dettmers, "8-bit approximations for parallelism in deep learning"): for
``i = 0..6``, the ``2^i`` midpoints of ``linspace(0.1, 1, 2^i + 1)`` (fp32), scaled by ``10^(i - 6)``
and by ``-10^(i - 6)``; then ``0`` and ``1``; sorted.

Serialised (:meth:`NF4Weight.state_dict`) as bitsandbytes' ``QuantState.as_dict(packed=True)``:
``<name>`` (packed bytes ``[ceil(n/2), 1]`` uint8), ``<name>.absmax`` (uint8 codes), ``.quant_map``
(the 16 levels), ``.nested_absmax``, ``.nested_quant_map`` (``D``) and
``.quant_state.bitsandbytes__nf4``: the JSON of the non-tensor fields as uint8 bytes, padded with
spaces to :data:`QUANT_STATE_BYTES` so its size is known before the weight is quantised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import torch

from notebookkit.kernels.nf4 import NF4_LEVELS
from notebookkit.memory.export import NF4_CHUNK_ELEMENTS

__all__ = ["NF4Weight", "NF4Nested", "quantize_nf4", "dynamic_map", "nf4_tensor_shapes", "QUANT_STATE_BYTES"]

BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256
QUANT_STATE_BYTES = 256  # the packed JSON, padded with spaces (about 170 bytes unpadded)


def dynamic_map(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256 sorted values of the signed 8-bit dynamic map (module docstring), fp32."""
    values: list[float] = []
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scale = 10.0 ** (i - 6) if i < 6 else 1
        values += (scale * mids).tolist() + (-scale * mids).tolist()
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32, device=device)


def _nearest(x: torch.Tensor, sorted_levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of ``sorted_levels`` to each ``x`` (a value on a midpoint takes the lower)."""
    midpoints = (sorted_levels[:-1] + sorted_levels[1:]) / 2
    return torch.bucketize(x, midpoints, right=False)


@dataclass
class NF4Nested:
    """The second level of a nested absmax (bitsandbytes' ``QuantState.state2``)."""

    absmax: torch.Tensor  # fp32 [ceil(n_blocks / blocksize)]
    code: torch.Tensor  # fp32 [256], the dynamic map
    blocksize: int = NESTED_BLOCKSIZE
    dtype: torch.dtype = torch.float32


@dataclass
class NF4Weight:
    """One weight in NF4, with the fields of a bitsandbytes ``QuantState`` (so ``dequantize_nf4`` reads it)."""

    packed: torch.Tensor  # uint8 [ceil(n/2), 1]
    absmax: torch.Tensor  # uint8 [n_blocks] codes (nested)
    offset: torch.Tensor  # fp32 scalar
    state2: NF4Nested
    shape: tuple[int, ...]
    dtype: torch.dtype  # the dtype a decode returns by default (the model's compute dtype)
    code: torch.Tensor  # fp32 [16], the NF4 levels
    blocksize: int = BLOCKSIZE
    quant_type: str = "nf4"
    squared_error: float = 0.0  # sum (decoded - w)^2 over the weight, float64
    squared_norm: float = 0.0  # sum w^2

    def quant_state_json(self) -> bytes:
        fields = {
            "quant_type": "nf4", "blocksize": self.blocksize, "dtype": str(self.dtype).replace("torch.", ""),
            "shape": list(self.shape), "nested_blocksize": self.state2.blocksize, "nested_dtype": "float32",
            "nested_offset": float(self.offset),
        }
        raw = json.dumps(fields).encode("utf-8")
        if len(raw) > QUANT_STATE_BYTES:
            raise ValueError(f"the NF4 quant state of shape {self.shape} needs {len(raw)} bytes, more than {QUANT_STATE_BYTES}")
        return raw + b" " * (QUANT_STATE_BYTES - len(raw))

    def state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors bitsandbytes / transformers read for the 4-bit weight ``name`` (module docstring)."""
        return {
            name: self.packed,
            name + ".absmax": self.absmax,
            name + ".quant_map": self.code,
            name + ".nested_absmax": self.state2.absmax,
            name + ".nested_quant_map": self.state2.code,
            name + ".quant_state.bitsandbytes__nf4": torch.frombuffer(bytearray(self.quant_state_json()), dtype=torch.uint8),
        }


def nf4_tensor_shapes(shape: tuple[int, ...], name: str = "") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every serialised tensor of an NF4 weight of ``shape``, before quantising."""
    n = 1
    for s in shape:
        n *= int(s)
    n_blocks = -(-n // BLOCKSIZE)
    return {
        name: (((n + 1) // 2, 1), torch.uint8),
        name + ".absmax": ((n_blocks,), torch.uint8),
        name + ".quant_map": ((16,), torch.float32),
        name + ".nested_absmax": ((-(-n_blocks // NESTED_BLOCKSIZE),), torch.float32),
        name + ".nested_quant_map": ((256,), torch.float32),
        name + ".quant_state.bitsandbytes__nf4": ((QUANT_STATE_BYTES,), torch.uint8),
    }


def _blockwise_absmax(flat: torch.Tensor, blocksize: int, chunk: int) -> torch.Tensor:
    """``max |x|`` of each block of ``blocksize`` consecutive values (the last block may be short)."""
    n = flat.numel()
    n_blocks = -(-n // blocksize)
    out = torch.empty(n_blocks, dtype=torch.float32, device=flat.device)
    step = max(1, chunk // blocksize)
    for first in range(0, n_blocks, step):
        last = min(n_blocks, first + step)
        part = flat[first * blocksize: min(n, last * blocksize)].abs()
        if part.numel() < (last - first) * blocksize:  # a short last block: pad with zeros
            part = torch.nn.functional.pad(part, (0, (last - first) * blocksize - part.numel()))
        out[first:last] = part.view(last - first, blocksize).amax(dim=1)
    return out


@torch.no_grad()
def quantize_nf4(weight: torch.Tensor, dtype: Optional[torch.dtype] = None, chunk: int = NF4_CHUNK_ELEMENTS) -> NF4Weight:
    """Quantise ``weight`` to NF4 with nested absmax (blocks of 64, second level 256), on its device.

    Args:
        weight: any floating-point tensor (the merged weight, usually fp32).
        dtype: the dtype a decode returns (``QuantState.dtype``); default ``weight.dtype``.
        chunk: elements processed at a time (the temporaries take about 40 bytes per element of a chunk).

    Returns:
        an :class:`NF4Weight` with the packed codes, the nested scales and the measured rounding error.
    """
    if not weight.is_floating_point():
        raise ValueError(f"NF4 quantises floating-point weights, not {weight.dtype}.")
    device = weight.device
    flat = weight.detach().reshape(-1)
    n = flat.numel()
    chunk = max(BLOCKSIZE * 2, chunk // (BLOCKSIZE * 2) * BLOCKSIZE * 2)  # whole blocks, an even count
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
    code2 = dynamic_map(device)

    absmax = _blockwise_absmax(flat, BLOCKSIZE, chunk)
    offset = absmax.mean()
    centred = absmax - offset
    absmax2 = _blockwise_absmax(centred, NESTED_BLOCKSIZE, chunk)
    scale2 = absmax2.repeat_interleave(NESTED_BLOCKSIZE)[: absmax.numel()]
    q = _nearest(centred / torch.where(scale2 > 0, scale2, torch.ones_like(scale2)), code2).to(torch.uint8)
    decoded_absmax = code2[q.long()] * scale2  # fp32 product, then the sum: as the decode rounds
    decoded_absmax = decoded_absmax + offset

    packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=device)
    packed_flat = packed.view(-1)
    squared_error = squared_norm = 0.0
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        w = flat[start:stop].to(torch.float32)
        blocks = slice(start // BLOCKSIZE, -(-stop // BLOCKSIZE))  # start is a whole number of blocks
        exact = absmax[blocks].repeat_interleave(BLOCKSIZE)[: stop - start]
        codes = _nearest(w / torch.where(exact > 0, exact, torch.ones_like(exact)), levels)
        del exact
        decoded = levels[codes] * decoded_absmax[blocks].repeat_interleave(BLOCKSIZE)[: stop - start]
        squared_error += float((decoded - w).double().square().sum())
        squared_norm += float(w.double().square().sum())
        del decoded, w
        codes = codes.to(torch.uint8)
        if codes.numel() % 2:  # odd n: the last low nibble is padding
            codes = torch.cat((codes, codes.new_zeros(1)))
        packed_flat[start // 2: start // 2 + codes.numel() // 2] = (codes[0::2] << 4) | codes[1::2]
        del codes
    return NF4Weight(
        packed=packed, absmax=q, offset=offset, state2=NF4Nested(absmax2, code2), shape=tuple(int(s) for s in weight.shape),
        dtype=dtype or weight.dtype, code=levels, squared_error=squared_error, squared_norm=squared_norm,
    )
