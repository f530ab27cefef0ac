"""The vision tower's share of a VLM training step: weights, its LoRA adapters, its saved activations.

:func:`~notebookkit.memory.estimate.estimate_training_memory` adds these to its parts when the model
is a vision-language model (:mod:`notebookkit.memory.vision_shapes`); the decoder's parts are those
of its text decoder for ``seq_len`` tokens per row, image tokens included. With ``P`` the patches of
all images of the micro-batch (``rows * images_per_row * patches_per_image``), ``T_img`` their image
tokens, ``s`` the compute dtype's bytes and notation as in :mod:`.vision_shapes`:

Weights
    ``load_in_4bit`` quantises every linear layer of the tower and of Qwen2.5-VL's merger to NF4 (the
    loader quantises a VLM as transformers does: every ``nn.Linear`` but the LM head), at the bytes
    per weight of the decoder's projections (and ``load_in_2bit`` / ``load_in_ternary`` are counted by
    the same rule, each linear at its format's bytes for its ``in_features``: :mod:`.base_weights`); the patch embedding, position table, norms, biases and
    Gemma 3's projector matrix stay in ``s``. Qwen2.5-VL's decoder q/k/v biases (``L*(dq + 2*dk)``,
    which the text :class:`~.shapes.ModelShape` leaves out) are added in ``s``.

Adapters (``finetune_vision_layers``)
    LoRA on every attention and MLP linear of the tower's blocks and the merger's two linears
    (Gemma 3's projector is a bare matrix: no adapter), ``sum r*(in+out)``, at the decoder
    adapters' bytes per parameter (weights, gradients, fp32 master copy, optimizer states, casts).

Activations saved for backward (checked tensor by tensor: ``tests/memory/test_vision_memory.py``)
    Without vision adapters nothing in the tower needs a gradient: it saves nothing.
    With them, per patch, in ``s``-byte elements, plus fp32 values:

    Every adapted linear of the tower and the projector runs the LoRA projection kernels
    (:mod:`notebookkit.models.patching.patch_lora_linear`), which keep its input and its rank-space input
    ``s x A^T`` (``r`` per row; stock PEFT would keep ``x A^T`` as well and, with fp32 adapters under a
    16-bit model, an fp32 copy of ``x``); a gated MLP on ``kernels.lora_mlp`` keeps gate and up's, not down's.

    * Qwen2.5-VL block (its attention on :mod:`notebookkit.models.vision.segment_attention`, its MLP on the
      fused ``kernels.lora_mlp`` with its frozen biases): ``10*Hv + 2*Iv``: the two RMSNorms' inputs, the
      normed inputs of ``qkv`` and of gate/up, the ``qkv`` output (V is a view of it), Q and K after RoPE,
      the attention output (which is ``proj``'s input), e and g of the gated MLP (``down``'s input is
      recomputed from them in the backward; until session 33 the three projections ran apart and saved it:
      ``3*Iv``), and ``4*r`` (the rank-space inputs of qkv, proj, gate and up); fp32: two ``1/rms`` and a
      log-sum-exp per head. A window block whose
      windows are not in order of decreasing length (a grid that is not a multiple of the window,
      with more than one row of windows or more than one image) gathers Q, K, V by window length
      and scatters the output back: it saves the gathered Q, K, V and the scattered output instead
      of the ``qkv`` output, Q and K: ``9*Hv`` in place of the ``10*Hv``.
      Once per tower: RoPE's cos/sin, ``2 * Hv/heads`` fp32. The merger: ``3*Hv`` (its norm's
      input, its first linear's input, the GELU's input) and one fp32 ``1/rms`` per patch, and its two
      linears' rank-space inputs, ``2*r`` per merged row (``merge^2`` patches a row).
    * SigLIP block (Gemma 3): ``8*Hv + 2*Iv + 6*r``: the two LayerNorms' inputs, the normed input of
      q/k/v and of fc1, Q, K, V, the attention output, fc1's output (the GELU's input) and fc2's
      input, and its six linears' rank-space inputs; fp32: mean and 1/std of each LayerNorm and a
      log-sum-exp per head; the first block's first LayerNorm saves nothing (its input, the frozen
      patch and position embeddings, needs no gradient). After the blocks: the post-LayerNorm's input (``Hv``, 2 fp32) and the
      average pool's input (``Hv``) per patch, the projector norm's input (``Hv``, 1 fp32) per image
      token (the frozen projector matrix needs no saved input).
    * Gemma 3's decoder: image tokens attend to each other both ways, so the wrapper passes SDPA an
      explicit ``[B, 1, T, T]`` mask in ``s`` (one per attention type, sliding and full, shared by
      the layers of that type), saved while any decoder layer keeps its activations: ``2*B*T^2*s``.

    Checkpointing: when any decoder layer recomputes or offloads, notebookkit turns Hugging Face's
    checkpointing on for the model, and every vision block then keeps only its input (``Hv`` per
    patch; Qwen2.5-VL's cos/sin are recomputed); the merger / projector keep theirs as above.
    These activations live from the start of the forward to the end of the backward, so they add
    to the decoder's activations. The tower's own backward runs after the decoder's, when the
    decoder's activations are freed; its working set is left out.
"""

