"""The routers' rules (``notebookkit.models.patching.moe_routing.route``) against Hugging Face's arithmetic, values
and gradients: Qwen3-MoE's ``softmax_topk`` with ``norm_topk_prob`` runs as a softmax over the top-k logits, the
same function as the full softmax renormalised over the chosen experts."""

from __future__ import annotations

import pytest
import torch

from notebookkit.models.patching.moe_routing import route


def _hf_softmax_topk(logits: torch.Tensor, k: int, norm: bool):
    probs = torch.softmax(logits.float(), dim=-1)
    weights, idx = torch.topk(probs, k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True) if norm else weights), idx


@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk_prob", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softmax_topk_is_hugging_faces_values_and_gradient(norm, dtype):
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(37, 24, generator=g)).to(dtype)
    upstream = torch.randn(37, 5, generator=g)
    ours_in, hf_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    w, idx = route(ours_in, 5, "softmax_topk", norm)
    w_hf, idx_hf = _hf_softmax_topk(hf_in, 5, norm)
    assert torch.equal(idx, idx_hf) and w.dtype == torch.float32
    torch.testing.assert_close(w, w_hf, rtol=4e-7, atol=1e-7)
    (w * upstream).sum().backward()
    (w_hf * upstream).sum().backward()
    torch.testing.assert_close(ours_in.grad.float(), hf_in.grad.float(), rtol=1e-5, atol=1e-6)
    if norm:  # the logits not chosen get no gradient, as in Hugging Face's
        chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, idx, True)
        assert torch.count_nonzero(ours_in.grad[~chosen]) == 0
