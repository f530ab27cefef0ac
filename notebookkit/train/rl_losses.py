r"""Preference and RL losses (DPO / IPO / Robust DPO, ORPO, GRPO / DAPO / Dr. GRPO) as plain functions of
log-probabilities, with the metrics TRL logs. Exactly TRL 1.16's formulas (the tests compare them with
TRL's own code); the log-probabilities come from :func:`notebookkit.train.token_logprobs.token_logprobs`
(chunked LM head, no ``[B, T, V]`` logits; the reference with adapters disabled).

Signatures (every ``*_logps`` is float32; ``loss`` is a differentiable 0-dim tensor; ``metrics`` maps
TRL's log names to detached 0-dim tensors, read them with ``.item()`` when logging)::

    # notebookkit.train.token_logprobs (where the log-probs come from)
    token_logprobs(model, input_ids [B, T], attention_mask=None [B, T], *, labels=None [B, T],
                   logits_to_keep=0, temperature=1.0, reference=False, position_ids=None,
                   chunk_size=None, return_entropy=False)
        -> [B, T - 1] (or [B, logits_to_keep]) log-probs of the next tokens, 0 where the label is -100

    sequence_logps(per_token_logps [B, T], mask [B, T], average=False) -> [B]

    dpo_loss(chosen_logps [P], rejected_logps [P], ref_chosen_logps [P], ref_rejected_logps [P], *,
             beta=0.1, loss_type="sigmoid" | "ipo" | "robust" | a list of them, loss_weights=None,
             label_smoothing=0.0, chosen_lengths=None [P], rejected_lengths=None [P])
        -> (loss, {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                   "logps/chosen", "logps/rejected"})

    orpo_loss(chosen_logps [P], rejected_logps [P], chosen_nll (), *, beta=0.1)
        -> (loss, {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                   "logps/chosen", "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen"})

    grpo_loss(per_token_logps [B, T], advantages [B] or [B, T], completion_mask [B, T], *,
              old_per_token_logps=None, ref_per_token_logps=None, loss_type="dapo" | "grpo" | "dr_grpo",
              beta=0.0, epsilon_low=0.2, epsilon_high=None, max_completion_length=None,
              num_items_in_batch=None, gradient_accumulation_steps=1, steps_per_generation=None,
              num_processes=1, use_bias_correction_kl=True)
        -> (loss, {"clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean",
                   "clip_ratio/high_max", "clip_ratio/region_mean"} + {"kl"} when beta != 0)

The math (``P`` pairs; ``pi`` the policy, ``ref`` the reference, log-probs summed over the completion)::

    DPO      Delta = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r))
             sigmoid:  -log sigma(beta Delta)
             ipo:      (Delta_avg - 1 / (2 beta))^2      Delta_avg: each side divided by its length
             robust:   (-(1 - eps) log sigma(beta Delta) + eps log sigma(-beta Delta)) / (1 - 2 eps)
             rewards/chosen = beta (log pi(c) - log ref(c)), likewise rejected; loss = mean over pairs

    ORPO     log_odds = (l_c - l_r) - (log(1 - e^{l_c}) - log(1 - e^{l_r}))   l: mean per-token log-probs
             loss = nll(c) - beta * mean(log sigma(log_odds));  rewards/chosen = beta l_c

    GRPO     r_t = exp(logp_t - logp_old_t)   (logp_old = logp.detach() when not given)
             per-token loss = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta k3_t
             k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   (times r_t when use_bias_correction_kl)
             grpo:    mean over sequences of (sum_t loss_t m_t / max(1, sum_t m_t)), / grad-accum steps
             dr_grpo: sum loss_t m_t / (B * max_completion_length), / grad-accum steps
             dapo:    sum loss_t m_t / (max(1, num_items_in_batch) / num_processes * grad-accum / steps_per_generation)

``num_items_in_batch`` is TRL's count of completion tokens over the whole *generation* batch (all
processes, all ``steps_per_generation`` micro-batches), hence the rescale. For evaluation pass
``gradient_accumulation_steps=1`` and ``steps_per_generation=1`` (TRL neither splits nor accumulates
there). Metrics are over this call's batch (TRL also gathers them across processes).

TRL 1.16's ``"sigmoid"`` DPO loss has no label smoothing (``DPOConfig.label_smoothing`` feeds
``"robust"`` and EXO only); :func:`dpo_loss` refuses ``label_smoothing`` with ``"sigmoid"`` rather
than ignore it silently.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

__all__ = ["sequence_logps", "dpo_loss", "orpo_loss", "grpo_loss", "DPO_LOSS_TYPES", "GRPO_LOSS_TYPES"]

DPO_LOSS_TYPES = ("sigmoid", "ipo", "robust")
GRPO_LOSS_TYPES = ("grpo", "dapo", "dr_grpo")

Metrics = dict[str, torch.Tensor]


def sequence_logps(per_token_logps: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Per-sequence log-probability: the sum (``average=True``: the mean) of ``per_token_logps`` over
    the positions where ``mask`` is set. ``[B, T]`` -> ``[B]``. An empty mask averages to 0."""
    if per_token_logps.shape != mask.shape:
        raise ValueError(
            f"per_token_logps has shape {tuple(per_token_logps.shape)} but mask {tuple(mask.shape)}: pass the "
            f"mask of the scored (shifted) positions, one per log-probability."
        )
    m = mask.to(per_token_logps.dtype)
    total = (per_token_logps * m).sum(-1)
    return total / m.sum(-1).clamp(min=1.0) if average else total


