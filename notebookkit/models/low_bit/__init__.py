"""Sub-4-bit frozen bases under LoRA (issue 33): loading a model onto 2-bit and ternary projections.

The layers themselves, ``Q2Linear`` and ``TernaryLinear`` (packed buffers, products through the kernels'
autograd functions, wrapped with LoRA by PEFT's default dispatcher), are
:mod:`notebookkit.base_layers.low_bit_linear`: export reads them too. Here:

* :mod:`.flags`: which format ``from_pretrained``'s keywords and the checkpoint ask for, and the
  messages for requests that conflict.
* :mod:`.stream_load`: the load itself (a skeleton without weights, then the safetensors files one
  tensor at a time, each projection quantised on the device); pre-quantised and BitNet checkpoints.
* :mod:`.loading`: the step :func:`notebookkit.models.loading.loader.load` calls, and the base format a load
  produced (``record_base_format``).
* :mod:`.merge_guard`: PEFT's merge on these bases refused with what to do instead.
* :mod:`.random_model`: a random-weight model built directly in the packed format (benchmarks at
  shapes whose 16-bit weights cannot exist here).

The fused LoRA path reads these layers in :func:`notebookkit.models.patching.lora_fast_path.projection_view`
(their codes and ``Q2Weight`` / ``TernaryWeight``), and :mod:`notebookkit.kernels.lora_projection` runs
their products through the dequantise-in-the-GEMM kernels.
"""
