"""notebookkit.models: load Hugging Face causal LMs and run them on the fused kernels.

``FastLanguageModel.from_pretrained`` / ``get_peft_model`` / ``for_inference`` / ``for_training``
are the notebook API (``FastVisionModel``, the same for vision-language models); ``patch_model`` / ``unpatch_model`` patch or restore any loaded model in place.
"""

from __future__ import annotations

from notebookkit.compat import quiet_bitsandbytes_cpu_kernel_notice

quiet_bitsandbytes_cpu_kernel_notice()  # before PEFT imports bitsandbytes (see compat.py)

from .fast_language_model import DEFAULT_TARGET_MODULES, FastLanguageModel
from .fast_vision_model import FastVisionModel
from .patching.patcher import patch_model, patch_summary, unpatch_model

__all__ = ["FastLanguageModel", "FastVisionModel", "DEFAULT_TARGET_MODULES", "patch_model", "unpatch_model",
           "patch_summary"]
