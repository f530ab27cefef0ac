"""The frozen low-bit linear layers: a 2-bit (:class:`Q2Linear`) and a ternary (:class:`TernaryLinear`)
base projection, ``y = x W^T + b`` with ``W`` held packed (buffers, not parameters: nothing to train).

Both run their product through the kernels' autograd function
(:func:`notebookkit.kernels.chunked_dequant_matmul.low_bit_product`): the forward dequantises inside the GEMM
(few rows) or a bounded chunk at a time under cuBLAS (many rows on a GPU), and the backward ``dx = dy W``
reads the codes again, so gradients reach the input (and through it every
LoRA adapter below) while no dense ``W`` outlives one product.

Why a subclass of ``nn.Linear`` (and not ``LoraConfig._register_custom_module``): PEFT's default
dispatcher wraps any ``nn.Linear`` in its own ``lora.Linear``, whose forward is ``base_layer(x)`` plus
the adapter; so *every* caller of ``peft.get_peft_model`` -- ours, TRL's trainers given a
``peft_config``, a user's own ``LoraConfig`` with ``target_modules="all-linear"`` -- wraps these layers
with no registration on its config, and PEFT's source stays as it is. What PEFT reads of the base layer
is public: ``in_features`` / ``out_features``, a ``weight`` (``None`` here: there is no dense one) or
``qweight`` for the device the adapters go to (the packed codes, uint8, so the adapters' dtype is not
taken from them), and ``compute_dtype`` for the adapters' dtype (bitsandbytes' 4-bit layers have the
same attribute). PEFT's ``merge`` needs a dense weight and raises here; merged export dequantises the
base itself (:meth:`_LowBitLinear.dequantized_weight`, in fp32 on the merging device).

Dtypes: the packed codes are uint8 and the scales (and zeros) fp16 by the formats' definition; a
``model.to(torch.bfloat16)`` / ``model.half()`` must not round them, so :meth:`_LowBitLinear._apply`
keeps their dtype and moves only their device. The bias (rare in these families: Qwen2's q/k/v) is a
frozen parameter in the model's dtype. ``state_dict`` holds ``qweight``, ``scale`` (+ ``zero`` for
2-bit) and ``bias``: what a pre-quantised checkpoint holds
(:mod:`notebookkit.models.low_bit.stream_load` reloads it).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from notebookkit.kernels.q2 import DEFAULT_GROUP_SIZE, Q2Weight, check_group_size, dequantize_q2, quantize_q2
from notebookkit.kernels.chunked_dequant_matmul import low_bit_product
from notebookkit.kernels.ternary import TernaryWeight, dequantize_ternary, quantize_ternary

__all__ = ["Q2Linear", "TernaryLinear", "LOW_BIT_LINEARS", "is_low_bit_linear"]


class _LowBitLinear(nn.Linear):
    """What the two frozen low-bit layers share: no dense weight, fixed-dtype packed buffers, and a
    product and a decode through their format's kernels (``_product``, ``_dequantize``)."""

    base_format: str = ""
    _FIXED_DTYPE: tuple[str, ...] = ()
    _product: Callable[..., torch.Tensor]  # (x, packed weight) -> x W^T, with its input gradient
    _dequantize: Callable[..., torch.Tensor]  # (packed weight, dtype) -> the dense W

    def _init_common(self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype,
                     device: Any) -> None:
        nn.Module.__init__(self)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.compute_dtype = compute_dtype
        self.register_parameter("weight", None)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:  # nn.Linear's init: nothing to draw, the base is frozen
        return None

    def _apply(self, fn, recurse: bool = True):
        kept = {name: self._buffers[name] for name in self._FIXED_DTYPE if self._buffers.get(name) is not None}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype != before.dtype:
                self._buffers[name] = before.to(after.device)
        return self

    def _check_fits(self, what: str, shape: Any, group_size: int) -> None:
        """Refuse packed tensors whose shape or group size is not this layer's, naming both."""
        if tuple(shape) != (self.out_features, self.in_features) or group_size != self.group_size:
            raise ValueError(f"A {what} weight {tuple(shape)} with groups of {group_size} does not fit this "
                             f"layer [{self.out_features}, {self.in_features}] with groups of {self.group_size}.")

    def _bias_added(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            x = x.to(self.compute_dtype)
        return x

    def dequantized_weight(self, dtype: Optional[torch.dtype] = None, device: Any = None) -> torch.Tensor:
        """The dense ``[out, in]`` weight the codes stand for (a new tensor; for export and tests), decoded
        on ``device`` (default: the layer's): the packed tensors move there, not the dense result."""
        packed = self.packed_weight()
        if device is not None:
            packed = packed.to(device)
        return self._dequantize(packed, dtype or self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._bias_added(self._product(self._input(x), self.packed_weight()))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.base_format}, group_size={self.group_size}")


class Q2Linear(_LowBitLinear):
    """A frozen 2-bit linear layer (:mod:`notebookkit.kernels.q2`): ``y = x dequant(W)^T + b``.

    ``W[n, k] = (code(n, k) - zero[n, k // G]) * scale[n, k // G]``; buffers ``qweight`` uint8 ``[N, K/4]``,
    ``scale`` and ``zero`` fp16 ``[N, K/G]``. Build one with :meth:`from_linear` (quantises a dense layer)
    or empty (then ``load_state_dict`` / assign the packed tensors).
    """

    base_format = "2bit"
    _FIXED_DTYPE = ("scale", "zero")
    _product = staticmethod(low_bit_product)
    _dequantize = staticmethod(dequantize_q2)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int = DEFAULT_GROUP_SIZE,
                 compute_dtype: torch.dtype = torch.float16, device: Any = None) -> None:
        self._init_common(in_features, out_features, bias, compute_dtype, device)
        self.group_size = check_group_size(group_size, int(in_features))
        n, k, g = self.out_features, self.in_features, self.group_size
        self.register_buffer("qweight", torch.zeros((n, k // 4), dtype=torch.uint8, device=device))
        self.register_buffer("scale", torch.zeros((n, k // g), dtype=torch.float16, device=device))
        self.register_buffer("zero", torch.zeros((n, k // g), dtype=torch.float16, device=device))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    group_size: int = DEFAULT_GROUP_SIZE, compute_dtype: Optional[torch.dtype] = None) -> "Q2Linear":
        """Quantise a dense ``weight [out, in]`` (least-squares fit, :func:`~notebookkit.kernels.q2.quantize_q2`)
        on its device into a new layer there."""
        out_features, in_features = weight.shape
        dtype = compute_dtype or weight.dtype
        module = cls(in_features, out_features, bias is not None, group_size, dtype, device="meta")
        module.set_packed(quantize_q2(weight.detach(), group_size))
        if bias is not None:
            module.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        return module

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE) -> "Q2Linear":
        """A 2-bit copy of a dense ``nn.Linear`` (on the linear's device, computing in its dtype)."""
        return cls.from_weight(linear.weight, linear.bias, group_size)

    def set_packed(self, q: Q2Weight) -> None:
        """Take the packed tensors of ``q`` (shape and group size must be this layer's)."""
        self._check_fits("Q2", q.shape, q.group_size)
        self._buffers["qweight"], self._buffers["scale"], self._buffers["zero"] = q.codes, q.scale, q.zero

    def packed_weight(self) -> Q2Weight:
        """The layer's weight as a :class:`~notebookkit.kernels.q2.Q2Weight` (views of the buffers)."""
        return Q2Weight(self.qweight, self.scale, self.zero, (self.out_features, self.in_features),
                        self.group_size, self.compute_dtype)



class TernaryLinear(_LowBitLinear):
    """A frozen ternary linear layer (:mod:`notebookkit.kernels.ternary`): ``y = x W^T + b``,
    ``W[o, k] = s[o, k // G] * t[o, k]``, ``t`` in {-1, 0, +1}.

    Buffers: ``qweight`` uint8 ``[O, ceil(K/4)]`` (code ``t + 1``, four a byte along ``K``) and ``scale``
    fp16 ``[O, ceil(K/G)]`` (one a row by default, ``G = K``).
    """

    base_format = "ternary"
    _FIXED_DTYPE = ("scale",)
    _product = staticmethod(low_bit_product)
    _dequantize = staticmethod(dequantize_ternary)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: Optional[int] = None,
                 compute_dtype: torch.dtype = torch.float16, device: Any = None) -> None:
        self._init_common(in_features, out_features, bias, compute_dtype, device)
        k = self.in_features
        self.group_size = int(group_size or k)
        self.register_buffer("qweight", torch.full((self.out_features, -(-k // 4)), 0x55, dtype=torch.uint8,
                                                   device=device))  # 0x55: four codes 1, i.e. zeros
        self.register_buffer("scale", torch.zeros((self.out_features, -(-k // self.group_size)), dtype=torch.float16,
                                                  device=device))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    compute_dtype: Optional[torch.dtype] = None, **quantize: Any) -> "TernaryLinear":
        """Ternarise a dense ``weight [out, in]`` (:func:`~notebookkit.kernels.ternary.quantize_ternary`:
        per-row scales, four least-squares refits by default) into a new layer on its device."""
        t = quantize_ternary(weight.detach(), **quantize)
        return cls.from_packed(t, bias, compute_dtype or weight.dtype)

    @classmethod
    def from_packed(cls, t: TernaryWeight, bias: Optional[torch.Tensor] = None,
                    compute_dtype: torch.dtype = torch.float16) -> "TernaryLinear":
        """A layer around an existing :class:`~notebookkit.kernels.ternary.TernaryWeight` (e.g. from
        :func:`~notebookkit.kernels.ternary.ternary_from_bitnet`)."""
        module = cls(t.in_features, t.out_features, bias is not None, t.group_size, compute_dtype, device="meta")
        module.set_packed(t)
        if bias is not None:
            module.bias = nn.Parameter(bias.detach().to(compute_dtype), requires_grad=False)
        return module

    @classmethod
    def from_linear(cls, linear: nn.Linear, **quantize: Any) -> "TernaryLinear":
        """A ternary copy of a dense ``nn.Linear``."""
        return cls.from_weight(linear.weight, linear.bias, **quantize)

    def set_packed(self, t: TernaryWeight) -> None:
        """Take the packed tensors of ``t`` (shape and group size must be this layer's)."""
        self._check_fits("ternary", t.shape, t.group_size)
        self._buffers["qweight"], self._buffers["scale"] = t.packed, t.scales

    def packed_weight(self) -> TernaryWeight:
        """The layer's weight as a :class:`~notebookkit.kernels.ternary.TernaryWeight` (views of the buffers)."""
        return TernaryWeight(self.qweight, self.scale, self.in_features, self.group_size)



#: base format name (``notebookkit.base_formats``) -> its frozen layer class
LOW_BIT_LINEARS: dict[str, type[_LowBitLinear]] = {"2bit": Q2Linear, "ternary": TernaryLinear}


def is_low_bit_linear(module: Any) -> bool:
    """True for a :class:`Q2Linear` or :class:`TernaryLinear`."""
    return isinstance(module, _LowBitLinear)
