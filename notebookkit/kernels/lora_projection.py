"""One LoRA projection (frozen 16-bit or NF4 base weight + low-rank adapter) and the GEMM helpers
that the LoRA autograd functions (``lora_mlp``, ``lora_qkv``, ``lora_o``) are built from.

The projections that read one input (q/k/v, gate/up, and o alone) run through one dispatch,
:func:`shared_input_forward` and :func:`shared_input_backward`, which groups them where it can (below)
and otherwise runs them one at a time. q/k/v and o are its autograd function as it is
(:func:`shared_input_lora`, three projections or one); ``lora_mlp`` calls it for gate and up inside
its own. The autograd functions take each projection's tensors in one layout
(:class:`ProjectionSlots`: :func:`autograd_tensors`), read which adapter gradients autograd asks for
(:func:`requested_adapter_grads`) and return them (:func:`autograd_tensor_grads`) by it.

For an input ``X [N, in]`` (tokens flattened), base weight ``W [out, in]``, adapter
``A [r, in]``, ``B [out, r]`` and scaling ``s`` (``alpha / r``, or ``alpha / sqrt(r)`` for rsLoRA):

    forward     XA = s (X A^T)                   [N, r], saved for the backward
                Y  = X W^T + XA B^T

    backward    U  = s (dY B)                    [N, r]   (rank order: B A is never formed)
                dX = dY W + U A                  accumulated in place (``addmm_``) into one buffer
                dA = U^T X                       [r, in]
                dB = dY^T XA                     [out, r]

The scaling ``s`` is the ``alpha`` of the GEMM that makes ``XA`` and ``U`` (:func:`scaled_product`: applied in
fp32 before the product's one rounding), never a multiply of its own. ``XA`` costs ``N r`` values a
projection to keep (at r = 16, under 0.2% of what a Llama-3.1-8B layer saves) and spares the backward
its GEMM, which reads all of ``X`` again.

Projections that read the same input (q, k, v; gate and up) and have adapters of one rank share
their rank-space GEMMs (:func:`adapter_group`). With ``A_cat = cat(A_1, ..., A_n)`` ``[n r, in]``
and ``P_i`` owning columns ``i r .. (i+1) r`` of the ``[N, n r]`` products:

    forward     XA_cat[:, P_i] = s_i X A_i^T                    one GEMM instead of n, saved
                Y_i    = X W_i^T + XA_cat[:, P_i] B_i^T         (addmm_, per projection)

    backward    U_cat[:, P_i] = s_i (dY_i B_i)                  written into one [N, n r] buffer
                dX     = sum_i dY_i W_i + U_cat A_cat           one addmm_ for the low-rank part
                dA_cat = U_cat^T X                              one GEMM; dA_i = its rows P_i
                dB_i   = dY_i^T XA_cat[:, P_i]

Why: the products are those of one projection at a time (the rounding can differ in the last
bits, e.g. dX adds the low-rank terms inside one GEMM), with 3 GEMM calls fewer per forward +
backward for each projection of a group after its first (``lora_qkv``: 18 instead of 24;
``lora_mlp``: 22 instead of 25). Each call costs host time however thin its ``[N, r]`` product,
and the GPU of a training step waits part of the step for the host's launches. ``A_cat`` is
built once and kept while no ``A`` changes, like the adapter casts. A group with a projection
without adapter, or with ranks that differ, runs one projection at a time. With adapters in the
compute dtype, the ``dA`` of a group are row blocks of one ``dA_cat`` tensor (no copy).

The base weight is frozen: no gradient is computed for it. An NF4 base weight is dequantised on
the fly (forward and again in backward) with :func:`notebookkit.kernels.nf4.dequantize_nf4`, so the
dense weight never outlives one GEMM. A 2-bit (:class:`~notebookkit.kernels.q2.Q2Weight`) or ternary
(:class:`~notebookkit.kernels.ternary.TernaryWeight`) base is never dequantised whole on this path:
``X W^T`` and ``dY W`` dequantise inside the GEMM for few rows (:mod:`.q2_matmul`, :mod:`.ternary_matmul`)
and a bounded chunk at a time under cuBLAS for many (:mod:`.chunked_dequant_matmul`; :data:`LOW_BIT_PRODUCTS`),
the same products up to the order of the fp32 additions.

FP8 forward (opt-in, ``LoRAProjection(..., fp8_forward=True)``): the base part of the forward,
``X W^T``, is computed in FP8 by :mod:`notebookkit.kernels.fp8_matmul` (X and W quantised
rowwise to FP8 e4m3, one fp32 scale per token and per output channel; ``torch._scaled_mm`` on
sm_89+ GPUs). The low-rank path and the whole backward are unchanged: ``dX = dY W + U A`` and the
adapter gradients use the 16-bit (dequantised) W, as without the flag. Projections that read the
same ``X`` (q/k/v; gate/up), all with the flag and ``K``, each ``O_i`` multiples of 16, share one
product (:func:`grouped_fp8_base_forward`): their weights are quantised into the row blocks of one
FP8 buffer ``[O_total, K]`` and ``Y_cat = diag(s_x) Q_x Q_Wcat^T diag(s_Wcat)`` is one
``torch._scaled_mm`` (host cost ~70 us a call) instead of one per projection; each projection's
output is a column block of ``Y_cat`` (a view, row stride ``O_total``) into which its low-rank term
is added in place.

dtypes: everything is computed in the *compute dtype*, which is the autocast dtype when autocast
is on for the input's device and ``x.dtype`` otherwise. Adapter matrices kept in another dtype
(PEFT keeps them in fp32 under mixed precision) are cast to the compute dtype for the GEMMs, and
their gradients are returned in the adapters' own dtype (as autocast would do). A projection casts
its adapters once and keeps the casts (:meth:`LoRAProjection.adapters`) while neither adapter changes
(their version counters), so the backward, and the recompute when the model layer reuses its
projections (``notebookkit.models.patching.lora_fast_path.views``), cast nothing again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch

from .fp8_matmul import FP8_DTYPE, fp8_matmul_quantized, quantize_rowwise_fp8, scaled_mm_applies_to
from .nf4_fp8 import quantize_nf4_rowwise_fp8
from .nf4 import dequantize_nf4
from .chunked_dequant_matmul import low_bit_matmul, low_bit_matmul_backward_input
from .q2 import Q2Weight, dequantize_q2
from .ternary import TernaryWeight, dequantize_ternary

__all__ = [
    "LoRAProjection",
    "compute_dtype",
    "no_autocast",
    "flatten_tokens",
    "shared_input_forward",
    "shared_input_backward",
    "ProjectionSlots",
    "autograd_tensors",
    "requested_adapter_grads",
    "autograd_tensor_grads",
    "SharedInputLoRAFunction",
    "apply_in_compute_dtype",
    "shared_input_lora",
    "frozen_biases",
    "projection_forward",
    "scaled_product",
    "low_rank_input",
    "lora_rank_grad",
    "accumulate_input_grad_",
    "adapter_grads",
    "quantize_shared_input",
    "fp8_group_applies",
    "grouped_fp8_base_forward",
    "group_base_outputs",
    "AdapterGroup",
    "adapter_group",
    "concat_adapters",
    "grouped_low_rank_input",
    "grouped_projection_forward",
    "grouped_rank_grad",
    "accumulate_grouped_input_grad_",
    "grouped_adapter_grads",
    "projection_reference",
    "LOW_BIT_PRODUCTS",
]

_DENSE_NF4_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: packed low-bit base weight type -> (dequantise(w, dtype), X W^T, dY W): what a projection on such a
#: base computes with (the products dequantise inside the GEMM for few rows, in dense chunks for many:
#: :mod:`.chunked_dequant_matmul`; ``dequantise`` is for references and FP8)
LOW_BIT_PRODUCTS = {
    Q2Weight: (lambda w, dtype: dequantize_q2(w, dtype), low_bit_matmul, low_bit_matmul_backward_input),
    TernaryWeight: (lambda w, dtype: dequantize_ternary(w, dtype), low_bit_matmul, low_bit_matmul_backward_input),
}


@dataclass
class LoRAProjection:
    """A linear layer ``y = x W^T + scaling * (x A^T) B^T`` with a frozen base weight.

    Args:
        weight: the base weight: a dense ``[out, in]`` tensor, or a bitsandbytes NF4 weight
            (``Params4bit`` or its packed uint8 data) together with ``quant_state``, or the packed
            codes of a 2-bit / ternary base together with its ``Q2Weight`` / ``TernaryWeight``.
        quant_state: the NF4 ``QuantState`` (taken from ``weight.quant_state`` when omitted), or the
            :class:`~notebookkit.kernels.q2.Q2Weight` / :class:`~notebookkit.kernels.ternary.TernaryWeight`
            of a low-bit base. ``None`` for a 16-bit base weight.
        lora_A: adapter down-projection ``[r, in]`` (PEFT's ``lora_A[adapter].weight``), or ``None``.
        lora_B: adapter up-projection ``[out, r]`` (PEFT's ``lora_B[adapter].weight``), or ``None``.
        scaling: ``lora_alpha / r`` (or ``lora_alpha / sqrt(r)`` with rsLoRA): PEFT's
            ``scaling[adapter]``.
        fp8_forward: compute the forward's base GEMM ``x W^T`` with FP8 e4m3 operands and rowwise
            scales (:mod:`notebookkit.kernels.fp8_matmul`; an NF4 weight goes to FP8 in one pass,
            :mod:`notebookkit.kernels.nf4_fp8`). The backward is unchanged.

    Only the fast path is covered: no bias, LoRA dropout 0. A layer with a bias or dropout must use
    the ordinary (unfused) module forward.
    """

    weight: torch.Tensor
    quant_state: Any = None
    lora_A: torch.Tensor | None = None
    lora_B: torch.Tensor | None = None
    scaling: float = 1.0
    fp8_forward: bool = False
    # {"A" or "B": (dtype, version of the adapter, its cast to dtype)}: see adapters().
    _adapter_casts: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # (dtype, the group's lora_A tensors, their versions, A_cat): see adapter_group(); kept on the
    # group's first projection.
    _group_cast: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.quant_state is None:
            self.quant_state = getattr(self.weight, "quant_state", None)
        if isinstance(self.weight, torch.nn.Parameter) and self.quant_state is not None:
            self.weight = self.weight.data  # Params4bit -> its packed storage
        if (self.lora_A is None) != (self.lora_B is None):
            raise ValueError(
                "LoRAProjection needs both lora_A and lora_B, or neither (a projection without adapter); "
                f"got lora_A={'None' if self.lora_A is None else tuple(self.lora_A.shape)}, "
                f"lora_B={'None' if self.lora_B is None else tuple(self.lora_B.shape)}."
            )
        if self.quant_state is None and self.weight.dim() != 2:
            raise ValueError(f"A dense base weight must be [out, in], got shape {tuple(self.weight.shape)}.")
        if self.quant_state is not None and len(self.quant_state.shape) != 2:
            raise ValueError(f"The NF4 weight must be a [out, in] matrix, got shape {tuple(self.quant_state.shape)}.")
        if self.lora_A is not None:
            r = self.lora_A.shape[0]
            if tuple(self.lora_A.shape) != (r, self.in_features) or tuple(self.lora_B.shape) != (self.out_features, r):
                raise ValueError(
                    f"Adapter shapes do not fit the base weight [{self.out_features}, {self.in_features}]: "
                    f"lora_A is {tuple(self.lora_A.shape)} (expected [r, {self.in_features}]) and lora_B is "
                    f"{tuple(self.lora_B.shape)} (expected [{self.out_features}, r])."
                )
        self.scaling = float(self.scaling)
        self.fp8_forward = bool(self.fp8_forward)

    @property
    def quantized(self) -> bool:
        """True for a packed base weight (NF4, 2-bit or ternary)."""
        return self.quant_state is not None

    @property
    def low_bit(self) -> bool:
        """True for a 2-bit or ternary base weight (:data:`LOW_BIT_PRODUCTS`)."""
        return type(self.quant_state) in LOW_BIT_PRODUCTS

    @property
    def out_features(self) -> int:
        return int(self.quant_state.shape[0]) if self.quantized else int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.quant_state.shape[1]) if self.quantized else int(self.weight.shape[1])

    @property
    def has_adapter(self) -> bool:
        return self.lora_A is not None

    @property
    def rank(self) -> int:
        return 0 if self.lora_A is None else int(self.lora_A.shape[0])

    def base_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense base weight ``[out, in]`` in ``dtype`` (NF4 is dequantised, fresh each call)."""
        if not self.quantized:
            return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)
        if self.low_bit:
            return LOW_BIT_PRODUCTS[type(self.quant_state)][0](self.quant_state, dtype)
        if dtype in _DENSE_NF4_DTYPES:
            return dequantize_nf4(self.weight, self.quant_state, out_dtype=dtype)
        return dequantize_nf4(self.weight, self.quant_state, out_dtype=torch.float32).to(dtype)

    def base_weight_fp8(
        self, dtype: torch.dtype, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Q_w, s_w)``: the base weight in ``dtype`` quantised rowwise to FP8 e4m3 (NF4 in one pass).

        ``out``: ``(Q_w, s_w)`` buffers to write into (float8_e4m3fn ``[out, in]``, float32
        ``[out, 1]``, contiguous; e.g. this projection's rows of a group's buffer, see
        :func:`grouped_fp8_base_forward`); the bits are the same as without it.
        """
        if self.quantized and not self.low_bit:
            return quantize_nf4_rowwise_fp8(self.weight, self.quant_state, dtype, out=out)
        return quantize_rowwise_fp8(self.base_weight(dtype), out=out)

    def base_product(self, x2d: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``X W^T (+ b)`` ``[N, out]`` in ``x2d``'s dtype: a low-bit base through its dequantise-in-the-GEMM
        kernel, others through the dense (or freshly dequantised NF4) weight, where the frozen ``bias`` (in
        ``x2d``'s dtype) is the GEMM's added input (``addmm``, as ``nn.Linear`` does: no launch of its own)."""
        if self.low_bit:
            y = LOW_BIT_PRODUCTS[type(self.quant_state)][1](x2d, self.quant_state)
            return y if bias is None else y.add_(bias)
        W = self.base_weight(x2d.dtype)
        return x2d @ W.t() if bias is None else torch.addmm(bias, x2d, W.t())

    def add_base_input_grad_(self, dx: torch.Tensor | None, dy: torch.Tensor) -> torch.Tensor:
        """``dX (+)= dY W`` (``dx`` None: a new tensor); a low-bit base through its input-gradient kernel."""
        if self.low_bit:
            g = LOW_BIT_PRODUCTS[type(self.quant_state)][2](dy, self.quant_state)
            return g if dx is None else dx.add_(g)
        W = self.base_weight(dy.dtype)
        if dx is None:
            return dy @ W
        return dx.addmm_(dy, W)

    def adapters(self, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(A, B)`` in the compute dtype (``(None, None)`` without adapter).

        Adapters already in ``dtype`` are returned as they are. Otherwise the casts are made once and
        kept on this projection until an in-place update of ``A`` or ``B`` (an optimizer step) bumps
        its version counter: a forward, its backward and a checkpointing recompute that use the same
        projection share one cast instead of casting again (two launches per adapter saved each time).
        """
        if self.lora_A is None:
            return None, None
        return self._in_dtype("A", self.lora_A, dtype), self._in_dtype("B", self.lora_B, dtype)

    def lora_B_in(self, dtype: torch.dtype) -> torch.Tensor:
        """``B`` alone in the compute dtype, kept like :meth:`adapters` (a grouped projection's ``A``
        is part of its group's ``A_cat``, see :func:`adapter_group`)."""
        return self._in_dtype("B", self.lora_B, dtype)

    def _in_dtype(self, name: str, adapter: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if adapter.dtype == dtype:
            return adapter
        kept = self._adapter_casts.get(name)
        if kept is not None and kept[0] == dtype and kept[1] == adapter._version:
            return kept[2]
        cast = adapter.detach().to(dtype)
        self._adapter_casts[name] = (dtype, adapter._version, cast)
        return cast

    def check_frozen(self) -> None:
        if self.weight.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                "The LoRA fast path treats the base weight as frozen, but this base weight requires grad. "
                "Freeze it (weight.requires_grad_(False), as PEFT does) or use the unfused module forward."
            )


# --------------------------------------------------------------------------------------------------
# dtype / autocast
# --------------------------------------------------------------------------------------------------


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the LoRA GEMMs run in: the autocast dtype when autocast is on, else ``x.dtype``."""
    device_type = x.device.type
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError):  # device type without autocast support
        pass
    return x.dtype


def no_autocast(device_type: str):
    """Context in which autocast is off for ``device_type`` (the functions cast explicitly)."""
    try:
        return torch.autocast(device_type=device_type, enabled=False)
    except RuntimeError:
        return contextlib.nullcontext()


def flatten_tokens(x: torch.Tensor) -> torch.Tensor:
    """``[..., in] -> [N, in]`` (a view when possible)."""
    return x.reshape(-1, x.shape[-1])


# --------------------------------------------------------------------------------------------------
# GEMM helpers (forward and backward of one projection)
# --------------------------------------------------------------------------------------------------


def scaled_product(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling * (a @ b)`` as one GEMM: ``scaling`` is the GEMM's ``alpha`` (fp32, applied before the one
    rounding), not a multiply of its own; at ``scaling == 1`` (``lora_alpha == r``) the plain product."""
    if scaling == 1.0:
        return a @ b
    # beta=0: the empty buffer is not read. (Not mm(out=): that refuses a create_graph backward.)
    return a.new_empty(a.shape[0], b.shape[1]).addmm_(a, b, beta=0, alpha=scaling)


def scale_(t: torch.Tensor, scaling: float) -> torch.Tensor:
    """``t *= scaling`` in place, skipped when ``scaling`` is 1 (no bit changes, one launch fewer): where no GEMM's
    alpha can take it, such as the columns of a group's ``X A_cat^T`` when its projections' scalings differ
    (:func:`grouped_low_rank_input`) and the experts' ``grouped_mm`` weight gradients."""
    return t if scaling == 1.0 else t.mul_(scaling)


def low_rank_input(x2d: torch.Tensor, proj: LoRAProjection, A: torch.Tensor | None) -> torch.Tensor | None:
    """``XA = s (X A^T)`` ``[N, r]`` (``A`` in ``x2d``'s dtype), or None without adapter: what the forward
    multiplies by ``B^T`` and what ``dB = dY^T XA`` reads in the backward (saved by the autograd functions, not
    computed again)."""
    return None if A is None else scaled_product(x2d, A.t(), proj.scaling)


def quantize_shared_input(x2d: torch.Tensor, *projs: LoRAProjection) -> tuple[torch.Tensor, torch.Tensor] | None:
    """FP8 copy ``(q, scale)`` of an input that several projections read, or None when none runs in FP8."""
    if not any(p.fp8_forward for p in projs) or x2d.numel() == 0:
        return None
    return quantize_rowwise_fp8(x2d)


def fp8_group_applies(x2d: torch.Tensor, projs: tuple[LoRAProjection, ...]) -> bool:
    """Whether the FP8 base products of ``projs`` (which all read ``x2d [N, K]``) can run as one
    product (:func:`grouped_fp8_base_forward`).

    Yes when there are at least two projections, all with ``fp8_forward``, all with ``in == K``, their
    base weights on ``x2d``'s device, ``N > 0``, and ``torch._scaled_mm`` applies to each projection's
    shape (:func:`notebookkit.kernels.fp8_matmul.scaled_mm_applies_to`; then it also applies to the
    concatenated ``O_total``). The per-projection rule is asked, not only the concatenated one, so that
    a projection whose own product would be emulated (``O`` not a multiple of 16) keeps that path:
    grouped or not, every projection gets the same kind of product. Otherwise (a projection without
    the flag, another ``K``, an odd shape, ...) each projection runs its own FP8 or 16-bit product.
    """
    if len(projs) < 2 or x2d.shape[0] == 0:
        return False
    K = x2d.shape[1]
    return all(
        p.fp8_forward and p.in_features == K and p.weight.device == x2d.device
        and scaled_mm_applies_to(x2d, p.out_features)
        for p in projs
    )


def grouped_fp8_base_forward(
    x2d: torch.Tensor,
    projs: tuple[LoRAProjection, ...],
    x_fp8: tuple[torch.Tensor, torch.Tensor],
) -> list[torch.Tensor]:
    """The base parts ``X W_i^T`` of projections reading one ``X [N, K]``, from one FP8 product.

    With ``W_cat = [W_1; ...; W_n]`` ``[O_total, K]`` (``O_total = sum O_i``), each ``W_i`` quantised
    rowwise into its own row block of one buffer (the bits of quantising it alone), and
    ``(Q_x, s_x) = x_fp8``::

        Q_Wcat = [Q_W1; ...; Q_Wn]    float8_e4m3fn [O_total, K]      s_Wcat = [s_W1; ...; s_Wn]  fp32 [O_total, 1]
        Y_cat  = diag(s_x) Q_x Q_Wcat^T diag(s_Wcat)                  one torch._scaled_mm, [N, O_total]
        X W_i^T  ~  Y_cat[:, o_i : o_i + O_i]                          o_i = O_1 + ... + O_(i-1)

    Row ``o`` of ``W_cat`` only meets column ``o`` of ``Y_cat``, so each column block is the product
    the projection would get alone (up to the GEMM's blocking of the K sum, which cuBLAS may choose
    differently for another ``O``). The outputs are column-slice *views* of ``Y_cat`` (row stride
    ``O_total``), not copies: the caller adds the LoRA term into them in place (``addmm_``; on CUDA
    cuBLAS takes a row-major output slice with leading dimension ``O_total``, on CPU as well).

    Memory: the group's FP8 weights (``O_total * K`` bytes + ``4 * O_total`` of scales) are alive
    together during the product, instead of one projection's at a time. Preconditions:
    :func:`fp8_group_applies`.
    """
    dtype = x2d.dtype
    device = x2d.device
    sizes = [p.out_features for p in projs]
    total = sum(sizes)
    q_cat = torch.empty((total, x2d.shape[1]), dtype=FP8_DTYPE, device=device)
    scale_cat = torch.empty((total, 1), dtype=torch.float32, device=device)
    start = 0
    for proj, rows in zip(projs, sizes):
        proj.base_weight_fp8(dtype, out=(q_cat[start:start + rows], scale_cat[start:start + rows]))
        start += rows
    y_cat = fp8_matmul_quantized(x_fp8, (q_cat, scale_cat), dtype)
    del q_cat, scale_cat
    outs, start = [], 0
    for rows in sizes:
        outs.append(y_cat[:, start:start + rows])
        start += rows
    return outs


def group_base_outputs(
    x2d: torch.Tensor,
    projs: tuple[LoRAProjection, ...],
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None,
) -> list[torch.Tensor | None]:
    """Per projection: its base part ``X W^T`` from :func:`grouped_fp8_base_forward` when the group's
    FP8 products can be one (:func:`fp8_group_applies`), else ``None`` (the projection computes its
    own base product in :func:`projection_forward`)."""
    if x_fp8 is None or not fp8_group_applies(x2d, projs):
        return [None] * len(projs)
    return grouped_fp8_base_forward(x2d, projs, x_fp8)


def projection_forward(
    x2d: torch.Tensor,
    proj: LoRAProjection,
    xa: torch.Tensor | None,
    B: torch.Tensor | None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    base: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Y = X W^T (+ b) + XA B^T`` for ``X [N, in]``, with ``XA = s (X A^T)`` from :func:`low_rank_input` (None
    without adapter), ``B`` in ``x2d.dtype`` and ``bias`` a frozen bias (:func:`frozen_biases`), added by the
    base GEMM where it is one (:meth:`LoRAProjection.base_product`).

    With ``proj.fp8_forward`` the base part ``X W^T`` runs in FP8 (``fp8_matmul_quantized`` of ``X``
    and ``W`` quantised rowwise; ``x_fp8`` is ``X`` already quantised by
    :func:`quantize_shared_input`); the rest is the same. ``base``: ``X W^T`` already computed (a
    column slice of a group's product, :func:`group_base_outputs`); the low-rank term is added into
    it in place and it is returned.
    """
    bias = None if bias is None else bias.to(x2d.dtype)
    if base is not None or (proj.fp8_forward and x2d.numel()):
        if base is None:
            x_q = x_fp8 if x_fp8 is not None else quantize_rowwise_fp8(x2d)
            base = fp8_matmul_quantized(x_q, proj.base_weight_fp8(x2d.dtype), x2d.dtype)
        y = base if bias is None else base.add_(bias)
    else:
        y = proj.base_product(x2d, bias)
    if xa is not None:
        y.addmm_(xa, B.t())
    return y


def lora_rank_grad(dy: torch.Tensor, proj: LoRAProjection, B: torch.Tensor | None) -> torch.Tensor | None:
    """``U = s (dY B)`` ``[N, r]``, the rank-space gradient shared by dX and dA (None without adapter)."""
    if B is None:
        return None
    return scaled_product(dy, B, proj.scaling)


def accumulate_input_grad_(
    dx: torch.Tensor | None,
    dy: torch.Tensor,
    proj: LoRAProjection,
    u: torch.Tensor | None,
    A: torch.Tensor | None,
) -> torch.Tensor:
    """``dX (+)= dY W + U A`` in place into ``dx`` (allocated by the first call when ``dx`` is None)."""
    dx = proj.add_base_input_grad_(dx, dy)
    if u is not None:
        dx.addmm_(u, A)
    return dx


#: whether ``torch.mm`` writes an fp32 result from 16-bit CUDA operands in one GEMM (``out_dtype``); set False
#: the first time a card refuses it
_FP32_OUT = {"available": hasattr(torch.ops.aten.mm, "dtype")}


def product_in(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` in ``dtype``, an adapter's gradient: 16-bit CUDA operands into an fp32 adapter's gradient in one
    GEMM (``torch.mm``'s ``out_dtype``: the fp32 sum is kept, never rounded to 16 bits, and no cast follows); else
    the product in the operands' dtype, then a cast."""
    if (dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16) and a.is_cuda
            and _FP32_OUT["available"]):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, NotImplementedError):  # a card or build without it: the product, then the cast
            _FP32_OUT["available"] = False
    return (a @ b).to(dtype)


def adapter_grads(
    dy: torch.Tensor,
    inp: torch.Tensor,
    u: torch.Tensor | None,
    proj: LoRAProjection,
    A: torch.Tensor | None,
    need_dA: bool,
    need_dB: bool,
    xa: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``dA = U^T X`` and ``dB = dY^T XA``, returned in the adapters' own dtypes (:func:`product_in`). ``xa``:
    the forward's ``s (X A^T)`` (:func:`low_rank_input`), computed here only when not given (a forward that
    saved none, such as a deferred MLP's down projection, whose input the backward rebuilds)."""
    if u is None:
        return None, None
    dA = dB = None
    if need_dA:
        dA = product_in(u.t(), inp, proj.lora_A.dtype)
    if need_dB:
        if xa is None:
            xa = low_rank_input(inp, proj, A)
        dB = product_in(dy.t(), xa, proj.lora_B.dtype)
    return dA, dB


# --------------------------------------------------------------------------------------------------
# Grouped adapters: projections that read the same input (q/k/v; gate/up)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class AdapterGroup:
    """The adapters of projections sharing one input ``X``, for one rank-space GEMM each way.

    ``A_cat = cat(A_1, ..., A_n)`` ``[n r, in]`` is in the compute dtype; projection ``i`` owns the
    columns ``columns[i]`` of ``X A_cat^T`` and of ``U_cat`` (and the same rows of ``dA_cat``).
    ``Bs`` are the projections' ``B`` in the compute dtype.
    """

    projs: tuple[LoRAProjection, ...]
    A_cat: torch.Tensor
    Bs: tuple[torch.Tensor, ...]
    columns: tuple[slice, ...]


def adapter_group(projs: tuple[LoRAProjection, ...], dtype: torch.dtype) -> AdapterGroup | None:
    """The :class:`AdapterGroup` of ``projs`` in ``dtype``, or None when they cannot be grouped.

    Grouped: at least two projections, each with an adapter, all of the same rank, their ``A`` of one
    dtype and device. Otherwise (a projection without adapter, ranks that differ, ...) the caller
    runs each projection on its own, as :func:`projection_forward` and the per-projection helpers do.

    ``A_cat`` is built once (one ``torch.cat`` into the compute dtype) and kept on the first
    projection until an in-place update of any ``A`` bumps its version counter, as the casts of
    :meth:`LoRAProjection.adapters` are: the forward, the checkpointing recompute and the backward
    of a step share it.
    """
    if len(projs) < 2 or any(not p.has_adapter for p in projs):
        return None
    As = tuple(p.lora_A for p in projs)
    first = As[0]
    if any(A.shape[0] != first.shape[0] or A.dtype != first.dtype or A.device != first.device for A in As):
        return None
    versions = tuple(A._version for A in As)
    kept = projs[0]._group_cast
    if (kept is not None and kept[0] == dtype and kept[2] == versions
            and all(a is b for a, b in zip(kept[1], As))):
        A_cat = kept[3]
    else:
        A_cat = concat_adapters(As, dtype)
        projs[0]._group_cast = (dtype, As, versions, A_cat)
    r = first.shape[0]
    columns = tuple(slice(i * r, (i + 1) * r) for i in range(len(projs)))
    return AdapterGroup(tuple(projs), A_cat, tuple(p.lora_B_in(dtype) for p in projs), columns)


def concat_adapters(As: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """``cat(A_1, ..., A_n)`` along the rank in ``dtype``, written straight into the result."""
    A_cat = torch.empty(sum(A.shape[0] for A in As), As[0].shape[1], dtype=dtype, device=As[0].device)
    return torch.cat([A.detach() for A in As], out=A_cat)


def grouped_low_rank_input(x2d: torch.Tensor, group: AdapterGroup) -> torch.Tensor:
    """``XA_cat = X A_cat^T`` ``[N, n r]`` with column block ``P_i`` scaled by ``s_i``: one GEMM, its alpha the
    scaling when the group's projections share one (the usual case), else each block scaled after it."""
    scalings = {proj.scaling for proj in group.projs}
    if len(scalings) == 1:
        return scaled_product(x2d, group.A_cat.t(), scalings.pop())
    xa_cat = x2d @ group.A_cat.t()
    for proj, cols in zip(group.projs, group.columns):
        scale_(xa_cat[:, cols], proj.scaling)
    return xa_cat


def grouped_projection_forward(
    x2d: torch.Tensor,
    group: AdapterGroup,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    bases: list[torch.Tensor | None] | None = None,
    xa_cat: torch.Tensor | None = None,
    biases: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """``Y_P = X W_P^T + XA_cat[:, P] B_P^T`` for every projection of ``group``, with every ``s_P X A_P^T``
    from one GEMM (``xa_cat``: :func:`grouped_low_rank_input`, computed here when not given; the base part as
    in :func:`projection_forward`, or given in ``bases``, from :func:`group_base_outputs`; ``biases``: the
    projections' frozen biases, or None)."""
    if xa_cat is None:
        xa_cat = grouped_low_rank_input(x2d, group)
    bases = bases if bases is not None else [None] * len(group.projs)
    biases = biases if biases is not None else [None] * len(group.projs)
    return [projection_forward(x2d, proj, xa_cat[:, cols], B, x_fp8, base, bias)
            for proj, B, cols, base, bias in zip(group.projs, group.Bs, group.columns, bases, biases)]


def grouped_rank_grad(dys: list[torch.Tensor], group: AdapterGroup) -> torch.Tensor:
    """``U_cat`` ``[N, n r]``: each ``U_P = s_P (dY_P B_P)`` written into its columns (``s_P`` the GEMM's alpha)."""
    u_cat = dys[0].new_empty(dys[0].shape[0], group.A_cat.shape[0])
    for dy, proj, B, cols in zip(dys, group.projs, group.Bs, group.columns):
        # beta=0: the empty buffer is not read. (Not mm(out=): that refuses a create_graph backward.)
        u_cat[:, cols].addmm_(dy, B, beta=0, alpha=proj.scaling)
    return u_cat


def accumulate_grouped_input_grad_(
    dx: torch.Tensor | None, dys: list[torch.Tensor], group: AdapterGroup, u_cat: torch.Tensor
) -> torch.Tensor:
    """``dX (+)= sum_P dY_P W_P + U_cat A_cat`` in place (the low-rank part in one GEMM)."""
    for dy, proj in zip(dys, group.projs):
        dx = accumulate_input_grad_(dx, dy, proj, None, None)
    return dx.addmm_(u_cat, group.A_cat)


def grouped_adapter_grads(
    dys: list[torch.Tensor],
    inp: torch.Tensor,
    u_cat: torch.Tensor | None,
    group: AdapterGroup,
    need_dA: list[bool],
    need_dB: list[bool],
    xa_cat: torch.Tensor | None = None,
) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """``(dA_P, dB_P)`` for every projection, in the adapters' own dtypes, from GEMMs shared by the group:
    ``dA_cat = U_cat^T X`` (split by rows) and ``dB_P = dY_P^T XA_cat[:, P]``. ``xa_cat``: the forward's
    (:func:`grouped_low_rank_input`), computed here only when not given."""
    a_dtype = group.projs[0].lora_A.dtype  # one dtype for the group's A (adapter_group)
    dA_cat = product_in(u_cat.t(), inp, a_dtype) if any(need_dA) else None
    if any(need_dB) and xa_cat is None:
        xa_cat = grouped_low_rank_input(inp, group)
    grads = []
    for i, (dy, proj, cols) in enumerate(zip(dys, group.projs, group.columns)):
        dA = dA_cat[cols] if need_dA[i] else None  # already in the group's A dtype
        dB = product_in(dy.t(), xa_cat[:, cols], proj.lora_B.dtype) if need_dB[i] else None
        grads.append((dA, dB))
    return grads


# --------------------------------------------------------------------------------------------------
# Shared-input dispatch: what the autograd functions of q/k/v, gate/up and o call
# --------------------------------------------------------------------------------------------------


class ProjectionSlots(NamedTuple):
    """One projection's entries among a LoRA autograd function's inputs, in this order: its tensors
    (:func:`autograd_tensors`), their ``needs_input_grad`` flags (:func:`requested_adapter_grads`) or
    their gradients (:func:`autograd_tensor_grads`)."""

    weight: Any
    lora_A: Any
    lora_B: Any


def autograd_tensors(projs: Sequence[LoRAProjection]) -> list[torch.Tensor | None]:
    """``weight, lora_A, lora_B`` of each projection in turn (:class:`ProjectionSlots`): the tensors a
    LoRA autograd function takes after its other inputs, so that autograd tracks the adapters and
    checks, when the backward unpacks its saved tensors, that none was changed in place."""
    return [t for p in projs for t in ProjectionSlots(p.weight, p.lora_A, p.lora_B)]


def requested_adapter_grads(needs_input_grad: Sequence[bool]) -> tuple[list[bool], list[bool]]:
    """``(need_dA, need_dB)``, one flag per projection, from the ``needs_input_grad`` flags of the
    tensors of :func:`autograd_tensors` (the base weight is frozen: its flag is not read)."""
    width = len(ProjectionSlots._fields)
    slots = [ProjectionSlots(*needs_input_grad[i:i + width]) for i in range(0, len(needs_input_grad), width)]
    return [s.lora_A for s in slots], [s.lora_B for s in slots]


def autograd_tensor_grads(
    adapter_grads: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]],
) -> list[torch.Tensor | None]:
    """The gradients of the tensors of :func:`autograd_tensors` from each projection's ``(dA, dB)``:
    ``None`` for the frozen base weight."""
    return [g for dA, dB in adapter_grads for g in ProjectionSlots(None, dA, dB)]


def shared_input_forward(
    x2d: torch.Tensor, projs: Sequence[LoRAProjection], biases: Sequence[torch.Tensor | None] | None = None,
) -> tuple[list[torch.Tensor], AdapterGroup | None, list[torch.Tensor | None]]:
    """``Y_i = X W_i^T (+ b_i) + s_i (X A_i^T) B_i^T`` for projections that all read ``X [N, in]``, in
    ``x2d``'s dtype (the compute dtype); ``biases``: one frozen bias a projection (or None), which the base
    GEMM adds (:meth:`LoRAProjection.base_product`).

    The projections are run together where they can be: with FP8 forward, ``X`` is quantised once
    (:func:`quantize_shared_input`) and the base products are one FP8 product when
    :func:`fp8_group_applies`; adapters of one rank share ``X A_cat^T`` (:func:`adapter_group`,
    :func:`grouped_projection_forward`). Otherwise each projection runs :func:`projection_forward`
    (a single projection, ``o``, is the case of one). Returns ``(outputs [N, out_i], group, low_rank)``:
    the adapter group (``None`` when the projections ran one at a time) and the rank-space inputs
    ``s_i X A_i^T`` (``[XA_cat]`` with a group, else one per projection, ``None`` without adapter), which
    :func:`shared_input_backward` takes (saved, so the backward does not compute them again).
    """
    projs = tuple(projs)
    dtype = x2d.dtype
    x_fp8 = quantize_shared_input(x2d, *projs)
    bases = group_base_outputs(x2d, projs, x_fp8)
    group = adapter_group(projs, dtype)
    biases = biases if biases is not None else [None] * len(projs)
    if group is not None:
        xa_cat = grouped_low_rank_input(x2d, group)
        return grouped_projection_forward(x2d, group, x_fp8, bases, xa_cat, biases), group, [xa_cat]
    ys, low_rank = [], []
    for proj, base, bias in zip(projs, bases, biases):
        A, B = proj.adapters(dtype)
        xa = low_rank_input(x2d, proj, A)
        ys.append(projection_forward(x2d, proj, xa, B, x_fp8, base, bias))
        low_rank.append(xa)
    return ys, None, low_rank


def shared_input_backward(
    dys: Sequence[torch.Tensor],
    x2d: torch.Tensor,
    projs: Sequence[LoRAProjection],
    group: AdapterGroup | None,
    need_dx: bool,
    need_dA: Sequence[bool],
    need_dB: Sequence[bool],
    low_rank: Sequence[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor | None, list[tuple[torch.Tensor | None, torch.Tensor | None]]]:
    """The backward of :func:`shared_input_forward`: with ``U_i = s_i (dY_i B_i)`` ``[N, r]`` and the
    forward's ``XA_i = s_i X A_i^T``::

        dX   = sum_i (dY_i W_i + U_i A_i)      (one buffer, addmm_; each W re-dequantised just before use)
        dA_i = U_i^T X  = s_i (dY_i B_i)^T X
        dB_i = dY_i^T XA_i

    ``dys``: the output gradients ``[N, out_i]`` in ``x2d``'s dtype; ``group`` and ``low_rank``: what the
    forward returned (with a group, the rank-space products are one GEMM each, see :class:`AdapterGroup`;
    ``low_rank`` None: the rank-space inputs are computed again); ``need_dA`` / ``need_dB``: one flag per
    projection. Returns ``dX`` (``None`` unless ``need_dx``) and ``(dA_i, dB_i)`` per projection in the
    adapters' own dtypes (``None`` where not asked or without adapter).
    """
    if group is not None:
        u_cat = grouped_rank_grad(dys, group) if need_dx or any(need_dA) else None
        adapter_grad_pairs = grouped_adapter_grads(dys, x2d, u_cat, group, need_dA, need_dB,
                                                   low_rank[0] if low_rank else None)
        dx = accumulate_grouped_input_grad_(None, dys, group, u_cat) if need_dx else None
        return dx, adapter_grad_pairs
    dx, adapter_grad_pairs = None, []
    for i, (proj, dy, dA_needed, dB_needed) in enumerate(zip(projs, dys, need_dA, need_dB)):
        A, B = proj.adapters(x2d.dtype)
        u = lora_rank_grad(dy, proj, B)
        adapter_grad_pairs.append(adapter_grads(dy, x2d, u, proj, A, dA_needed, dB_needed,
                                                low_rank[i] if low_rank else None))
        if need_dx:
            dx = accumulate_input_grad_(dx, dy, proj, u, A)
    return dx, adapter_grad_pairs


class SharedInputLoRAFunction(torch.autograd.Function):
    """Autograd function of :func:`shared_input_lora` (q/k/v, and o alone): inputs ``x, projs, biases,
    *autograd_tensors(projs)``; outputs one tensor per projection. Saves ``x`` and the rank-space inputs
    ``s X A^T`` (``[N, r]`` each, ``[N, n r]`` for a group); the frozen biases change nothing in the backward."""

    @staticmethod
    def forward(ctx, x, projs, biases, *tensors):
        ys, group, low_rank = shared_input_forward(flatten_tokens(x), projs, biases)
        ctx.save_for_backward(x, *low_rank, *tensors)
        ctx.low_rank_count = len(low_rank)
        ctx.projs = projs  # the same projections in backward: their adapter casts are reused
        ctx.group = group  # and the same A_cat
        return tuple(y.view(*x.shape[:-1], y.shape[-1]) for y in ys)

    @staticmethod
    def backward(ctx, *grads):
        x, *rest = ctx.saved_tensors  # unpacked also to check that no saved tensor changed in place
        low_rank = rest[:ctx.low_rank_count]
        need_dx, _, _, *tensor_needs = ctx.needs_input_grad  # x, projs, biases, *autograd_tensors(projs)
        need_dA, need_dB = requested_adapter_grads(tensor_needs)
        with no_autocast(x.device.type):
            dys = [flatten_tokens(g).to(x.dtype) for g in grads]
            dx, adapter_grad_pairs = shared_input_backward(
                dys, flatten_tokens(x), ctx.projs, ctx.group, need_dx, need_dA, need_dB, low_rank
            )
        return (dx.view(x.shape) if dx is not None else None), None, None, \
            *autograd_tensor_grads(adapter_grad_pairs)


def apply_in_compute_dtype(
    function: type[torch.autograd.Function] | Callable[..., Any], x: torch.Tensor,
    projs: tuple[LoRAProjection, ...], *args: Any
) -> Any:
    """``function.apply(x, projs, *args, *autograd_tensors(projs))``, the entry of a LoRA autograd
    function (or ``function(...)`` for a plain function, such as a forward without autograd): after
    checking that every base weight is frozen, with ``x`` cast to the compute dtype
    (:func:`compute_dtype`) and autocast off (the functions cast explicitly)."""
    for p in projs:
        p.check_frozen()
    dtype = compute_dtype(x)
    if x.dtype != dtype:
        x = x.to(dtype)
    call = function.apply if isinstance(function, type) else function
    with no_autocast(x.device.type):
        return call(x, projs, *args, *autograd_tensors(projs))


def shared_input_lora(x: torch.Tensor, projs: Sequence[LoRAProjection],
                      biases: Sequence[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, ...]:
    """``x W_i^T (+ b_i) + s_i (x A_i^T) B_i^T`` for projections that all read ``x [..., in]``, with autograd.

    Returns one ``[..., out_i]`` tensor per projection in the compute dtype (the autocast dtype if
    autocast is on, else ``x.dtype``). Gradients flow to ``x`` and to every ``lora_A`` / ``lora_B``
    (:func:`shared_input_backward`); base weights are frozen, and so are the ``biases`` (one a projection, or
    None: a vision tower's linears have them), which the base GEMMs add. ``lora_qkv`` and ``lora_o`` are this
    function with three projections and with one.
    """
    projs = tuple(projs)
    return apply_in_compute_dtype(SharedInputLoRAFunction, x, projs, frozen_biases(biases, projs, "shared_input_lora"))


def frozen_biases(biases: Sequence[torch.Tensor | None] | None, projs: Sequence[LoRAProjection], who: str,
                  names: Sequence[str] | None = None) -> tuple[torch.Tensor | None, ...]:
    """``biases`` as one entry a projection (``None`` for none), checked: frozen, each of its projection's
    ``out_features`` (``names`` name the projections in the messages)."""
    if biases is None:
        return (None,) * len(projs)
    names = names or [f"projection {i}" for i in range(len(projs))]
    if len(biases) != len(projs):
        raise ValueError(f"{who}: biases are ({', '.join(f'b_{n}' for n in names)}), got {len(biases)} of them.")
    for name, bias, proj in zip(names, biases, projs):
        if bias is None:
            continue
        if bias.requires_grad:
            raise ValueError(f"{who}: the {name} bias requires grad, but the fused path adds frozen biases only; "
                             "freeze it (bias='none' in LoraConfig) or run the layer's own modules.")
        if tuple(bias.shape) != (proj.out_features,):
            raise ValueError(f"{who}: the {name} bias has shape {tuple(bias.shape)}, expected "
                             f"({proj.out_features},).")
    return tuple(biases)


# --------------------------------------------------------------------------------------------------
# Reference (plain PyTorch autograd)
# --------------------------------------------------------------------------------------------------


def projection_reference(x: torch.Tensor, proj: LoRAProjection) -> torch.Tensor:
    """Plain-autograd ``x W^T + s (x A^T) B^T`` in ``x.dtype`` (the base weight gets no gradient)."""
    W = proj.base_weight(x.dtype).detach()
    y = torch.nn.functional.linear(x, W)
    if proj.has_adapter:
        xa = torch.nn.functional.linear(x, proj.lora_A.to(x.dtype))
        y = y + proj.scaling * torch.nn.functional.linear(xa, proj.lora_B.to(x.dtype))
    return y
