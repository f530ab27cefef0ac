"""The routers' load-balancing loss of a mixture-of-experts model (Switch Transformer's, as Hugging Face
adds it to Qwen3-MoE's and gpt-oss's loss when ``output_router_logits`` is set).

With router logits ``z_l [N, E]`` of every MoE layer ``l`` (``N = B T`` rows), ``m_t`` the attention
mask (1 everywhere without one), ``p = softmax(z)`` in fp32 and ``S_t`` the ``k`` largest ``p`` of a row::

    f_e  = sum_{l, t} m_t [e in S_t] / M           (share of top-k slots sent to expert e)
    P_e  = sum_{l, t} m_t p_{t, e}  / M           (mean router probability of expert e)
    aux  = E sum_e f_e P_e                         M = L sum_t m_t

(``f`` counts ``k`` slots a row, so a perfectly balanced router gives ``aux = k``.) The softmax and
top-k are Hugging Face's for both families, also for gpt-oss, whose router itself keeps the top-k
*logits*. Gradients reach the routers through ``P`` only. The model's loss becomes
``loss + router_aux_loss_coef * aux`` when labels are given.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``aux`` above, a 0-d fp32 tensor, from the per-layer ``router_logits`` (``[B T, E]`` each)."""
    if not router_logits:
        raise ValueError("load_balancing_loss: no router logits (was the model called with output_router_logits=True?)")
    device = router_logits[0].device
    mask = None if attention_mask is None else attention_mask.reshape(-1, 1).to(device, torch.float32)
    slots = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        p = torch.softmax(logits.to(device).float(), dim=-1)
        chosen = torch.nn.functional.one_hot(torch.topk(p, top_k, dim=-1).indices, num_experts).sum(1).float()
        if mask is not None:
            p, chosen = p * mask, chosen * mask
        slots = slots + chosen.sum(0)
        probs = probs + p.sum(0)
        rows = rows + (mask.sum() if mask is not None else p.shape[0])
    return num_experts * torch.sum((slots / rows) * (probs / rows))
