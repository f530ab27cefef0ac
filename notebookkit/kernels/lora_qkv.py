"""LoRA q/k/v projections sharing one input, as one autograd function
(:class:`notebookkit.kernels.lora_projection.SharedInputLoRAFunction`, which ``lora_o`` runs with one
projection).

For ``P`` in ``{q, k, v}`` with base ``W_P``, adapter ``A_P [r, in]``, ``B_P [out_P, r]``, scaling ``s_P``,
and ``A_cat = cat(A_q, A_k, A_v)`` ``[3r, in]`` (built once, kept while no ``A`` changes) whose
columns ``P`` of a ``[N, 3r]`` product belong to projection ``P``:

    forward     XA_cat[:, P] = s_P X A_P^T                         one GEMM for the three adapters
                P  = X W_P^T + XA_cat[:, P] B_P^T                  (saves X and XA_cat; A_cat and the
                                                                    casts are reused)

    backward    U_cat[:, P] = s_P (dP B_P)                         [N, 3r], one buffer
                dX  = dQ W_q + dK W_k + dV W_v + U_cat A_cat
                      (one buffer, accumulated with addmm_; each W re-dequantised just before use)
                dA_cat = U_cat^T X                                 one GEMM, split by rows into dA_P
                dB_P = dP^T XA_cat[:, P]

Why: three times, three thin GEMM calls become one (``X A^T``, ``U A``, ``U^T X``): 18 GEMM calls per
forward + backward instead of 24, so fewer host launches per layer (see
:mod:`notebookkit.kernels.lora_projection`). When a projection has no adapter or the ranks differ, each
projection runs alone: ``XA_P = s_P X A_P^T`` (saved), ``P = X W_P^T + XA_P B_P^T``, ``U_P = s_P dP B_P``,
``dX += dP W_P + U_P A_P``, ``dA_P = U_P^T X``, ``dB_P = dP^T XA_P``.
Both ways are the shared-input dispatch of gate/up and o as well
(:func:`notebookkit.kernels.lora_projection.shared_input_forward` and ``shared_input_backward``).

FP8 forward (every projection with ``fp8_forward``, ``K`` and each ``out_P`` multiples of 16): the
three base products are one ``torch._scaled_mm`` of the FP8 ``X`` with ``[Q_Wq; Q_Wk; Q_Wv]``
(:func:`notebookkit.kernels.lora_projection.grouped_fp8_base_forward`), and Q, K, V are column
slices of its ``[N, out_q + out_k + out_v]`` output (views, row stride ``out_q + out_k + out_v``:
not contiguous). The attention code views them as heads and passes them to the RoPE kernel, which
takes any strides with a unit last stride; V is copied to its own storage before SDPA saves it
(a saved view would keep the whole product alive, see ``patch_attention``).

Base weights (16-bit or NF4) are frozen; ``B A`` is never formed. See
:mod:`notebookkit.kernels.lora_projection` for the dtype rules.
"""

from __future__ import annotations

import torch

from .lora_projection import LoRAProjection, projection_reference, shared_input_lora

__all__ = ["lora_qkv", "lora_qkv_reference"]


def lora_qkv(
    x: torch.Tensor, q: LoRAProjection, k: LoRAProjection, v: LoRAProjection,
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value projections with LoRA, sharing the input ``x [..., hidden]``.

    Each projection is ``x W^T (+ b) + s (x A^T) B^T`` (16-bit or NF4 base; adapter optional per
    projection; ``biases``: frozen ``(b_q, b_k, b_v)``, any of them None, as Qwen2's, added by the base
    GEMMs). Returns ``(Q, K, V)`` shaped ``[..., out_q]``, ``[..., out_k]``, ``[..., out_v]``
    in the compute dtype (autocast dtype if autocast is on, else ``x.dtype``). Gradients flow to
    ``x`` and to every ``lora_A`` / ``lora_B``; base weights and biases are frozen.
    """
    return shared_input_lora(x, (q, k, v), biases)


def lora_qkv_reference(
    x: torch.Tensor, q: LoRAProjection, k: LoRAProjection, v: LoRAProjection
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain PyTorch autograd composition of :func:`lora_qkv` (the test oracle)."""
    return projection_reference(x, q), projection_reference(x, k), projection_reference(x, v)
