"""The language-model head of a vision-language wrapper -> fused linear cross-entropy in training.

A ``*ForConditionalGeneration`` (Qwen2.5-VL, Gemma 3) runs its backbone ``model.model`` (vision
tower, projector, decoder: image features are scattered into the image placeholders' embeddings)
and then ``lm_head``. With final hidden states ``h`` and labels ``y`` the loss is the causal-LM one::

    loss = sum_{t: y_{t+1} != -100} ( logsumexp(h_t W^T) - (h_t W^T)[y_{t+1}] ) / N

(``N = num_items_in_batch`` when the trainer passes it, else the number of kept labels; soft-capped
logits ``c * tanh(z / c)`` where the config sets a final soft-cap). In training with labels the
patched forward runs the backbone exactly as the stock forward does (every keyword it is given:
``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``, ``token_type_ids``...) and computes the
loss with ``kernels.fused_linear_cross_entropy``, chunk by chunk, without the ``[B*T, V]`` logits;
``logits`` is then ``None``. Every other call (eval mode, generation, no labels, ``return_logits=True``)
runs the model's own forward unchanged, so generation and evaluation are stock Hugging Face code.

The backbone call is one forward pass (:func:`~notebookkit.models.patching.forward_state.forward_pass`):
the fused decoder layers build their LoRA views once and the checkpointing recompute reuses them. A training batch
longer than ``max_seq_length`` raises before anything runs.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.nn as nn

from notebookkit.base_layers.kernel_ops import kernel
from notebookkit.base_layers.rebinding import rebind
from notebookkit.memory.model_setup import record_fused_lm_head

from ..patching.checkpointing import fit_plan_to_batch
from ..patching.forward_state import forward_pass
from ..patching.master_weights import keep_trainable_fp32
from ..patching.patch_lm_head import lm_head_ready, shifted_labels

TAG = "causal_lm"  # the tag the SFT trainer looks for (notebookkit.train.sft.fused_loss_blocker)


def check_training_length(model: nn.Module, seq_len: int) -> None:
    """Refuse a training batch longer than the ``max_seq_length`` the model was loaded with."""
    limit = model.__dict__.get("max_seq_length")
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"This training batch has sequences of {seq_len} tokens (image tokens included), longer than "
            f"max_seq_length={limit} given to FastVisionModel.from_pretrained. Reload the model with "
            f"max_seq_length={seq_len} or more, or use shorter texts or smaller images (each image becomes a "
            "fixed number of tokens, which cannot be truncated)."
        )


def make_vision_lm_forward(model: nn.Module, final_softcap: Optional[float]):
    """The patched forward of a vision-language wrapper ``model`` (backbone ``model.model``, ``lm_head``)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fused_ce = kernel("fused_linear_cross_entropy", "fused_linear_cross_entropy")
    stock_forward = type(model).forward

    def vision_lm_forward(
        self: nn.Module,
        *args: Any,
        labels: Optional[torch.Tensor] = None,
        shift_labels: Optional[torch.Tensor] = None,
        num_items_in_batch: Any = None,
        return_logits: bool = False,
        **kwargs: Any,
    ):
        if self.training and torch.is_grad_enabled():
            keep_trainable_fp32(self)  # fp16: trainable weights (tower adapters too) are fp32 masters
            ids = kwargs.get("input_ids", args[0] if args else None)
            if isinstance(ids, torch.Tensor) and ids.dim() == 2:  # before the tower: its plan is part of it
                # Gemma 3's image tokens attend both ways (token_type_ids): its decoder always gets a mask
                fit_plan_to_batch(self, ids.shape[0], ids.shape[1], kwargs.get("attention_mask"), images_in(kwargs),
                                  explicit_mask=isinstance(kwargs.get("token_type_ids"), torch.Tensor))
        lm_head = self.get_output_embeddings()
        fused = (
            self.training and not args and not return_logits and fused_ce is not None
            and (labels is not None or shift_labels is not None) and isinstance(lm_head, nn.Linear)
        )
        if not fused:
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            if shift_labels is not None:
                kwargs["shift_labels"] = shift_labels
            return stock_forward(self, *args, labels=labels, **kwargs)
        for name in ("logits_to_keep", "return_dict", "ignore_index"):
            kwargs.pop(name, None)
        ref = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if isinstance(ref, torch.Tensor) and ref.dim() >= 2:
            check_training_length(self, ref.shape[1])
        kwargs["use_cache"] = False
        with forward_pass(default_positions=kwargs.get("position_ids") is None, owner=self.model):
            outputs = self.model(**kwargs)
        hidden = outputs[0]
        targets = shift_labels.reshape(-1) if shift_labels is not None else shifted_labels(labels)
        n_items = num_items_in_batch.to(lm_head.weight.device) if isinstance(num_items_in_batch, torch.Tensor) \
            else num_items_in_batch
        flat = hidden.reshape(-1, hidden.shape[-1]).to(lm_head.weight.device)
        loss = fused_ce(flat, lm_head.weight, targets.to(flat.device), bias=lm_head.bias, softcap=final_softcap,
                        n_items=n_items)
        return CausalLMOutputWithPast(loss=loss, logits=None)

    # generate() checks the keywords it is given against the forward's signature: show the stock one
    vision_lm_forward.__signature__ = inspect.signature(stock_forward)
    return vision_lm_forward


def images_in(inputs: dict) -> int:
    """Images in a processor's batch: one ``image_grid_thw`` row each (Qwen2.5-VL, whose ``pixel_values``
    are flattened patches), else the first dimension of 4-D ``pixel_values`` (Gemma 3)."""
    grid, pixels = inputs.get("image_grid_thw"), inputs.get("pixel_values")
    if isinstance(grid, torch.Tensor):
        return int(grid.shape[0])
    return int(pixels.shape[0]) if isinstance(pixels, torch.Tensor) and pixels.dim() == 4 else 0


def vision_head_ready(model: nn.Module) -> Optional[str]:
    """None when the head of ``model`` can be patched, else the reason (the causal-LM head's conditions)."""
    return lm_head_ready(model)


def patch_vision_head(model: nn.Module, final_softcap: Optional[float]) -> None:
    """Rebind the forward of the wrapper ``model`` (reversible:
    :func:`~notebookkit.models.patching.patcher.unpatch_model`)."""
    rebind(model, make_vision_lm_forward(model, final_softcap), TAG)
    record_fused_lm_head(model, True)  # for the memory model: training computes no [N, V] logits


__all__ = ["check_training_length", "images_in", "make_vision_lm_forward", "patch_vision_head", "vision_head_ready"]
