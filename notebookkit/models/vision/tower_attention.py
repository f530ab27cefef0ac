"""Qwen2.5-VL vision-tower attention -> the RoPE kernel and one SDPA call per segment length.

For the patch rows ``x`` (``[N, C]``) of all images of a batch, with ``H`` heads of width ``d``::

    Q, K, V = split(x W_qkv^T + b_qkv)                  the module's own qkv (NF4 / LoRA as loaded)
    Q, K    = Q * cos + rotate_half(Q) * sin, same K    kernels.apply_rope (2-D patch positions)
    O       = attention within each window / image      models.segment_attention
    y       = O W_proj^T + b_proj                       the module's own proj

That is the stock forward's math (transformers rotates in fp32 and rounds to the input dtype, so
does the kernel). What changes is the attention: the stock code runs one SDPA call per window, in a
Python loop, after reading the window boundaries back to the host in every block.

Every rebinding goes through :mod:`notebookkit.base_layers.rebinding`, so ``unpatch_model`` restores the stock forward.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from notebookkit.base_layers.kernel_ops import kernel, why_missing
from notebookkit.base_layers.rebinding import rebind

from .segment_attention import segment_attention

__all__ = ["patch_segment_attentions", "segment_attention_ready"]


def segment_attention_ready(module: nn.Module) -> Optional[str]:
    """Why ``module`` is not a Qwen2.5-VL-style vision attention this patch can take, or ``None``."""
    if not type(module).__name__.endswith("VisionAttention"):
        return "not a vision attention"
    for name in ("qkv", "proj", "num_heads"):
        if not hasattr(module, name):
            return f"{type(module).__name__} has no {name}"
    return why_missing("rope", "apply_rope")


def _make_forward(apply_rope):
    """The patched forward (module docstring), with the RoPE kernel looked up once, at patch time."""

    def vision_attention_forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        **_: Any,
    ) -> torch.Tensor:
        n_rows = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).view(n_rows, 3, self.num_heads, -1).unbind(1)  # [N, H, d] each
        if position_embeddings is None:  # transformers versions that pass the rotation angles
            angles = torch.cat((rotary_pos_emb, rotary_pos_emb), dim=-1)
            position_embeddings = (angles.cos(), angles.sin())
        cos, sin = position_embeddings
        q, k = apply_rope(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin)
        scale = getattr(self, "scaling", q.shape[-1] ** -0.5)
        out = segment_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v, cu_seqlens, scale)
        return self.proj(out.reshape(n_rows, -1))

    return vision_attention_forward


def patch_segment_attentions(tower: nn.Module) -> int:
    """Rebind every Qwen2.5-VL-style attention in ``tower``; returns how many."""
    forward = _make_forward(kernel("rope", "apply_rope"))
    count = 0
    for module in tower.modules():
        if segment_attention_ready(module) is None:
            rebind(module, forward, "vision_attention")
            count += 1
    return count
