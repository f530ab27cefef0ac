"""Ternary base weights (BitNet b1.58 style): the packed format, the quantiser, the BitNet checkpoint
converter and the dequantisation kernel.

A ternary weight ``W [O, K]`` is ``W[o, k] = s[o, k // G] * t[o, k]`` with ``t`` in {-1, 0, +1} and one
fp16 scale ``s`` per output row (``G = K``) or per group of ``G`` consecutive inputs of a row.

Storage (:class:`TernaryWeight`):

* ``packed``: uint8 ``[O, ceil(K / 4)]``, row-major along ``K``, four codes a byte: weight ``k`` of a
  row sits in byte ``k // 4`` at bits ``2 * (k % 4)`` (lowest bits first), as the code ``t + 1`` in
  {0, 1, 2} (BitNet's code; 3 is invalid). Padding past ``K`` is code 1 (zero).
* ``scales``: fp16 ``[O, ceil(K / G)]``.

Why 2 bits and not base 3 (five trits a byte, 1.6 bits): a 2-bit code is a shift and a mask, so a
GEMM tile unpacks with no integer division or lookup table, a K tile of a power-of-two width is a
whole number of bytes, and byte ``k // 4`` is found without dividing by 5. Base 3 saves 20% of the
code bytes (the scales are the same), and would need a ``/ 3^i mod 3`` per weight on the tensor-core
path. Packing along ``K`` (not across rows as transformers' BitNet layout does) keeps one row's
codes contiguous, so a tile ``[BLOCK_N, BLOCK_K]`` of ``W`` is ``BLOCK_K / 4`` contiguous bytes per row
for the forward ``x @ W^T`` and the backward ``dy @ W`` alike.

Dequantisation (all in fp32, one rounding to the output dtype):

    W[o, k] = out_dtype( fp32(s[o, k // G]) * (code(o, k) - 1) )

which is exact in fp16 and fp32 (``s`` is fp16 and ``t`` is +-1 or 0) and one rounding in bf16.

Quantiser (:func:`quantize_ternary`), per group ``g`` of a row (or over the whole tensor):

    absmean:  s_g = mean_{k in g} |W[k]|                          (BitNet b1.58; per tensor there)
    codes:    t[k] = clip(round(W[k] / s_g), -1, 1)
    refit:    s_g = <W_g, t_g> / <t_g, t_g>                       (least squares given the codes)

Refitting never increases ``||W - s t||`` for the given codes; alternating codes (nearest of
{-s, 0, s}) and refits (``refit_steps > 1``) never increases it either. There is no backward:
the base is frozen (LoRA trains on top); :mod:`notebookkit.kernels.ternary_matmul` has the fused GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import triton
import triton.language as tl

from .runtime import interpreter_on, should_use_triton

__all__ = [
    "TernaryWeight", "DEFAULT_GROUP_SIZE", "DEFAULT_REFIT_STEPS", "pack_ternary", "unpack_ternary", "quantize_ternary",
    "dequantize_ternary", "dequantize_ternary_reference", "ternary_from_bitnet", "AOT_SPECS",
]

# Chosen from benchmarks/ternary_quant_error.py (benchmarks/results/2026-12-02-cpu-ternary-quant-error.md):
# on Gaussian weights one scale a row (2.016 bits a weight) is within 0.006 of groups of 64 (2.25 bits),
# and far better than one per tensor when rows differ in scale; the fit matters more (absmean 0.513,
# refit 0.461, four alternating refits 0.436 relative error), so rows with four refits.
DEFAULT_GROUP_SIZE = "row"
DEFAULT_REFIT_STEPS = 4
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP16_MAX = 65504.0


@dataclass
class TernaryWeight:
    """A frozen ternary weight ``[out_features, in_features]``: packed codes and fp16 scales."""

    packed: torch.Tensor  # uint8 [O, ceil(K / 4)]
    scales: torch.Tensor  # fp16 [O, ceil(K / group_size)]
    in_features: int
    group_size: int

    def __post_init__(self) -> None:
        k, g = int(self.in_features), int(self.group_size)
        if k < 1 or g < 1:
            raise ValueError(f"in_features and group_size must be positive, got {k} and {g}.")
        if self.packed.dtype != torch.uint8 or self.packed.dim() != 2:
            raise ValueError(f"TernaryWeight.packed must be a 2-D uint8 tensor, got {self.packed.dtype} "
                             f"of shape {tuple(self.packed.shape)}.")
        o = self.packed.shape[0]
        if self.packed.shape[1] != -(-k // 4):
            raise ValueError(f"TernaryWeight.packed has {self.packed.shape[1]} bytes a row, but "
                             f"in_features={k} needs ceil({k} / 4) = {-(-k // 4)}.")
        want = (o, -(-k // g))
        if self.scales.dtype != torch.float16 or tuple(self.scales.shape) != want:
            raise ValueError(f"TernaryWeight.scales must be fp16 of shape {want} (one per row and group of "
                             f"{g}), got {self.scales.dtype} of shape {tuple(self.scales.shape)}.")
        if self.scales.device != self.packed.device:
            raise ValueError(f"codes on {self.packed.device} but scales on {self.scales.device}: move both "
                             "(TernaryWeight.to(device)).")

    @property
    def out_features(self) -> int:
        return int(self.packed.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, int(self.in_features))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def to(self, device: Any) -> "TernaryWeight":
        return TernaryWeight(self.packed.to(device), self.scales.to(device), self.in_features, self.group_size)

    def nbytes(self) -> int:
        return self.packed.numel() + 2 * self.scales.numel()


# --------------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------------


def pack_ternary(codes: torch.Tensor) -> torch.Tensor:
    """Pack ternary values ``[O, K]`` (any integer or float dtype, values in {-1, 0, 1}) into uint8
    ``[O, ceil(K / 4)]``: four a byte along ``K``, code ``t + 1``, weight ``k`` at bits ``2 * (k % 4)``."""
    if codes.dim() != 2:
        raise ValueError(f"pack_ternary takes a 2-D [out, in] tensor, got shape {tuple(codes.shape)}.")
    t = codes.to(torch.int16)
    if not bool(((t >= -1) & (t <= 1) & (t.to(codes.dtype) == codes)).all()):
        bad = codes[(t < -1) | (t > 1) | (t.to(codes.dtype) != codes)].flatten()[:4].tolist()
        raise ValueError(f"pack_ternary: values must be -1, 0 or 1, found {bad}.")
    o, k = t.shape
    kp = -(-k // 4) * 4
    c = torch.ones((o, kp), dtype=torch.uint8, device=codes.device)  # padding: code 1 = zero
    c[:, :k] = (t + 1).to(torch.uint8)
    c = c.view(o, kp // 4, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def _codes(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """uint8 codes ``[O, K]`` in {0, 1, 2, 3} of packed bytes."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    c = (packed.unsqueeze(-1) >> shifts) & 3
    return c.reshape(packed.shape[0], -1)[:, :in_features]


