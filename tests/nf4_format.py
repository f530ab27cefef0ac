"""The NF4 format, written out from its definition: the tests' oracle for every 4-bit decode.

Nothing here calls bitsandbytes' dequantisation or notebookkit's: the arithmetic is numpy float32,
element by element, so the result depends on IEEE rounding only, never on a CPU's instruction set
(bitsandbytes 0.50.2's CPU ``dequantize_4bit`` gives wrong values on AVX-512 CPUs for weights whose
rows are not whole 64-element blocks, e.g. 48 x 80; the tests must not take it as their oracle).

The format (QLoRA, as bitsandbytes stores it in ``Params4bit`` + ``QuantState``), for a weight of
``n`` elements in row-major order:

* element ``i`` has a 4-bit code in byte ``i // 2`` of the packed data: the high nibble for even
  ``i``, the low nibble for odd ``i``;
* the code indexes the 16 NF4 levels ``NF4_TABLE`` (quantiles of N(0, 1), scaled to [-1, 1]);
* each block of ``B = blocksize`` consecutive elements has one scale ``absmax[i // B]``: fp32, or,
  nested ("double quantisation"), an 8-bit code ``c`` into the dynamic map ``code2`` with one fp32
  scale per ``B2 = state2.blocksize`` codes and the mean ``offset`` added back:
  ``absmax[b] = fp32(fp32(code2[c[b]] * absmax2[b // B2]) + offset)``;
* the value is ``out_dtype(fp32(NF4_TABLE[code] * absmax[block]))``, rounded to nearest-even once.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

# The NF4 levels of the QLoRA paper (appendix E), each the exact decimal of an fp32 number.
# ``nf4_levels_from_quantiles`` derives them again from their definition.
NF4_TABLE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


# bitsandbytes' CPU ``quantize_blockwise`` (the nested absmax codes) picks a near, not always the
# nearest, entry of its dynamic map: measured on an AVX-512 CPU over 800k values, the chosen entry was
# at most 2.9e-5 (in units of absmax2) farther than the nearest, mostly for values within 1e-5 of 0,
# where the map's entries are 1e-6 apart. The decoded absmax then moves by at most that much more
# than the map's own rounding, which the end-to-end bound below accounts for. 1e-4 leaves a margin
# of 3x; a wrong code (a neighbour of a neighbour, a wrong block) is off by the map's spacing, >= 1e-3
# wherever |x| > 0.01.
CODE2_SLACK = 1e-4


def nf4_levels_from_quantiles() -> list[float]:
    """The 16 NF4 levels from their definition, in float64.

    QLoRA: 8 positive and 7 negative quantiles of N(0, 1), evenly spaced in probability from
    ``delta = (1 - 1/(2*15) + 1 - 1/(2*16)) / 2`` towards 0.5 (exclusive), an exact zero, and the
    whole set divided by its largest value, so that it spans [-1, 1].
    """
    delta = 0.5 * ((1 - 1 / (2 * 15)) + (1 - 1 / (2 * 16)))
    ppf = lambda p: float(torch.special.ndtri(torch.tensor(p, dtype=torch.float64)))  # noqa: E731
    positive = [ppf(delta + (0.5 - delta) * k / 8) for k in range(8)]
    negative = [-ppf(delta + (0.5 - delta) * k / 7) for k in range(7)]
    levels = sorted(positive + [0.0] + negative)
    top = max(abs(v) for v in levels)
    return [v / top for v in levels]


def _bytes(packed: torch.Tensor) -> np.ndarray:
    flat = packed.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.dtype != torch.uint8 else flat.numpy()


def _np32(t: Any) -> np.ndarray:
    return torch.as_tensor(t).detach().cpu().to(torch.float32).reshape(-1).numpy()


def absmax_by_definition(quant_state: Any) -> np.ndarray:
    """The fp32 scale of every block (nested codes decoded as ``code2[c] * absmax2 + offset``)."""
    state2 = getattr(quant_state, "state2", None)
    if state2 is None:
        return _np32(quant_state.absmax)
    codes = quant_state.absmax.detach().cpu().reshape(-1).numpy().astype(np.int64)
    code2 = _np32(state2.code)
    absmax2 = _np32(state2.absmax)
    block2 = np.arange(codes.size) // int(state2.blocksize)
    scaled = (code2[codes] * absmax2[block2]).astype(np.float32)  # rounded to fp32 ...
    return (scaled + np.float32(_np32(quant_state.offset)[0])).astype(np.float32)  # ... then the sum


def codes_by_definition(packed: torch.Tensor, n: int) -> np.ndarray:
    """The 4-bit code of each of the ``n`` elements (high nibble first)."""
    data = _bytes(packed)
    i = np.arange(n)
    byte = data[i // 2].astype(np.int64)
    return np.where(i % 2 == 0, byte >> 4, byte & 0xF)


def _round_fp32_to(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> ``dtype``, round to nearest-even (by hand for bf16: numpy has no bf16)."""
    if dtype == torch.float32:
        return torch.from_numpy(values.copy())
    if dtype == torch.float16:
        return torch.from_numpy(values.astype(np.float16))
    if dtype == torch.bfloat16:
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return torch.from_numpy(rounded.view(np.int16)).view(torch.bfloat16)
    raise ValueError(f"NF4 decodes to float32, float16 or bfloat16, not {dtype}")


