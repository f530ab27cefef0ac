"""Fused Triton training primitives with hand-derived backward passes.

One op per module; each has Triton kernels, a launcher, a ``torch.autograd.Function`` and a
plain-PyTorch ``*_reference`` of the same math (the CPU path and the test oracle). CUDA tensors run
Triton; CPU tensors run the reference unless ``runtime.use_triton(True)`` (see ``runtime``).
"""

from notebookkit.kernels.cross_entropy import cross_entropy
from notebookkit.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
from notebookkit.kernels.geglu import geglu
from notebookkit.kernels.lora_mlp import lora_mlp
from notebookkit.kernels.lora_o import lora_o
from notebookkit.kernels.lora_projection import LoRAProjection
from notebookkit.kernels.lora_qkv import lora_qkv
from notebookkit.kernels.nf4 import dequantize_nf4
from notebookkit.kernels.rms_norm import rms_norm
from notebookkit.kernels.rope import apply_rope
from notebookkit.kernels.runtime import use_triton
from notebookkit.kernels.swiglu import swiglu

__all__ = [
    "LoRAProjection", "apply_rope", "cross_entropy", "dequantize_nf4", "fused_linear_cross_entropy",
    "geglu", "lora_mlp", "lora_o", "lora_qkv", "rms_norm", "swiglu", "use_triton",
]