def unpack_ternary(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int8 ternary values ``[O, in_features]`` of bytes packed by :func:`pack_ternary`."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != -(-in_features // 4):
        raise ValueError(f"unpack_ternary expects uint8 [O, ceil({in_features} / 4)], got {packed.dtype} "
                         f"{tuple(packed.shape)}.")
    c = _codes(packed, in_features)
    if bool((c == 3).any()):
        raise ValueError("unpack_ternary: code 3 found; ternary codes are 0, 1, 2 (= -1, 0, +1). These "
                         "bytes are not a notebookkit ternary weight.")
    return c.to(torch.int8) - 1


# --------------------------------------------------------------------------------------------------
# Quantiser
# --------------------------------------------------------------------------------------------------


def _group_view(w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [O, K]`` as fp32 ``[O, n_groups, g]`` padded with zeros, and the per-group element counts."""
    o, k = w.shape
    ng = -(-k // g)
    wp = torch.zeros((o, ng * g), dtype=torch.float32, device=w.device)
    wp[:, :k] = w.float()
    counts = torch.full((ng,), float(g), device=w.device)
    counts[-1] = k - (ng - 1) * g
    return wp.view(o, ng, g), counts


def quantize_ternary(
    weight: torch.Tensor,
    group_size: int | str = DEFAULT_GROUP_SIZE,
    refit_steps: int = DEFAULT_REFIT_STEPS,
) -> TernaryWeight:
    """Ternarise a 16/32-bit weight ``[out, in]`` into a :class:`TernaryWeight`.

    Args:
        weight: the dense weight (``nn.Linear.weight``), any float dtype.
        group_size: inputs per scale: an int ``G``, ``"row"`` (the default: one scale per output row) or
            ``"tensor"`` (one scale for the whole weight, as BitNet b1.58 trains; stored per row).
        refit_steps: 0: BitNet's absmean scale. 1: absmean codes with the least-squares scale
            ``<W, t> / <t, t>``. ``n > 1``: then ``n - 1`` more rounds of re-rounding the codes to the
            nearest of {-s, 0, s} and refitting (each round never increases the error); 4 by default.

    Returns:
        The packed codes and fp16 scales; :func:`dequantize_ternary` gives the dense approximation.
    """
    if not torch.is_floating_point(weight) or weight.dim() != 2:
        raise ValueError(f"quantize_ternary takes a 2-D float weight [out, in], got {weight.dtype} "
                         f"of shape {tuple(weight.shape)}.")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("quantize_ternary: the weight has NaN or Inf entries.")
    if refit_steps < 0:
        raise ValueError(f"refit_steps must be >= 0, got {refit_steps}.")
    o, k = weight.shape
    per_tensor = group_size == "tensor"
    if group_size in ("row", "tensor"):
        g = k
    elif isinstance(group_size, int) and not isinstance(group_size, bool) and group_size >= 1:
        g = min(int(group_size), k)
    else:
        raise ValueError(f"group_size must be a positive int, 'row' or 'tensor', got {group_size!r}.")
    wg, counts = _group_view(weight, g)
    dims = (0, 1, 2) if per_tensor else (2,)
    abs_sum = wg.abs().sum(dim=dims, keepdim=True)
    scale = abs_sum / (k * o if per_tensor else counts.view(1, -1, 1))
    tiny = torch.finfo(torch.float32).tiny

    def codes_for(s: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.round(wg / s.clamp_min(tiny)), -1, 1)

    t = codes_for(scale)
    for step in range(refit_steps):
        if step:
            t = codes_for(scale)
        tt = (t * t).sum(dim=dims, keepdim=True)
        wt = (wg * t).sum(dim=dims, keepdim=True)
        scale = torch.where(tt > 0, wt / tt.clamp_min(1), scale)
    scale = scale.expand(o, wg.shape[1], 1) if per_tensor else scale
    if bool((scale.abs() > _FP16_MAX).any()):
        raise ValueError(f"quantize_ternary: a scale of {scale.abs().max().item():.3g} does not fit fp16 "
                         "(max 65504); rescale the weight first.")
    codes = t.reshape(o, -1)[:, :k]
    return TernaryWeight(pack_ternary(codes.to(torch.int8)), scale.reshape(o, -1).to(torch.float16).contiguous(),
                         k, g)


# --------------------------------------------------------------------------------------------------
# Reference dequantisation (plain PyTorch: the CPU path and the test oracle)
# --------------------------------------------------------------------------------------------------


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"ternary dequantisation writes float16, bfloat16 or float32, not {out_dtype}.")


def dequantize_ternary_reference(weight: TernaryWeight, out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Plain-PyTorch :func:`dequantize_ternary` (same bits)."""
    _check_out_dtype(out_dtype)
    t = unpack_ternary(weight.packed, weight.in_features).float()
    s = weight.scales.float().repeat_interleave(weight.group_size, dim=1)[:, : weight.in_features]
    return (t * s).to(out_dtype)


# --------------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------------


@triton.jit
def ternary_tile(packed_ptr, scales_ptr, rows, cols, row_ok, col_ok, row_bytes, n_groups, group_size):
    """fp32 ``[len(rows), len(cols)]`` tile of ``W``: ``s[row, col // G] * (code - 1)``; masked entries 0.
    The four lanes of a byte load the same address (one cache line), then shift by ``2 * (col % 4)``."""
    ok = row_ok[:, None] & col_ok[None, :]
    byte = tl.load(packed_ptr + rows[:, None] * row_bytes + (cols // 4)[None, :], mask=ok, other=0x55)
    code = (byte.to(tl.int32) >> ((cols % 4) * 2)[None, :]) & 3
    s = tl.load(scales_ptr + rows[:, None] * n_groups + (cols // group_size)[None, :], mask=ok, other=0.0)
    return s.to(tl.float32) * (code - 1).to(tl.float32)


@triton.jit
def _ternary_dequant_kernel(
    packed_ptr,  # *u8 [O, row_bytes]
    scales_ptr,  # *fp16 [O, n_groups]
    out_ptr,  # *fp16 / *bf16 / *fp32 [O, K]
    n_rows,
    n_cols,
    row_bytes,
    n_groups,
    group_size,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    vals = ternary_tile(packed_ptr, scales_ptr, rows, cols, row_ok, col_ok, row_bytes, n_groups, group_size)
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if BF16_BITS:
        # The interpreter truncates fp32 -> bf16; round to nearest-even by hand (out_ptr is int16 here).
        bits = vals.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(out_ptr + offs, bits.to(tl.int16), mask=ok)
    else:
        tl.store(out_ptr + offs, vals.to(out_ptr.dtype.element_ty), mask=ok)


_DEQ_BLOCK_N, _DEQ_BLOCK_K, _DEQ_WARPS = 16, 256, 4


def dequantize_ternary(weight: TernaryWeight, out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Dequantise a :class:`TernaryWeight` to a dense ``[out, in]`` tensor ``s * t`` in ``out_dtype``.

    Exact in fp16 and fp32, one rounding in bf16. CUDA tensors run the Triton kernel; CPU tensors run
    the PyTorch reference unless Triton is forced (``runtime.use_triton(True)`` with ``TRITON_INTERPRET=1``).
    """
    if not isinstance(weight, TernaryWeight):
        raise TypeError(f"dequantize_ternary takes a TernaryWeight (see quantize_ternary), got {type(weight).__name__}.")
    _check_out_dtype(out_dtype)
    if not should_use_triton(weight.packed):
        return dequantize_ternary_reference(weight, out_dtype)
    o, k = weight.shape
    out = torch.empty((o, k), dtype=out_dtype, device=weight.device)
    bf16_bits = out_dtype == torch.bfloat16 and interpreter_on() and not weight.packed.is_cuda
    grid = (triton.cdiv(o, _DEQ_BLOCK_N), triton.cdiv(k, _DEQ_BLOCK_K))
    _ternary_dequant_kernel[grid](
        weight.packed.contiguous(), weight.scales.contiguous(), out.view(torch.int16) if bf16_bits else out,
        o, k, weight.packed.shape[1], weight.scales.shape[1], weight.group_size,
        BLOCK_N=_DEQ_BLOCK_N, BLOCK_K=_DEQ_BLOCK_K, BF16_BITS=bf16_bits, num_warps=_DEQ_WARPS,
    )
    return out


# --------------------------------------------------------------------------------------------------
# BitNet b1.58 checkpoints (transformers' ``quant_method: "bitnet"``)
# --------------------------------------------------------------------------------------------------

_BITNET_LAYOUTS = ("bitlinear", "autobitlinear")


def _bitnet_unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """transformers' BitNet packing, undone: uint8 ``[R, I]`` -> int16 codes ``[4R, I]``, row ``i * R + r``
    from bits ``2i`` of stored row ``r`` (``integrations/bitnet.py``, ``unpack_weights``)."""
    planes = [(packed >> (2 * i)) & 3 for i in range(4)]
    return torch.cat(planes, dim=0).to(torch.int16)


def ternary_from_bitnet(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    quantization_config: Mapping[str, Any] | None = None,
    out_features: int | None = None,
) -> TernaryWeight:
    """Convert one linear layer of a BitNet b1.58 checkpoint (transformers ``model_type: "bitnet"``,
    ``quantization_config.quant_method: "bitnet"``) to a per-row :class:`TernaryWeight`.

    transformers stores two layouts, chosen by ``quantization_config["linear_class"]``:

    * ``"bitlinear"`` (the default): ``weight`` uint8 ``[ceil(O / 4), I]``, four rows a byte *across
      rows*: row ``i * R + r`` of the ternary matrix is bits ``2i..2i+1`` of stored row ``r``
      (``R = weight.shape[0]``), as the code ``t + 1``; ``weight_scale`` one value, and the layer computes
      ``y = (x @ t^T) / weight_scale``, so ``W = t / weight_scale``.
    * ``"autobitlinear"`` with ``quantization_mode: "offline"``: ``weight`` holds the ternary values
      (dense float ``[O, I]``, or packed as above); the layer computes ``y = (x @ t^T) * weight_scale``,
      so ``W = t * weight_scale``.

    Args:
        weight, weight_scale: the layer's two checkpoint tensors (``*.weight``, ``*.weight_scale``).
        quantization_config: the checkpoint's ``config.json`` ``quantization_config`` (dict); ``None``
            means transformers' default (``"bitlinear"``, offline).
        out_features: the layer's output size; for packed weights it defaults to ``4 * R``.

    Raises:
        ValueError: an unknown layout, an online (unquantised) checkpoint, a code that is not ternary,
        or a scale that is not one positive number, with what to do instead.
    """
    cfg = dict(quantization_config or {})
    method = cfg.get("quant_method", "bitnet")
    method = getattr(method, "value", method)
    if method != "bitnet":
        raise ValueError(f"ternary_from_bitnet reads BitNet checkpoints (quant_method 'bitnet'), this one says "
                         f"quant_method={method!r}.")
    linear_class = cfg.get("linear_class", "bitlinear")
    mode = cfg.get("quantization_mode", "offline")
    if linear_class not in _BITNET_LAYOUTS:
        raise ValueError(f"Unknown BitNet layout linear_class={linear_class!r}: notebookkit reads "
                         f"{list(_BITNET_LAYOUTS)} (transformers' two). Convert the checkpoint with the tool that "
                         "wrote it to one of those, or to 16-bit weights and quantize_ternary them.")
    if mode != "offline":
        raise ValueError(f"This BitNet checkpoint has quantization_mode={mode!r}: its weights are 16-bit "
                         "(quantised on the fly while training), not ternary codes. Ternarise them with "
                         "quantize_ternary(weight, group_size='tensor', refit_steps=0) to match BitNet's "
                         "own online quantiser.")
    scale = torch.as_tensor(weight_scale)
    if scale.numel() != 1:
        raise ValueError(f"BitNet weight_scale must be one number per layer, got shape {tuple(scale.shape)}; "
                         "this is not transformers' BitNet layout.")
    scale_value = float(scale.float().reshape(()))
    if not (scale_value > 0 and scale_value < float("inf")):
        raise ValueError(f"BitNet weight_scale must be positive and finite, got {scale_value}.")
    if weight.dim() != 2:
        raise ValueError(f"BitNet weight must be 2-D, got shape {tuple(weight.shape)}.")
    packed_in = weight.dtype in (torch.uint8, torch.int8)
    if packed_in:
        rows = _bitnet_unpack_rows(weight.view(torch.uint8))
        o = int(out_features) if out_features is not None else rows.shape[0]
        if not (rows.shape[0] - 3 <= o <= rows.shape[0]):
            raise ValueError(f"A packed BitNet weight of {weight.shape[0]} stored rows holds {rows.shape[0]} "
                             f"rows, not out_features={o}.")
        codes = rows[:o]
        if bool((codes == 3).any()):
            raise ValueError("BitNet weight has the 2-bit code 3, which is no ternary value (codes are t + 1 "
                             "in {0, 1, 2}); the tensor is not packed the way transformers packs BitNet.")
        t = codes - 1
    elif linear_class == "autobitlinear" and torch.is_floating_point(weight):
        t = weight.float()
        if not bool(((t == -1) | (t == 0) | (t == 1)).all()):
            raise ValueError("This autobitlinear weight is dense but not ternary (values other than -1, 0, 1); "
                             "ternarise it with quantize_ternary instead.")
        if out_features is not None and out_features != t.shape[0]:
            raise ValueError(f"weight has {t.shape[0]} rows, not out_features={out_features}.")
    else:
        raise ValueError(f"A {linear_class!r} BitNet weight must be packed uint8 [out / 4, in]"
                         f"{' or dense ternary' if linear_class == 'autobitlinear' else ''}, got {weight.dtype}.")
    s = 1.0 / scale_value if linear_class == "bitlinear" else scale_value
    if s > _FP16_MAX:
        raise ValueError(f"BitNet scale {s:.3g} does not fit fp16.")
    o, k = t.shape
    scales = torch.full((o, 1), s, dtype=torch.float16, device=weight.device)
    return TernaryWeight(pack_ternary(t.to(torch.int8)), scales, k, k)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile specs (tests/kernels/test_aot_compile.py)
# --------------------------------------------------------------------------------------------------


def _aot_specs() -> list[tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    specs = []
    for out_ty in ("fp16", "bf16"):
        signature = {
            "packed_ptr": "*u8", "scales_ptr": "*fp16", "out_ptr": f"*{out_ty}",
            "n_rows": "i32", "n_cols": "i32", "row_bytes": "i32", "n_groups": "i32", "group_size": "i32",
        }
        constexprs = {"BLOCK_N": _DEQ_BLOCK_N, "BLOCK_K": _DEQ_BLOCK_K, "BF16_BITS": False}
        specs.append((_ternary_dequant_kernel, signature, constexprs, {"num_warps": _DEQ_WARPS}))
    return specs


AOT_SPECS = _aot_specs()
