"""Gated decoder MLP instances -> fused kernels.

``mlp(x) = down(act(gate(x)) * up(x))`` with ``act`` = SiLU (SwiGLU) or GELU (GeGLU, exact or tanh).

* When gate/up/down are all frozen linears (16-bit or NF4), with or without one active LoRA
  adapter of dropout 0 and no trainable bias, the whole block runs ``kernels.lora_mlp`` (fused
  dequantisation, base + low-rank matmuls, activation and its hand-written backward), frozen biases
  included (Qwen2.5-VL's vision MLPs: one autograd function and one grouped gate/up product, where the
  three projections, three bias adds and the activation were seven).
* While a checkpointed layer recomputes its forward for the backward pass and nothing reads the
  MLP output (the recompute names it: :func:`notebookkit.models.patching.forward_state.unread_output`), the
  fused block skips the down projection. In a layer that parks its gate/up outputs
  (:func:`~notebookkit.models.patching.forward_state.parked_mlp`, the ``"offload_mlp"`` mode), the first
  forward leaves them in host memory and the backward takes them back instead of recomputing them.
* Otherwise (trainable base weights, LoRA dropout, DoRA, 8-bit...) the projections run their own
  modules (stock PEFT / bitsandbytes) and only ``act(e) * g`` runs the fused activation kernel.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from notebookkit.base_layers.kernel_ops import kernel
from notebookkit.base_layers.rebinding import rebind

from . import forward_state
from .lora_fast_path import views


def activation_kernel(activation: str):
    """The fused gate ``fn(e, g) = act(e) * g`` (``e`` the gate projection's output, ``g`` the up
    projection's) for ``activation`` in ``"swiglu"`` (SiLU), ``"geglu"``, ``"geglu_tanh"`` (GELU, exact or
    tanh), or ``None`` when its kernel is missing."""
    if activation == "swiglu":
        fn = kernel("swiglu", "swiglu")
        return None if fn is None else fn
    fn = kernel("geglu", "geglu")
    if fn is None:
        return None
    approximate = "tanh" if activation == "geglu_tanh" else "none"
    return lambda e, g: fn(e, g, approximate=approximate)


def make_mlp_forward(activation: str):
    """The patched forward of a gated MLP with the given fused activation name."""
    act = activation_kernel(activation)
    lora_mlp = kernel("lora_mlp", "lora_mlp")

    def mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if lora_mlp is not None:
            parts, _ = views(self.gate_proj, self.up_proj, self.down_proj)
            if parts is not None:
                biases = tuple(p.bias for p in parts)  # frozen (views refuses trainable ones): a vision tower's MLP
                return lora_mlp(
                    x, parts[0].projection, parts[1].projection, parts[2].projection, activation=activation,
                    compute_output=forward_state.unread_output() is not self, parked=forward_state.parked_mlp(),
                    biases=biases if any(b is not None for b in biases) else None,
                )
        return self.down_proj(act(self.gate_proj(x), self.up_proj(x)))

    return mlp_forward


def mlp_ready(activation: str | None) -> str | None:
    """None when the MLP can be patched for ``activation``, else the reason it cannot."""
    if activation is None:
        return "activation has no fused kernel"
    if activation_kernel(activation) is None:
        module = "swiglu" if activation == "swiglu" else "geglu"
        return f"notebookkit.kernels.{module} is unavailable"
    return None


def patch_mlp(mlp: nn.Module, activation: str) -> None:
    """Rebind one MLP instance (it must have gate_proj, up_proj, down_proj)."""
    rebind(mlp, make_mlp_forward(activation), "mlp")
