r"""Per-token log-probabilities of a sequence's own tokens under a (patched, LoRA) causal LM, for DPO,
ORPO and GRPO: the model's backbone, then :func:`notebookkit.kernels.linear_logprobs.linear_logprobs`
on ``lm_head.weight`` (chunked: never ``[B, T, V]`` logits), with the family's final-logit soft-cap
and an optional sampling temperature::

    h = backbone(input_ids)                         [B, T, H]
    logp[b, t] = log softmax(softcap(h[b, t] W^T) / temperature)[input_ids[b, t + 1]]

Position ``t`` scores the next token, so a sequence of ``T`` tokens gives ``T - 1`` log-probs (the
last ``logits_to_keep`` of them when asked, e.g. GRPO's completion tokens). Positions whose label is
``-100`` (padding where ``attention_mask`` is 0, or a prompt masked in ``labels``, as TRL's DPO does) give 0
and never reach the LM head: only the scored rows of ``h`` go into the chunks.

The reference policy of DPO / GRPO is the same weights with the LoRA adapters switched off
(``reference=True``: PEFT's ``disable_adapter()`` context and ``torch.no_grad()``), so no second copy
of the model exists.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Union

import torch
import torch.nn as nn

from notebookkit.kernels.linear_logprobs import linear_logprobs
from notebookkit.models.common.architectures import final_softcap, lookup, text_config
from notebookkit.train.logit_statistics import logit_statistics

__all__ = ["token_logprobs", "causal_lm_parts"]

IGNORE_INDEX = -100


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module, Optional[float]]:
    """``(backbone, lm_head, final_softcap)`` of a causal LM or of a PEFT model wrapping one."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    prefix = getattr(causal_lm, "base_model_prefix", "model")
    backbone = getattr(causal_lm, prefix, None)
    lm_head = causal_lm.get_output_embeddings() if hasattr(causal_lm, "get_output_embeddings") else None
    if not isinstance(backbone, nn.Module) or not isinstance(lm_head, nn.Linear):
        raise TypeError(
            f"token_logprobs needs a causal LM with a backbone (.{prefix}) and a linear lm_head, as loaded by "
            f"FastLanguageModel.from_pretrained; got {type(causal_lm).__name__}."
        )
    config = causal_lm.config
    spec = lookup(config)
    cap = final_softcap(config, spec) if spec is not None else getattr(text_config(config), "final_logit_softcapping", None)
    return backbone, lm_head, (float(cap) if cap else None)


def _reference_context(model: nn.Module):
    if not hasattr(model, "disable_adapter"):
        raise ValueError(
            f"reference=True scores with the LoRA adapters switched off, but {type(model).__name__} has no adapters. "
            "Call FastLanguageModel.get_peft_model(model, ...) first, or score the reference with a separate model."
        )
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    stack.enter_context(model.disable_adapter())
    return stack


def _into_rows(values: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` zeros with ``values`` (one per ``True`` of ``scored``, in row-major order) at the scored places."""
    return values.new_zeros(scored.shape).masked_scatter(scored, values)


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    labels: Optional[torch.Tensor] = None,
    logits_to_keep: int = 0,
    temperature: float = 1.0,
    reference: bool = False,
    position_ids: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    return_entropy: bool = False,
    return_logit_stats: bool = False,
) -> Union[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Log-probability of every next token of ``input_ids`` under ``model``, without full logits.

    Args:
        model: a causal LM from ``FastLanguageModel`` (usually after ``get_peft_model``).
        input_ids: ``[B, T]`` token ids (prompt + completion; left or right padding).
        attention_mask: ``[B, T]``; 0 marks padding, whose positions get no log-prob.
        labels: ``[B, T]`` unshifted targets with ``-100`` where nothing is scored (default:
            ``input_ids`` with padding masked). TRL's DPO masks the prompt this way.
        logits_to_keep: ``0`` scores all ``T - 1`` next tokens; ``K > 0`` only the last ``K`` tokens
            (``input_ids[:, -K:]``, GRPO's completions), skipping the prompt's LM-head work.
        temperature: divide the logits by the sampling temperature (GRPO scores what it sampled).
        reference: score with the adapters disabled and without gradient (the DPO / GRPO reference).
        position_ids: passed to the backbone (``None``: its default positions, as TRL does).
        chunk_size: rows per LM-head chunk (``None``: chosen from memory).
        return_entropy: also return each position's entropy (no gradient).
        return_logit_stats: also return each position's mean logit over the vocabulary and whether
            its label is the top-1 token (:mod:`notebookkit.train.logit_statistics`; no gradient, one
            more chunked LM-head GEMM): the ``logits/*`` and ``mean_token_accuracy`` metrics of TRL.

    Returns:
        float32 ``[B, T - 1]`` (or ``[B, K]``) log-probs, 0 where the label is ``-100``; with
        ``return_entropy=True`` also the entropies, and with ``return_logit_stats=True`` also the mean
        logits (float32) and the top-1 flags (bool), all of the same shape, in that order.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}.")
    n_tokens = input_ids.shape[1]
    if not 0 <= logits_to_keep < n_tokens:
        raise ValueError(
            f"logits_to_keep={logits_to_keep} for sequences of {n_tokens} tokens: it must be below the length "
            "(the first token has no prediction); 0 scores every next token."
        )
    if labels is None:
        labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    elif labels.shape != input_ids.shape:
        raise ValueError(f"labels has shape {tuple(labels.shape)} but input_ids {tuple(input_ids.shape)}: give one "
                         "(unshifted) label per token, -100 where nothing is scored.")
    backbone, lm_head, softcap = causal_lm_parts(model)
    keep = logits_to_keep if logits_to_keep else n_tokens - 1
    context = _reference_context(model) if reference else contextlib.nullcontext()
    with context:
        outputs = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        weight = lm_head.weight
        hidden = outputs[0][:, -keep - 1:-1].to(weight.device)
        targets = labels[:, -keep:].to(weight.device)
        scored = targets != IGNORE_INDEX
        n_scored = int(scored.sum())
        if 0 < n_scored < scored.numel():  # prompt / padding positions: no LM-head work for them at all
            picked = linear_logprobs(
                hidden[scored], weight, targets[scored], lm_head.bias, softcap=softcap, temperature=temperature,
                chunk_size=chunk_size, return_entropy=return_entropy,
            )
            scores = tuple(_into_rows(v, scored) for v in picked) if return_entropy else _into_rows(picked, scored)
        else:
            scores = linear_logprobs(
                hidden, weight, targets, lm_head.bias, softcap=softcap, temperature=temperature,
                chunk_size=chunk_size, return_entropy=return_entropy,
            )
        if not return_logit_stats:
            return scores
        stats = logit_statistics(hidden.detach(), weight.detach(), targets, lm_head.bias, softcap=softcap,
                                 temperature=temperature, chunk_size=chunk_size)
        return (*(scores if return_entropy else (scores,)), *stats)