def decode_nf4_by_definition(weight: Any, quant_state: Any = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense CPU tensor of an NF4 weight (``Params4bit``, or packed bytes with their ``QuantState``)."""
    if quant_state is None:
        quant_state = weight.quant_state
    packed = weight.data if isinstance(weight, torch.nn.Parameter) else weight
    shape = tuple(int(s) for s in quant_state.shape)
    n = math.prod(shape)
    blocksize = int(quant_state.blocksize)
    table = np.array(NF4_TABLE, dtype=np.float32)
    absmax = absmax_by_definition(quant_state)
    values = (table[codes_by_definition(packed, n)] * absmax[np.arange(n) // blocksize]).astype(np.float32)
    return _round_fp32_to(values, out_dtype or quant_state.dtype).reshape(shape)


def assert_packing_is_nearest_level(w: torch.Tensor, packed: torch.Tensor, quant_state: Any) -> None:
    """Check a quantiser's output (``packed``, ``quant_state``) for ``w`` against the definition.

    * plain absmax: ``absmax[b] = max |w|`` over block ``b`` (a max is exact in fp32);
    * every element's code is a nearest NF4 level to ``w / absmax`` (ties and fp32 rounding of the
      scaled value may pick either neighbour: a slack of 1e-6 in [-1, 1] units);
    * nested absmax: every 8-bit code is a nearest entry of ``code2`` to
      ``(absmax - offset) / absmax2``, within ``CODE2_SLACK``;
    * decoded by the definition, each element is within its NF4 rounding bound:
      ``|decoded - w| <= absmax * dist(w / absmax, nearest level) + |decoded absmax - absmax| +``
      half an ulp of the output dtype.
    """
    w64 = w.detach().cpu().double().reshape(-1).numpy()
    n = w64.size
    B = int(quant_state.blocksize)
    block = np.arange(n) // B
    n_blocks = -(-n // B)
    exact = np.array([np.abs(w64[b * B:(b + 1) * B]).max() for b in range(n_blocks)])
    decoded_absmax = absmax_by_definition(quant_state).astype(np.float64)
    state2 = getattr(quant_state, "state2", None)
    if state2 is None:
        assert np.array_equal(decoded_absmax, exact), "absmax is not the largest |w| of its block"
    else:
        offset = float(_np32(quant_state.offset)[0])
        assert abs(offset - exact.mean()) <= 1e-6 * exact.mean(), "offset is not the mean absmax"
        B2 = int(state2.blocksize)
        absmax2 = _np32(state2.absmax).astype(np.float64)
        centred = exact - offset
        want2 = np.array([np.abs(centred[j * B2:(j + 1) * B2]).max() for j in range(absmax2.size)])
        assert np.allclose(absmax2, want2, rtol=1e-6, atol=0), "absmax2 is not the largest |absmax - offset|"
        code2 = _np32(state2.code).astype(np.float64)
        scale2 = absmax2[np.arange(n_blocks) // B2]
        x2 = centred / np.where(scale2 > 0, scale2, 1.0)  # one block alone: absmax - offset = 0
        c = quant_state.absmax.detach().cpu().reshape(-1).numpy().astype(np.int64)
        got2 = np.abs(x2 - code2[c])
        best2 = np.abs(x2[:, None] - code2[None, :]).min(axis=1)
        far = (got2 > best2 + CODE2_SLACK) & (scale2 > 0)  # with absmax2 = 0 every code decodes to offset
        assert not far.any(), f"{int(far.sum())} absmax codes are not a nearest entry of code2"
    table = np.array(NF4_TABLE, dtype=np.float64)
    x = w64 / np.where(exact[block] > 0, exact[block], 1.0)
    got = np.abs(x - table[codes_by_definition(packed, n)])
    best = np.abs(x[:, None] - table[None, :]).min(axis=1)
    wrong = got > best + 1e-6
    assert not wrong.any(), f"{int(wrong.sum())} of {n} codes are not a nearest NF4 level"
    out_dtype = quant_state.dtype
    decoded = decode_nf4_by_definition(packed, quant_state).double().reshape(-1).numpy()
    half_ulp = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[out_dtype]
    bound = exact[block] * (best + 1e-6) + np.abs(decoded_absmax - exact)[block] + half_ulp * np.abs(decoded)
    # w itself was rounded to out_dtype before quantising; that rounding is in w64 already.
    assert (np.abs(decoded - w64) <= bound * (1 + 1e-6) + 1e-30).all(), (
        f"decoded values exceed the NF4 rounding bound: worst excess "
        f"{float(np.max(np.abs(decoded - w64) - bound)):.3e}")


def replace_4bit_layers_by_dense(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Swap every bitsandbytes ``Linear4bit`` of ``model`` (in place) for a frozen ``nn.Linear`` holding
    its weight decoded by :func:`decode_nf4_by_definition`: QLoRA's base layer as the format defines
    it, for oracles. Returns how many layers were swapped."""
    import bitsandbytes as bnb

    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, bnb.nn.Linear4bit):
                dense = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                        dtype=dtype)
                with torch.no_grad():
                    dense.weight.copy_(decode_nf4_by_definition(child.weight, out_dtype=torch.float32))
                    if child.bias is not None:
                        dense.bias.copy_(child.bias)
                dense.requires_grad_(False)
                setattr(parent, name, dense)
                count += 1
    return count
