"""The router of a sparse mixture-of-experts block, in fp32: which ``k`` experts a token goes to and with
which weights (the family's rule, :class:`notebookkit.families.MoE`).

With ``z = x R^T + b`` the router logits of one token (``[E]``, in ``x``'s dtype, as the model's own
linear computes them), everything after is fp32:

* ``"softmax_topk"`` (Qwen3-MoE): ``p = softmax(z)``; ``idx`` the ``k`` largest ``p``; ``w = p[idx]``,
  divided by ``sum(w)`` when ``norm_topk_prob``;
* ``"topk_softmax"`` (gpt-oss): ``idx`` the ``k`` largest ``z``; ``w = softmax(z[idx])``.

With ``norm_topk_prob`` the two rules are one function: softmax is monotonic, so the ``k`` largest ``p`` are
those of ``z``, and renormalising over them cancels the full softmax's denominator,
``p_i / sum_{j in idx} p_j = exp(z_i) / sum_{j in idx} exp(z_j)``; the gradient reaches the chosen logits only
either way. So such a router runs the second form: a softmax over ``k`` values, not ``E``, and nothing of size
``[T, E]`` saved for its backward (the values agree to fp32 rounding; only logits that tie in fp32 could
order differently).

Hugging Face rounds ``w`` to the logits' dtype; here ``w`` stays fp32, the dtype the expert kernel
applies it in (:mod:`notebookkit.kernels.moe_experts`). Gradients flow into ``z`` through ``w`` (autograd).
The patched router returns ``(z, w, idx)`` as Hugging Face's does, so the logits it records for the
load-balancing loss (``output_router_logits``) are the same tensor.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from notebookkit.base_layers.rebinding import rebind

RULES = ("softmax_topk", "topk_softmax")


def route(logits: torch.Tensor, top_k: int, rule: str, norm_topk_prob: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w [T, k] fp32, idx [T, k])`` of router ``logits [T, E]`` by ``rule`` (see the module docstring)."""
    if rule == "softmax_topk" and norm_topk_prob:  # the same function as "topk_softmax" (module docstring)
        rule = "topk_softmax"
    if rule == "softmax_topk":
        probs = torch.softmax(logits.float(), dim=-1)
        weights, idx = torch.topk(probs, top_k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, idx
    if rule == "topk_softmax":
        top, idx = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), idx
    raise ValueError(f"Unknown MoE routing rule {rule!r}; notebookkit knows {', '.join(RULES)}.")


def routed(router: nn.Module, hidden_states: torch.Tensor,
           rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(z [T, E], w [T, k] fp32, idx [T, k])`` of a router module (``weight [E, H]``, optional ``bias``,
    ``top_k``, optional ``norm_topk_prob``) for ``hidden_states [..., H]``: the patched router's forward, and
    the decode path's sparse block (:mod:`notebookkit.models.generation.cached_forward`)."""
    x = hidden_states.reshape(-1, router.weight.shape[1])
    logits = F.linear(x, router.weight, getattr(router, "bias", None))
    weights, idx = route(logits, int(router.top_k), rule, bool(getattr(router, "norm_topk_prob", False)))
    return logits, weights, idx


def make_router_forward(rule: str):
    """The patched forward of a router module (``weight [E, H]``, optional ``bias``, ``top_k``)."""

    def router_forward(self: nn.Module, hidden_states: torch.Tensor):
        return routed(self, hidden_states, rule)

    return router_forward


def router_ready(router: Optional[nn.Module], bias: bool) -> Optional[str]:
    """None when ``router`` can be patched (a top-k router with an ``[E, H]`` weight, and a bias when
    the family's router has one: ``bias``), else the reason."""
    if router is None:
        return "no router module"
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not hasattr(router, "top_k"):
        return f"{type(router).__name__} is not a top-k router with an [E, H] weight"
    if isinstance(getattr(router, "bias", None), torch.Tensor) != bias:
        return f"{type(router).__name__} {'lacks' if bias else 'has'} the router bias the family record says"
    return None


def patch_router(router: nn.Module, rule: str) -> None:
    """Rebind one router instance onto :func:`route`."""
    if rule not in RULES:
        raise ValueError(f"Unknown MoE routing rule {rule!r}; notebookkit knows {', '.join(RULES)}.")
    rebind(router, make_router_forward(rule), "moe_router")
