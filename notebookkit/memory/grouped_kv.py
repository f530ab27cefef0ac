"""Whether the patched attention hands SDPA K and V repeated to every query head.

Grouped-query attention has ``num_kv_heads < num_heads``. PyTorch's SDPA reads grouped K/V
(``enable_gqa=True``) only in its flash kernel: on CUDA that needs compute capability 8.0 or newer,
a 16-bit dtype, a head size of at most 256 and no explicit mask. Anywhere else on CUDA it would fall
back to the math kernel, which materialises the ``T x T`` scores, so the attention repeats K and V to
every query head first and SDPA picks its memory-efficient kernel. SDPA then saves the repeated
copies for backward: ``2 * q_dim`` elements per token instead of ``2 * kv_dim``.

That happens on every CUDA training batch with padding (collators pad rows to the longest one, and
the padding becomes a mask) and on every batch on a T4 (7.5) or in fp32. On CPU the attention always
passes grouped K/V. The attention (:func:`notebookkit.models.patching.patch_attention.attend`) and the memory
model (``estimate_training_memory(kv_repeated=...)``) both read this one rule.
"""

from __future__ import annotations

FLASH_MIN_CAPABILITY = (8, 0)
FLASH_MAX_HEAD_DIM = 256


def sdpa_repeats_kv(*, on_cuda: bool, masked: bool, capability: tuple[int, int], dtype_bytes: int,
                    head_dim: int, grouped: bool = True) -> bool:
    """True when grouped K/V are repeated to every query head before SDPA (module docstring)."""
    if not grouped or not on_cuda:
        return False
    flash = tuple(capability) >= FLASH_MIN_CAPABILITY and dtype_bytes == 2 and head_dim <= FLASH_MAX_HEAD_DIM
    return masked or not flash


__all__ = ["FLASH_MAX_HEAD_DIM", "FLASH_MIN_CAPABILITY", "sdpa_repeats_kv"]
