"""Sub-4-bit frozen bases under LoRA (issue 33): 2-bit and ternary projections.

* :mod:`.frozen_linear`: :class:`Q2Linear`, :class:`TernaryLinear`, the frozen layers (packed buffers,
  products through the kernels' autograd functions) that PEFT's default dispatcher wraps with LoRA.
* :mod:`.flags`: which format ``from_pretrained``'s keywords and the checkpoint ask for, and the
  messages for requests that conflict.
* :mod:`.stream_load`: the load itself (a skeleton without weights, then the safetensors files one
  tensor at a time, each projection quantised on the device); pre-quantised and BitNet checkpoints.
* :mod:`.loading`: the step :func:`notebookkit.models.loader.load` calls, and the base format a load
  produced (``record_base_format``).
* :mod:`.merge_guard`: PEFT's merge on these bases refused with what to do instead.
* :mod:`.random_model`: a random-weight model built directly in the packed format (benchmarks at
  shapes whose 16-bit weights cannot exist here).

The fused LoRA path reads these layers in :func:`notebookkit.models.lora_fast_path.projection_view`
(their codes and ``Q2Weight`` / ``TernaryWeight``), and :mod:`notebookkit.kernels.lora_projection` runs
their products through the dequantise-in-the-GEMM kernels.
"""

from .frozen_linear import LOW_BIT_LINEARS, Q2Linear, TernaryLinear, is_low_bit_linear

__all__ = ["Q2Linear", "TernaryLinear", "LOW_BIT_LINEARS", "is_low_bit_linear"]
