"""Image prompts on the fast decode path: Hugging Face's forward for the prompt, notebookkit's step for each new token.

``FastVisionModel.for_inference`` binds the same ``model.generate`` as ``FastLanguageModel``
(:mod:`notebookkit.models.generation`): a static KV cache, the decode step on the fused kernels (a
CUDA graph per batch size and cache-length bucket on a GPU), LoRA adapters unmerged. After the
prompt, a vision-language model generates text like its language model, so the decode steps are
the language decoder's alone. Only the prompt differs: its image tokens are the vision tower's
features, not embeddings of ids, and Gemma 3 lets the tokens of one image attend to each other in
both directions. So for a prompt with images :func:`multimodal_prefill` runs the model's own
forward once (vision tower, projector, Hugging Face's masks and positions)::

    logits, past = model(input_ids, attention_mask, position_ids = column - left padding, pixel_values, ...)
    cache[layer][:, :, P - n .. P - 1] = past[layer]      n = P, or the last window - 1 of a sliding layer

and the decode loop continues from its last logits. The generic decode loop knows nothing of images: the
vision loader (and ``FastVisionModel.for_inference``) hand it :func:`multimodal_prefill` as the model's
prompt preparation (:func:`attach_image_prompts`). Qwen2.5-VL places the image tokens on a (t, h, w)
grid of multimodal RoPE positions, which the model computes itself from the image grid (no
``position_ids`` are passed), so the text after an image continues at a per-row offset from its
column, ``rope_deltas`` (Hugging Face's name): a new token in slot ``s`` of row ``b`` sits at position
``s - pad[b] + rope_deltas[b]`` in all three axes, which for text is plain RoPE at that position. The
prefill returns the offsets and every decode step adds them. Keys leave Hugging Face's cache after q/k norm
and RoPE, as the decode step writes them. A sliding-window layer keeps only its last
``window - 1`` keys; they go to the last slots, and the decode step's window mask hides the older,
empty slots.

Where this does not apply (a family listed in ``_NO_FAST_IMAGE_PROMPTS``, ``inputs_embeds`` with images)
the model runs Hugging Face's ``generate`` and says why (:func:`image_prompt_support`). Text-only
prompts run the fast path from the first token.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.nn as nn

from notebookkit.families import for_vision_model_type

from ..generation.generate import Prefill, set_prompt_preparation

__all__ = ["IMAGE_INPUTS", "attach_image_prompts", "describe_image_prompts", "image_prompt_support",
           "multimodal_prefill"]

# What a processor adds to input_ids / attention_mask for images (and the per-token type ids).
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids",
                "mm_token_type_ids")
_TYPE_IDS = ("token_type_ids", "mm_token_type_ids")  # all zeros for a text-only prompt

# Families whose image prompts need positions the decode step does not compute, and why (none today).
_NO_FAST_IMAGE_PROMPTS: dict[str, str] = {}
# Families whose model computes its prompt positions from the image grid and leaves per-row offsets.
_GRID_POSITIONS = frozenset({"qwen2"})


def image_prompt_support(model: nn.Module) -> Optional[str]:
    """``None`` when image prompts to ``model`` (a vision-language wrapper) run the fast decode steps,
    else the reason they run Hugging Face's ``generate``."""
    family = for_vision_model_type(getattr(model.config, "model_type", None))
    if family is None:
        return None
    return _NO_FAST_IMAGE_PROMPTS.get(family.name)


def attach_image_prompts(model: nn.Module) -> None:
    """Make the fast ``model.generate`` (bound by ``for_inference``) split image prompts with :func:`multimodal_prefill`."""
    set_prompt_preparation(model, multimodal_prefill)