def _pair_shapes(**tensors: Optional[torch.Tensor]) -> int:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        listed = ", ".join(f"{k} {v}" for k, v in shapes.items())
        raise ValueError(
            f"Preference losses take one log-probability per pair, all of shape [P]; got {listed}. Sum the "
            f"per-token log-probs per sequence first (sequence_logps) and split the batch into chosen and rejected."
        )
    return next(iter(shapes.values()))[0]


def _reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                    chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> Metrics:
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logps/rejected": rejected_logps.detach().mean(),
    }


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: Union[str, Sequence[str]] = "sigmoid",
    loss_weights: Optional[Sequence[float]] = None,
    label_smoothing: float = 0.0,
    chosen_lengths: Optional[torch.Tensor] = None,
    rejected_lengths: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """DPO loss of TRL 1.16's ``DPOTrainer`` (reverse-KL DPO) on per-sequence log-probabilities.

    Args:
        chosen_logps, rejected_logps: ``[P]`` policy log-probs of each pair's completions (summed over
            the completion tokens; :func:`sequence_logps`). They carry the gradient.
        ref_chosen_logps, ref_rejected_logps: ``[P]`` the same under the reference (adapters off).
        beta: DPO's beta (IPO's tau).
        loss_type: ``"sigmoid"`` (DPO), ``"ipo"``, ``"robust"`` (Robust DPO), or a list of them whose
            means are added with ``loss_weights`` (default 1 each), as TRL does.
        label_smoothing: the label-flip probability of ``"robust"``, in ``[0, 0.5)``.
        chosen_lengths, rejected_lengths: ``[P]`` completion-token counts; ``"ipo"`` needs them (it
            compares per-token averages).

    Returns ``(loss, metrics)``; metrics are TRL's ``rewards/*`` and ``logps/*``.
    """
    _pair_shapes(chosen_logps=chosen_logps, rejected_logps=rejected_logps, ref_chosen_logps=ref_chosen_logps,
                 ref_rejected_logps=ref_rejected_logps, chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = [1.0] * len(types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(types):
        raise ValueError(f"loss_weights has {len(weights)} entries for {len(types)} loss types {types}.")
    unknown = [t for t in types if t not in DPO_LOSS_TYPES]
    if unknown:
        raise ValueError(f"Unknown DPO loss_type {unknown}: notebookkit implements {list(DPO_LOSS_TYPES)}.")
    if label_smoothing and "sigmoid" in types:
        raise ValueError(
            f"label_smoothing={label_smoothing} with loss_type='sigmoid': TRL 1.16's sigmoid DPO loss has no label "
            "smoothing (it would be ignored). Use loss_type='robust' for label-flip smoothing, or label_smoothing=0."
        )
    if "robust" in types and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5) for the 'robust' loss, got {label_smoothing}.")
    if "ipo" in types and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError("loss_type='ipo' needs chosen_lengths and rejected_lengths (completion tokens per sequence).")

    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    loss = chosen_logps.new_zeros(())
    for kind, weight in zip(types, weights):
        if kind == "sigmoid":
            per_pair = -F.logsigmoid(beta * delta)
        elif kind == "ipo":
            avg_delta = (chosen_logratios / chosen_lengths.clamp(min=1.0)
                         - rejected_logratios / rejected_lengths.clamp(min=1.0))
            per_pair = (avg_delta - 1 / (2 * beta)) ** 2
        else:  # robust
            eps = label_smoothing
            per_pair = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
        loss = loss + per_pair.mean() * weight
    metrics = _reward_metrics(beta * chosen_logratios, beta * rejected_logratios, chosen_logps, rejected_logps)
    return loss, metrics


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate on both sides of ``-log 2``."""
    return torch.where(x < -math.log(2.0), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_nll: torch.Tensor,
    *,
    beta: float = 0.1,
) -> tuple[torch.Tensor, Metrics]:
    """ORPO loss of TRL 1.16's ``trl.experimental.orpo.ORPOTrainer``: ``chosen_nll - beta * mean(log sigma(log_odds))``.

    Args:
        chosen_logps, rejected_logps: ``[P]`` **mean** per-token log-probs of each completion
            (``sequence_logps(..., average=True)``; ORPO compares average likelihoods). Must be < 0.
        chosen_nll: scalar negative log-likelihood of the chosen sequences: TRL takes the mean token NLL
            over prompt *and* completion of every chosen sequence (all non-padding tokens after the first).
        beta: ORPO's lambda (TRL's ``ORPOConfig.beta``), the weight of the odds-ratio term.

    Returns ``(loss, metrics)``: TRL's ``rewards/*`` (``beta * mean logp``), ``logps/*``,
    ``nll_loss``, ``log_odds_ratio`` (mean log sigma(log_odds)) and ``log_odds_chosen`` (mean log_odds).
    TRL's ``logits/*`` metrics need full logits and are not produced.
    """
    _pair_shapes(chosen_logps=chosen_logps, rejected_logps=rejected_logps)
    if chosen_nll.dim() != 0:
        raise ValueError(f"chosen_nll must be a scalar (the mean token NLL of the chosen sequences), got shape "
                         f"{tuple(chosen_nll.shape)}.")
    chosen, rejected = chosen_logps.float(), rejected_logps.float()
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    loss = chosen_nll - (beta * ratio).mean()
    metrics = _reward_metrics(beta * chosen, beta * rejected, chosen, rejected)
    metrics.update({
        "nll_loss": chosen_nll.detach(),
        "log_odds_ratio": ratio.detach().mean(),
        "log_odds_chosen": log_odds.detach().mean(),
    })
    return loss, metrics


def _masked_seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(-1) / mask.sum(-1)  # NaN for an empty row, as TRL (nanmin/nanmax skip it)


def _nanmin(x: torch.Tensor) -> torch.Tensor:
    """Smallest non-NaN value (NaN when all are NaN), without a host sync."""
    nan = torch.isnan(x)
    smallest = torch.where(nan, torch.full_like(x, float("inf")), x).min()
    return torch.where(nan.all(), torch.full_like(smallest, float("nan")), smallest)


def _nanmax(x: torch.Tensor) -> torch.Tensor:
    return -_nanmin(-x)


def grpo_loss(
    per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    old_per_token_logps: Optional[torch.Tensor] = None,
    ref_per_token_logps: Optional[torch.Tensor] = None,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    max_completion_length: Optional[int] = None,
    num_items_in_batch: Union[torch.Tensor, int, float, None] = None,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: Optional[int] = None,
    num_processes: int = 1,
    use_bias_correction_kl: bool = True,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped-ratio policy loss of TRL 1.16's ``GRPOTrainer`` (token-level importance sampling).

    Args:
        per_token_logps: ``[B, T]`` policy log-probs of the completion tokens (with gradient).
        advantages: ``[B]`` (one per completion) or ``[B, T]``.
        completion_mask: ``[B, T]`` 1 where a completion token counts (not padding, not after EOS).
        old_per_token_logps: log-probs under the policy that sampled (``None``: ``per_token_logps``
            detached, TRL's on-policy shortcut; the ratio is then 1 and only its gradient acts).
        ref_per_token_logps: reference log-probs, needed when ``beta != 0`` (the k3 KL penalty).
        loss_type: ``"dapo"`` (TRL's default), ``"grpo"`` or ``"dr_grpo"`` (normalisations in the
            module docstring).
        beta: KL coefficient; 0 skips the reference entirely.
        epsilon_low, epsilon_high: clip range ``[1 - epsilon_low, 1 + epsilon_high]``
            (``epsilon_high=None``: ``epsilon_low``).
        max_completion_length: ``"dr_grpo"``'s constant denominator per sequence.
        num_items_in_batch: ``"dapo"``: completion tokens in the whole generation batch (TRL's value).
        gradient_accumulation_steps: micro-batches per optimizer step (TRL's
            ``current_gradient_accumulation_steps``); 1 in evaluation.
        steps_per_generation: ``"dapo"``: micro-batches per generation batch (``None``: the
            accumulation steps, TRL's default); 1 in evaluation.
        num_processes: data-parallel processes (``"dapo"``'s normaliser).
        use_bias_correction_kl: multiply k3 by the importance ratio (TRL 1.16's default, True).

    Returns ``(loss, metrics)``: TRL's ``clip_ratio/*`` and, with ``beta != 0``, ``kl``.
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"Unknown GRPO loss_type {loss_type!r}: notebookkit implements {list(GRPO_LOSS_TYPES)}.")
    if per_token_logps.dim() != 2 or completion_mask.shape != per_token_logps.shape:
        raise ValueError(
            f"per_token_logps and completion_mask must both be [B, T] (one entry per completion token); got "
            f"{tuple(per_token_logps.shape)} and {tuple(completion_mask.shape)}."
        )
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if advantages.shape[0] != per_token_logps.shape[0]:
        raise ValueError(f"advantages has {advantages.shape[0]} rows for {per_token_logps.shape[0]} completions.")
    if beta != 0.0 and ref_per_token_logps is None:
        raise ValueError(f"beta={beta} needs ref_per_token_logps (token_logprobs(..., reference=True)); or set beta=0.")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("loss_type='dr_grpo' divides by max_completion_length: pass GRPOConfig.max_completion_length.")
    if loss_type == "dapo" and num_items_in_batch is None:
        raise ValueError(
            "loss_type='dapo' divides by num_items_in_batch, the completion tokens of the whole generation batch "
            "(all processes and micro-batches); pass it, or completion_mask.sum() for a single micro-batch."
        )
    if epsilon_high is None:
        epsilon_high = epsilon_low
    mask = completion_mask.to(per_token_logps.dtype)
    if old_per_token_logps is None:
        old_per_token_logps = per_token_logps.detach()

    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if beta != 0.0:
        diff = ref_per_token_logps - per_token_logps
        per_token_kl = torch.exp(diff) - diff - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
        per_token_loss = per_token_loss + beta * per_token_kl

    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / gradient_accumulation_steps
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length) / gradient_accumulation_steps
    else:  # dapo
        n_items = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=per_token_logps.device)
        per_generation = gradient_accumulation_steps if steps_per_generation is None else steps_per_generation
        normalizer = n_items.clamp(min=1.0) / num_processes * gradient_accumulation_steps / per_generation
        loss = (per_token_loss * mask).sum() / normalizer

    with torch.no_grad():
        is_low = (coef_1 < 1 - epsilon_low) & (advantages < 0)
        is_high = (coef_1 > 1 + epsilon_high) & (advantages > 0)
        is_region = is_low | is_high
        tokens = mask.sum().clamp(min=1.0)
        metrics: Metrics = {
            "clip_ratio/low_mean": (is_low.float() * mask).sum() / tokens,
            "clip_ratio/low_min": _nanmin(_masked_seq_mean(is_low.float(), mask)),
            "clip_ratio/high_mean": (is_high.float() * mask).sum() / tokens,
            "clip_ratio/high_max": _nanmax(_masked_seq_mean(is_high.float(), mask)),
            "clip_ratio/region_mean": (is_region.float() * mask).sum() / tokens,
        }
        if beta != 0.0:
            metrics["kl"] = (per_token_kl * mask).sum() / tokens
    return loss, metrics