from __future__ import annotations

from typing import Any

from notebookkit.base_formats import BaseFormat

from .base_weights import linear_weight_bytes
from .vision_shapes import VLMShape


def vision_images(rows: int, images_per_row: int) -> int:
    """Images in one micro-batch."""
    if images_per_row < 0:
        raise ValueError(f"notebookkit.memory: images_per_row must be >= 0 (got {images_per_row}).")
    return rows * images_per_row


def vision_lora_param_count(vlm: VLMShape, r: int) -> int:
    """LoRA parameters on the tower's block linears and the merger: ``sum r*(in+out)``."""
    v = vlm.vision
    block = sum(r * (i + o) for i, o in v.block_linear_shapes().values())
    return v.num_layers * block + sum(r * (i + o) for i, o in v.projector_linear_shapes().values())


def vision_weight_bytes(vlm: VLMShape, s: int, fmt: BaseFormat, double_quant: bool = True) -> dict[str, int]:
    """``{detail: bytes}`` of the tower's weights (its linears in the base format ``fmt``, each at the
    record's bytes per weight for its ``in_features``) and Qwen2.5-VL's decoder biases."""
    v = vlm.vision
    shapes = [*list(v.block_linear_shapes().values()) * v.num_layers, *v.projector_linear_shapes().values()]
    key = "base weights: vision tower linears" + (f" ({fmt.label.split()[0]})" if fmt.quantised else "")
    linear = {key: linear_weight_bytes(shapes, fmt, s, double_quant)}
    out = {**linear, "base weights: vision patch embedding, norms, biases, projector": v.other_params * s}
    if vlm.text_bias_params:
        out["base weights: decoder q/k/v biases"] = vlm.text_bias_params * s
    return out


def vision_activation_bytes(vlm: VLMShape, *, images: int, image_size: Any, s: int,
                            vision_lora: bool, checkpointed: bool, lora_r: int = 16) -> dict[str, int]:
    """``{detail: bytes}`` the tower and projector keep for backward (module docstring), ``lora_r`` the
    tower adapters' rank."""
    if not vision_lora or images == 0:
        return {}
    v = vlm.vision
    patches, tokens = vlm.image_grid(image_size)
    P, T, Hv, Iv = images * patches, images * tokens, v.hidden_size, v.intermediate_size
    if v.kind == "qwen2_5_vl":
        block = P * (s * (10 * Hv + 2 * Iv + 4 * lora_r) + 4 * (2 + v.num_heads))
        lengths = v.window_lengths(image_size) * images
        gathered = any(a < b for a, b in zip(lengths, lengths[1:]))  # windows gathered by length: 9*Hv
        fewer = (v.num_layers - v.full_attention_blocks) * P * Hv * s if gathered else 0
        once = P * 2 * (Hv // v.num_heads) * 4  # RoPE cos / sin, fp32
        after = P * (3 * Hv * s + 4) + 2 * (P // v.merge**2) * lora_r * s
    else:
        block = P * (s * (8 * Hv + 2 * Iv + 6 * lora_r) + 4 * (4 + v.num_heads))
        once = -P * (Hv * s + 8)  # the first LayerNorm reads the frozen embeddings: it saves nothing
        fewer = 0
        after = P * (2 * Hv * s + 8) + T * (Hv * s + 4)
    if checkpointed:
        cos_sin = max(once, 0)
        blocks = {"activations: vision block inputs (checkpointed)": v.num_layers * P * Hv * s + cos_sin}
    else:
        blocks = {"activations: vision blocks (all saved)": v.num_layers * block + once - fewer}
    return {**blocks, "activations: vision merger / projector": after}


def decoder_mask_bytes(vlm: VLMShape, *, rows: int, seq_len: int, s: int, any_kept: bool) -> dict[str, int]:
    """Gemma 3's bidirectional image-attention masks, saved by the kept decoder layers' SDPA (module docstring)."""
    if vlm.vision.kind != "siglip" or not any_kept:
        return {}
    return {"activations: decoder attention masks (image tokens attend both ways)": 2 * rows * seq_len**2 * s}


def check_image_tokens(vlm: VLMShape, seq_len: int, images_per_row: int, image_size: Any) -> int:
    """Image tokens per row; raises when they do not fit in ``seq_len`` (which counts them)."""
    _, tokens = vlm.image_grid(image_size)
    per_row = tokens * images_per_row
    if per_row > seq_len:
        raise ValueError(
            f"notebookkit.memory: {images_per_row} image(s) per row of {vlm.name} are {per_row} image tokens, more "
            f"than seq_len={seq_len}; seq_len counts image tokens too (max_seq_length), so raise it to at least "
            f"{per_row + 32}, or use smaller / fewer images."
        )
    return per_row


def default_image_size(vlm: VLMShape, image_size: Any) -> Any:
    """The image side to estimate with: the one given, the processor's, or 448 (Qwen2.5-VL takes any size)."""
    if image_size is not None:
        return image_size
    return vlm.default_image_size if vlm.default_image_size is not None else 448


__all__ = ["check_image_tokens", "decoder_mask_bytes", "default_image_size", "vision_activation_bytes", "vision_images",
           "vision_lora_param_count", "vision_weight_bytes"]
