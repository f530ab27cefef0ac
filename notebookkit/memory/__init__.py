"""Memory: one memory model (:func:`estimate_training_memory`, generation's share included with
``generation=``: :func:`generation_memory`), the activation planner (:func:`plan_activations`), the
largest LoRA rank a card trains (:func:`largest_lora_rank`), GPU cards and memory-size parsing, and memory meters.

    >>> from notebookkit.memory import estimate_training_memory
    >>> print(estimate_training_memory("meta-llama/Llama-3.1-8B-Instruct", load_in_4bit=True,
    ...                                batch_size=2, seq_len=4096, activation_plan="offload"))
"""

from .cards import CARDS, GPUCard, detect_card, parse_card, parse_memory
from .context import LongestSequence, longest_sequence
from .estimate import (
    MemoryEstimate,
    activation_plan_of,
    estimate_for_model,
    estimate_kwargs_from_model,
    estimate_training_memory,
    layer_activation_bytes,
    lora_param_count,
    normalize_plan,
)
from .export import ExportMemory, export_memory, merge_working_bytes
from .generation import GenerationMemory, generation_bytes, generation_memory, kv_cache_bytes
from .meters import gpu_memory, host_memory, reset_gpu_peak
from .planner import ActivationPlan, DoesNotFitError, plan_activations
from .rank_fit import RankFit, largest_lora_rank
from .shapes import KNOWN_MODELS, ModelShape, model_shape, shape_from_config
from .vision_shapes import KNOWN_VLMS, VisionTowerShape, VLMShape, vlm_shape



def __getattr__(name: str):
    if name in ("HostMemoryError", "PinnedBufferPool"):  # imports torch: load on first use
        from . import offload

        return getattr(offload, name)
    raise AttributeError(f"module 'notebookkit.memory' has no attribute {name!r}")


__all__ = [
    "CARDS", "GPUCard", "detect_card", "parse_card", "parse_memory",
    "MemoryEstimate", "activation_plan_of", "estimate_for_model", "estimate_kwargs_from_model", "estimate_training_memory", "layer_activation_bytes",
    "lora_param_count", "normalize_plan", "HostMemoryError", "PinnedBufferPool",
    "gpu_memory", "host_memory", "reset_gpu_peak", "ExportMemory", "export_memory", "merge_working_bytes",
    "GenerationMemory", "generation_bytes", "generation_memory", "kv_cache_bytes",
    "ActivationPlan", "DoesNotFitError", "plan_activations", "RankFit", "largest_lora_rank", "LongestSequence", "longest_sequence",
    "KNOWN_MODELS", "ModelShape", "model_shape", "shape_from_config",
    "KNOWN_VLMS", "VisionTowerShape", "VLMShape", "vlm_shape",
]
