"""Something to learn for the large-model loss checks, and how to compare what two runs learned.

With random weights, a 128K vocabulary and uniformly random tokens there is nothing to learn: the
loss of a benchmark run moves 0.1-0.2% (12.1781 -> 12.1627 on the 1B shape), so "final loss within
1% of HF+PEFT" held even for a run whose adapters never updated. These helpers give the runs a
learnable stream and compare the adapters themselves.

``cycle_stream``: a fixed random cycle through ``symbols`` token ids (``t_0 -> t_1 -> ... ->
t_{S-1} -> t_0``); each row walks it from a random start. A model lowers the loss in two stages:
to about ``ln(S)`` by learning which ``S`` tokens occur (fast: every position pushes the same
way), then towards 0 by learning each token's successor. From ``ln(128256) = 11.76`` (about 12.2
at random initialisation) to ``ln(32) = 3.47`` is a 70% fall, so a run that learns shows a clear
drop within a few steps, and one that does not stays flat: every row holds the same tokens, so a
frozen model's loss is the same on every batch.

LoRA comparison: ``lora_B`` starts at zero, so after training ``B`` *is* the update; ``A``'s update
is ``A_final - A_init``. :func:`update_difference` compares two runs' updates (``||d - d_ref|| /
||d_ref||`` pooled over all tensors, their cosine, and the worst tensor): a run whose adapters
never moved is 1.0 away from any run that learned; one that started from other ``A`` values is
about 1.4 away.

The kernels' work does not depend on the token values, so timing a step on this stream measures
the same as on random tokens.
"""

from __future__ import annotations

import math

import torch

__all__ = ["cycle_order", "cycle_stream", "loss_drop", "lora_snapshot", "lora_updates", "update_difference"]


def cycle_order(vocab: int, symbols: int = 32, seed: int = 0, first_id: int = 3) -> torch.Tensor:
    """The cycle: ``symbols`` distinct token ids from ``[first_id, vocab)`` in a seeded random order
    (ids below ``first_id`` are left out: pad / bos / eos in the benchmark tokenizers)."""
    if not 2 <= symbols <= vocab - first_id:
        raise ValueError(f"symbols must be in [2, {vocab - first_id}] for a vocabulary of {vocab}; got {symbols}.")
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab - first_id, generator=gen)[:symbols] + first_id


def cycle_stream(n_batches: int, batch: int, seq: int, vocab: int, symbols: int = 32, seed: int = 0,
                 device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """``n_batches`` token batches ``[batch, seq]``: each row walks :func:`cycle_order` from a random
    start (seeded, so every system of a benchmark sees the same batches)."""
    order = cycle_order(vocab, symbols, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(n_batches):
        starts = torch.randint(0, symbols, (batch, 1), generator=gen)
        out.append(order[(starts + torch.arange(seq)) % symbols].to(device))
    return out


def loss_drop(losses: list[float], window: int = 1) -> float:
    """Fraction by which the loss fell: ``1 - mean(last window) / mean(first window)``."""
    if len(losses) < 2 * window:
        raise ValueError(f"need at least {2 * window} losses for a window of {window}, got {len(losses)}.")
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    return 1.0 - last / first


def lora_snapshot(model: torch.nn.Module, which: tuple[str, ...] = ("lora_A", "lora_B")) -> dict[str, torch.Tensor]:
    """fp32 CPU copies of the model's LoRA matrices (names containing one of ``which``)."""
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()
            if any(key in name for key in which)}


def lora_updates(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``after - before`` per tensor (the same names in both)."""
    if before.keys() != after.keys():
        raise ValueError(f"the snapshots hold different tensors: {sorted(before.keys() ^ after.keys())[:4]} ...")
    return {name: after[name] - before[name] for name in before}


def update_difference(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    """How far ``ours`` (updates or gradients, by tensor name) is from ``ref``.

    Returns ``rel_err = ||ours - ref|| / ||ref||`` over all tensors together, ``cosine`` between the
    two (flattened), the ``worst`` tensor ``(name, rel_err)``, ``ref_norm`` and ``ours_norm``. NaN or
    inf anywhere gives ``rel_err = inf`` and ``cosine = nan`` (never a pass). A reference without
    any movement raises: there is nothing to compare against.
    """
    if ours.keys() != ref.keys() or not ref:
        raise ValueError(f"compare the same tensors: {len(ours)} vs {len(ref)} names, "
                         f"e.g. {sorted(ours.keys() ^ ref.keys())[:4]}")
    names = sorted(ref)
    a = torch.cat([ours[n].double().flatten() for n in names])
    b = torch.cat([ref[n].double().flatten() for n in names])
    ref_norm = b.norm().item()
    if ref_norm == 0:
        raise ValueError("the reference did not move (all updates zero): nothing to compare against.")
    if not torch.isfinite(a).all():
        return dict(rel_err=math.inf, cosine=math.nan, worst=("non-finite", math.inf), ref_norm=ref_norm,
                    ours_norm=math.nan)
    per_tensor = {}
    for n in names:
        r = ref[n].double().norm().item()
        d = (ours[n].double() - ref[n].double()).norm().item()
        per_tensor[n] = d / r if r > 0 else (0.0 if d == 0 else math.inf)
    worst = max(per_tensor.items(), key=lambda kv: kv[1])
    ours_norm = a.norm().item()
    cosine = (a @ b).item() / (ours_norm * ref_norm) if ours_norm > 0 else 0.0
    return dict(rel_err=(a - b).norm().item() / ref_norm, cosine=cosine, worst=worst, ref_norm=ref_norm,
                ours_norm=ours_norm)
