r"""Two per-token statistics of the LM head's logits that TRL's preference trainers log, computed in chunks
of rows under ``torch.no_grad`` (never ``[N, V]`` logits at once)::

    z_t          = softcap(h_t W^T + b) / temperature           (a [V] row)
    mean_logit_t = (1 / V) sum_j z_tj                            (TRL: ``logits/chosen``, ``logits/rejected``)
    is_top1_t    = argmax_j z_tj == y_t                           (TRL: ``mean_token_accuracy``; the first
                                                                   maximum wins a tie, as ``argmax``)

``is_top1`` is False where the label is ``ignore_index``. These are metrics only: no gradient, one
extra LM-head GEMM over the rows asked for (TRL's fused head folds them into its log-prob pass;
:func:`notebookkit.kernels.linear_logprobs.linear_logprobs` keeps its kernels to the log-probs).
"""

from __future__ import annotations

from typing import Optional

import torch

from notebookkit.kernels.fused_linear_cross_entropy import choose_chunk_size, lm_head_compute_dtype

__all__ = ["logit_statistics"]


@torch.no_grad()
def logit_statistics(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, *, softcap: Optional[float] = None,
                     temperature: float = 1.0, ignore_index: int = -100,
                     chunk_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean_logits, is_top1)`` of every row of ``hidden``, shaped like ``labels`` (math: module docstring).

    Args:
        hidden: ``[..., H]`` final hidden states; ``labels``: ``[...]`` already-shifted targets.
        weight, bias: the LM head (``[V, H]``, ``[V]``).
        softcap: final-logit soft-cap (Gemma-2); ``temperature``: divide the logits by it.
        chunk_size: rows per GEMM (``None``: as :func:`linear_logprobs` would choose).

    Returns float32 ``mean_logits`` and bool ``is_top1``.
    """
    vocab, n_hidden = weight.shape
    dtype = lm_head_compute_dtype("logit_statistics", hidden, weight)
    h = hidden.reshape(-1, n_hidden)
    y = labels.reshape(-1).to(h.device)
    n_rows = h.shape[0]
    if chunk_size is None:
        chunk_size = choose_chunk_size(n_rows, vocab, n_hidden, torch.float32, h.device)
    chunk_size = max(1, min(int(chunk_size), max(n_rows, 1)))
    w = weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    mean_logits = torch.empty(n_rows, dtype=torch.float32, device=h.device)
    is_top1 = torch.empty(n_rows, dtype=torch.bool, device=h.device)
    with torch.autocast(h.device.type, enabled=False):
        for start in range(0, n_rows, chunk_size):
            rows = slice(start, min(start + chunk_size, n_rows))
            logits = h[rows].to(dtype) @ w.t()
            if b is not None:
                logits = logits + b
            z = logits.float()
            if softcap is not None:
                z = torch.tanh(z / softcap) * softcap
            z = z / temperature
            mean_logits[rows] = z.mean(-1)
            is_top1[rows] = (z.argmax(-1) == y[rows]) & (y[rows] != ignore_index)
    return mean_logits.view(labels.shape), is_top1.view(labels.shape)