def multimodal_prefill(model: nn.Module, kwargs: dict) -> Union[str, tuple[Optional[Prefill], dict]]:
    """Split a ``generate`` call on ``model`` into the prefill to run and the keywords left for the decode path.

    Returns ``(None, kwargs)`` for a text model or a text-only prompt (the type-id keywords of a
    processor dropped when they mark no image token), ``(prefill, kwargs without the image inputs)``
    for an image prompt the decode steps can continue, or the reason it cannot.
    """
    if for_vision_model_type(getattr(model.config, "model_type", None)) is None:
        return None, kwargs
    images = {k: kwargs[k] for k in IMAGE_INPUTS if kwargs.get(k) is not None}
    rest = {k: v for k, v in kwargs.items() if k not in IMAGE_INPUTS}
    has_images = any(k not in _TYPE_IDS for k in images) or any(bool(images[k].any()) for k in _TYPE_IDS if k in images)
    if not has_images:
        return None, rest
    reason = image_prompt_support(model)
    if reason is not None:
        return f"the prompt has images and {reason}"
    if kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds was passed with images"
    family = for_vision_model_type(getattr(model.config, "model_type", None))
    return _hf_prefill(images, grid_positions=family.name in _GRID_POSITIONS), rest


def _hf_prefill(images: dict, grid_positions: bool = False) -> Prefill:
    """The prefill that runs the model's own forward on the prompt and its images (see the module docstring).

    ``grid_positions``: the model computes the prompt's positions from the image grid (Qwen2.5-VL) and the
    prefill returns its ``rope_deltas``; otherwise the positions are the columns minus the left padding."""

    def prefill(model: nn.Module, input_ids: torch.Tensor, cache: Any, start_slot: int,
                pad_lengths: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        batch, prompt = input_ids.shape
        columns = torch.arange(prompt, device=input_ids.device)[None, :]
        attention_mask = (columns >= pad_lengths[:, None]).long()
        positions = {} if grid_positions else {"position_ids": (columns - pad_lengths[:, None]).clamp_min(0)}
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1,
                    **positions, **images)
        past = out["cache"] if "cache" in out else out.get("past_key_values")  # transformers 5.2x / earlier
        for index, (keys, values) in enumerate(_layer_states(past)):
            kept = keys.shape[2]
            cache.write(index, keys.to(cache.dtype), values.to(cache.dtype), start_slot + prompt - kept)
        offsets = _rope_deltas(model, batch) if grid_positions else None
        return out.logits[:, -1], offsets

    return prefill


def _rope_deltas(model: nn.Module, batch: int) -> torch.Tensor:
    """``[B]`` position offsets of the text after the prompt, as the model's forward computed them."""
    # kept on the inner model, where Hugging Face reads it back in its own decode steps
    deltas = next((m.rope_deltas for m in model.modules() if getattr(m, "rope_deltas", None) is not None), None)
    if deltas is None:
        raise ValueError("the model's forward on an image prompt left no rope_deltas: its processor must give "
                         "mm_token_type_ids and image_grid_thw for the multimodal RoPE positions")
    deltas = deltas.reshape(-1).to(torch.long)
    return deltas.expand(batch) if deltas.numel() == 1 else deltas


def _layer_states(past: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(keys, values)`` ``[B, kv_heads, n, head_dim]`` per decoder layer of a Hugging Face cache."""
    if past is None:
        raise ValueError("the model's forward returned no KV cache (use_cache=True was passed)")
    if hasattr(past, "layers"):  # transformers >= 4.56: one cache layer object per decoder layer
        return [(layer.keys, layer.values) for layer in past.layers]
    return list(zip(past.key_cache, past.value_cache))


def describe_image_prompts(model: nn.Module, banner: Any, bound: bool) -> None:
    """The banner's ``image prompts`` line after ``for_inference``: which path generates from a prompt with images."""
    if not bound:
        banner.feature("image prompts", False, "Hugging Face's generate (the fast generation line says why)")
        return
    wrapper = model.get_base_model() if hasattr(model, "get_base_model") else model
    reason = image_prompt_support(wrapper)
    if reason is not None:
        banner.feature("image prompts", False, f"Hugging Face's generate: {reason}; text-only prompts run the fast path")
        return
    banner.feature("image prompts", True, "the prompt by the model's own forward (vision tower, image features, "
                                          "its masks and positions) into the static KV cache, then every new token "
                                          "on the fast decode step (Qwen2.5-VL: at the model's multimodal RoPE "
                                          "offsets)")
