"""Fused Triton training primitives with hand-derived backward passes.

One op per module, named after its public function, imported from there::

    from notebookkit.kernels.rms_norm import rms_norm
    from notebookkit.kernels.rope import apply_rope
    from notebookkit.kernels.add_rms_norm import add_rms_norm          # decode: residual add + RMSNorm, forward only
    from notebookkit.kernels.rope_cache_write import rope_cache_write  # decode: RoPE + KV-cache write at a device slot
    from notebookkit.kernels.swiglu import swiglu          # geglu: notebookkit.kernels.geglu
    from notebookkit.kernels.cross_entropy import cross_entropy
    from notebookkit.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
    from notebookkit.kernels.nf4 import dequantize_nf4
    from notebookkit.kernels.nf4_matvec import nf4_matvec  # decode: x @ W^T from the NF4 bytes, M <= 16
    from notebookkit.kernels.lora_projection import LoRAProjection
    from notebookkit.kernels.lora_mlp import lora_mlp     # lora_qkv, lora_o likewise
    from notebookkit.kernels.fp8_matmul import fp8_linear  # FP8 base GEMM of a LoRA forward (opt-in)
    from notebookkit.kernels.nf4_fp8 import quantize_nf4_rowwise_fp8  # NF4 -> FP8 in one pass
    from notebookkit.kernels.q2 import quantize_q2         # 2-bit group-wise base (codes, fp16 scale/zero)
    from notebookkit.kernels.q2_matmul import q2_linear    # x @ W^T and its input gradient from the 2-bit codes
    from notebookkit.kernels.low_bit_matvec import low_bit_matvec  # decode of 2-bit and ternary bases, few rows
    from notebookkit.kernels.ternary import quantize_ternary  # {-1, 0, +1} x fp16 scale (BitNet b1.58 style)
    from notebookkit.kernels.ternary_matmul import ternary_linear
    from notebookkit.kernels.moe_experts import moe_expert_mlp  # MoE experts: grouped GEMMs, LoRA on stacked weights

Each module has Triton kernels, a launcher, a ``torch.autograd.Function`` and a plain-PyTorch
``*_reference`` of the same math (the CPU path and the test oracle). CUDA tensors run Triton; CPU
tensors run the reference unless ``runtime.use_triton(True)``. The package deliberately re-exports
nothing: a function re-exported under its module's name would hide the module (``notebookkit.kernels.
cross_entropy`` would stop being the module after the first import), an import-order trap.
"""
