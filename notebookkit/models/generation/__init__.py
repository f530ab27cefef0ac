"""The decode path behind ``FastLanguageModel.for_inference``: ``model.generate`` on a static KV cache.

* :mod:`.static_cache`: pre-allocated keys and values per layer, kept between calls;
* :mod:`.decoder_plan`: what the forward reads from the model and its family record, once;
* :mod:`.cached_forward`: one forward over the cache, for the prompt and for each decode step;
* :mod:`.cache_attention` and :mod:`.projections`: its attention (slot mask, soft-cap, sliding
  windows) and its LoRA projections (adapters unmerged, NF4 matrix-vector kernel when present);
* :mod:`.graph_runner`: the decode step captured as a CUDA graph per key and replayed;
* :mod:`.generate`: the loop with Hugging Face's arguments, a model's own prompt preparation
  (:func:`set_prompt_preparation`: a vision-language model's image prompts), and the fall-back to
  Hugging Face's ``generate`` for what it does not implement;
* :mod:`.sampling`: the logits filters and the choice of the next token, on the device;
* :mod:`.state`: what a model keeps between calls, and :func:`release` to free it.
"""

from __future__ import annotations

from .cached_forward import cached_forward
from .generate import bind_generate, describe_generation, generate, is_bound, set_prompt_preparation, unbind_generate
from .state import generation_state, release
from .static_cache import StaticKVCache, kv_cache_bytes

__all__ = [
    "StaticKVCache",
    "bind_generate",
    "cached_forward",
    "describe_generation",
    "generate",
    "generation_state",
    "is_bound",
    "kv_cache_bytes",
    "release",
    "set_prompt_preparation",
    "unbind_generate",
]
