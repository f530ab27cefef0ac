"""Causal-LM head instance -> fused linear cross-entropy in training.

With labels ``y`` and final hidden states ``h`` (``[B, T, H]``), the next-token loss is::

    z_t  = h_t W^T                       (optionally z_t = c * tanh(z_t / c): Gemma2 final soft-cap)
    loss = sum_{t: y_{t+1} != -100} ( logsumexp(z_t) - z_t[y_{t+1}] ) / N

where ``N = num_items_in_batch`` when the trainer passes it (so gradient accumulation over uneven
micro-batches equals one big batch), else the number of non-ignored labels. In training the
``kernels.fused_linear_cross_entropy`` computes this chunk by chunk and returns the gradient with
respect to ``h`` (and ``W`` if trainable) without ever holding the ``[B*T, V]`` logits.

Contract of the patched forward (documented for trainers):

* ``model.train()`` and ``labels`` given: ``loss`` is set and ``logits`` is ``None`` (never the full
  logits). Hugging Face ``Trainer`` reads ``outputs.loss`` only. Pass ``return_logits=True`` to
  the forward, or call it in eval mode, to get both.
* otherwise: ``logits`` are returned for the positions selected by ``logits_to_keep`` (``0`` = all),
  and ``loss`` is computed from them when ``labels`` are given.
* ``shift_labels`` (already shifted labels) is honoured like in ``transformers``.
* A mixture-of-experts model (``moe=True``) with ``output_router_logits`` (the argument or the
  config's) gets the routers' load-balancing loss as Hugging Face adds it
  (:mod:`.router_aux_loss`): ``aux_loss`` and ``router_logits`` in the output, and
  ``loss + router_aux_loss_coef * aux_loss`` when labels are given (``aux_loss_weight=`` replaces the
  coefficient: TRL's SFT weighs the loss by its own coefficient over the accumulation steps).
* In training, a batch longer than the ``max_seq_length`` given at load time raises a ``ValueError``
  that says how to fix it (checked in the backbone, so trainers that run their own LM head, like
  TRL's chunked one, are covered too); in inference it warns once.

TRL (1.15, 1.16): its trainers never read ``outputs.loss``. At construction ``SFTTrainer``,
``DPOTrainer``, ``GRPOTrainer`` (and KTO / RLOO) call ``trl.trainer.utils.add_fused_lm_head``,
which wraps ``model.forward``: a call with ``fused_lm_head=True`` runs the backbone
(``model.base_model``) and TRL's own chunked log-prob function on ``lm_head.weight`` (per-token
log-probs, entropy, top-1 flags; no full logits either), and never reaches this forward; other
calls pass through to it. The trainers need those per-token values (DPO / GRPO sum them per
sequence), which a scalar fused loss cannot give, so only SFT can use this head:
``notebookkit.train.sft.FastSFTTrainer`` (what ``make_sft_trainer`` builds) calls the model with
``labels`` and ``num_items_in_batch`` and so runs the fused cross-entropy. :func:`describe_lm_head`
writes this into the banner.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from notebookkit.base_layers.kernel_ops import kernel
from notebookkit.base_layers.rebinding import WeakOwner, rebind
from notebookkit.marks import ALL_ATTENTION_PATCHED, LM_HEAD_OWNER, ROUTER_LOSS_HEAD, WARNED_LENGTH
from notebookkit.memory.model_setup import record_fused_lm_head

from .checkpointing import fit_plan_to_batch
from .forward_state import forward_pass
from .master_weights import keep_trainable_fp32
from .patch_attention import plain_causal_mask
from .router_aux_loss import load_balancing_loss


def _cache_kwarg(base_model: nn.Module) -> str:
    try:
        params = inspect.signature(type(base_model).forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


def _output_cache_field(output_cls: type) -> str:
    fields = getattr(output_cls, "__dataclass_fields__", {})
    return "cache" if "cache" in fields and "past_key_values" not in fields else "past_key_values"


def _keep(hidden: torch.Tensor, logits_to_keep: Any) -> torch.Tensor:
    if isinstance(logits_to_keep, int):
        return hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:, :]
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.dim() == 1:
        return hidden[:, logits_to_keep, :]
    try:
        from transformers.modeling_utils import slice_logits_to_keep

        return slice_logits_to_keep(hidden, logits_to_keep)
    except ImportError:
        return hidden[:, logits_to_keep, :]


def _softcap(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _check_length(model: nn.Module, seq_len: int, training: bool) -> None:
    limit = model.__dict__.get("max_seq_length")
    if limit is None or seq_len <= limit:
        return
    if training:
        raise ValueError(
            f"This training batch has sequences of {seq_len} tokens, longer than max_seq_length={limit} "
            "given to FastLanguageModel.from_pretrained. Either truncate the data (for TRL: "
            f"SFTConfig(max_length={limit}) / DPOConfig(max_length={limit})) or reload the model with "
            f"max_seq_length={seq_len} or more."
        )
    if not model.__dict__.get(WARNED_LENGTH):
        object.__setattr__(model, WARNED_LENGTH, True)
        warnings.warn(
            f"Input of {seq_len} tokens is longer than max_seq_length={limit}; results past that length "
            "depend on how the model extrapolates.",
            stacklevel=3,
        )


def owner_of(backbone: nn.Module) -> Optional[nn.Module]:
    """The causal LM whose patched head owns ``backbone`` (``None`` when not patched or gone)."""
    holder = backbone.__dict__.get(LM_HEAD_OWNER)
    if isinstance(holder, WeakOwner):
        return holder()
    return holder if isinstance(holder, nn.Module) else None


def backbone_forward(self: nn.Module, *args: Any, **kwargs: Any):
    """Backbone forward that checks the batch length against ``max_seq_length`` first.

    Trainers that compute the loss themselves (TRL's chunked LM head) call the backbone directly,
    so the check lives here rather than in the causal-LM forward. The owning causal LM (which holds
    ``max_seq_length``) is found through a weak reference (:func:`owner_of`), so the model has no
    reference cycle and ``copy.deepcopy`` maps it to the copy.

    A training forward of an fp16 model first makes every trainable parameter an fp32 master weight
    (:mod:`.master_weights`: one rule for every trainer, whenever it made a parameter trainable).

    Each call is one forward pass (:func:`~.forward_state.forward_pass`, held per thread): the fused
    layers build their LoRA views once and the checkpointing recompute reuses them, and when the
    caller passes no ``position_ids`` the attention layers take the ones Hugging Face makes as plain
    positions (no packed rows) without a host sync. When the mask is plain causal (no attention
    mask, positions or cache from the caller, every attention layer patched; :func:`plainly_causal`),
    the backbone passes :func:`~.patch_attention.plain_causal_mask` as the attention mask, so Hugging
    Face builds no mask at all: that removes the last host sync of a training step. Nothing shared
    (the config, a module-level flag) changes, so forwards on other threads, or nested in this one,
    are unaffected.
    """
    ref = kwargs.get("input_ids", args[0] if args else None)
    if ref is None:
        ref = kwargs.get("inputs_embeds")
    owner = owner_of(self)
    if owner is not None and isinstance(ref, torch.Tensor) and ref.dim() >= 2:
        _check_length(owner, ref.shape[1], self.training)
    if self.training and torch.is_grad_enabled():
        keep_trainable_fp32(self if owner is None else owner)  # fp16: trainable weights are fp32 masters
        if owner is not None and isinstance(ref, torch.Tensor) and ref.dim() >= 2:
            # an "auto" plan sized for a smaller batch, or for one without padding
            fit_plan_to_batch(owner, ref.shape[0], ref.shape[1], kwargs.get("attention_mask"))
    # position_ids is the third positional parameter of the backbones' forward.
    caller_gave_positions = kwargs.get("position_ids") is not None or len(args) >= 3
    if not caller_gave_positions and plainly_causal(self, args, kwargs, ref):
        kwargs["attention_mask"] = plain_causal_mask(ref.device)
    with forward_pass(default_positions=not caller_gave_positions, owner=self):
        return type(self).forward(self, *args, **kwargs)


def plainly_causal(backbone: nn.Module, args: tuple, kwargs: dict, ref: Any) -> bool:
    """Whether the mask of this forward is plain causal attention, which the patched layers apply
    without a mask tensor (SDPA's ``is_causal``): every decoder attention is notebookkit's, and the
    caller passes no attention mask, no positions and no cache, and no sliding window is shorter than
    the sequence (so a sliding layer's mask is the causal one too)."""
    if not backbone.__dict__.get(ALL_ATTENTION_PATCHED) or len(args) > 1 or not isinstance(ref, torch.Tensor):
        return False
    if any(kwargs.get(name) is not None for name in ("attention_mask", "position_ids", "past_key_values", "cache")):
        return False
    config = backbone.config
    if not getattr(config, "is_causal", True) or "chunked_attention" in (getattr(config, "layer_types", None) or ()):
        return False
    window = getattr(config, "sliding_window", None)
    return window is None or ref.shape[1] <= int(window)


def shifted_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``labels[:, 1:]`` padded with ``ignore_index`` at the end, flattened (next-token targets)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1)


def make_causal_lm_forward(model: nn.Module, final_softcap: Optional[float], moe: bool = False):
    """The patched forward of a ``*ForCausalLM`` instance (its backbone is ``model.model``); ``moe``: the
    backbone's MLPs are routed experts (the load-balancing loss above)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    fused_ce = kernel("fused_linear_cross_entropy", "fused_linear_cross_entropy")
    cross_entropy = kernel("cross_entropy", "cross_entropy")
    backbone_cache = _cache_kwarg(model.model)
    out_cache = _output_cache_field(MoeCausalLMOutputWithPast if moe else CausalLMOutputWithPast)

    def causal_lm_forward(
        self: nn.Module,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Any = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        logits_to_keep: Any = 0,
        num_items_in_batch: Any = None,
        shift_labels: Optional[torch.Tensor] = None,
        return_dict: Optional[bool] = None,
        return_logits: bool = False,
        output_router_logits: Optional[bool] = None,
        aux_loss_weight: Optional[float] = None,
        **kwargs: Any,
    ):
        cache = kwargs.pop("cache", None)
        if cache is None:
            cache = past_key_values
        kwargs.pop("ignore_index", None)
        if output_router_logits is None:
            output_router_logits = bool(getattr(self.config, "output_router_logits", False))
        output_router_logits = moe and output_router_logits
        if moe:
            kwargs["output_router_logits"] = output_router_logits
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **{backbone_cache: cache},
            **kwargs,
        )
        hidden = outputs[0]
        lm_head = self.get_output_embeddings()
        loss = logits = None
        targets = None
        if labels is not None or shift_labels is not None:
            targets = shift_labels.reshape(-1) if shift_labels is not None else shifted_labels(labels)
        n_items = num_items_in_batch
        if isinstance(n_items, torch.Tensor):
            n_items = n_items.to(lm_head.weight.device)

        if targets is not None and self.training and not return_logits and fused_ce is not None and isinstance(lm_head, nn.Linear):
            # With device_map placement the head may sit on another device than the last layer.
            flat = hidden.reshape(-1, hidden.shape[-1]).to(lm_head.weight.device)
            loss = fused_ce(
                flat,
                lm_head.weight,
                targets.to(flat.device),
                bias=lm_head.bias,
                softcap=final_softcap,
                n_items=n_items,
            )
        else:
            logits = _softcap(lm_head(_keep(hidden, logits_to_keep)), final_softcap)
            if targets is not None:
                flat = logits.reshape(-1, logits.shape[-1])
                if flat.shape[0] != targets.shape[0]:
                    raise ValueError(
                        "labels cover every position but logits_to_keep selected fewer; pass logits_to_keep=0 with labels."
                    )
                if cross_entropy is not None:
                    loss = cross_entropy(flat, targets.to(flat.device), n_items=n_items)
                else:
                    reduction = "sum" if n_items is not None else "mean"
                    loss = F.cross_entropy(flat.float(), targets.to(flat.device), ignore_index=-100, reduction=reduction)
                    if n_items is not None:
                        loss = loss / n_items
        extra = {}
        if output_router_logits:
            config = self.config
            aux = load_balancing_loss(outputs.router_logits, int(getattr(config, "num_experts", None)
                                                                 or config.num_local_experts),
                                      int(config.num_experts_per_tok), attention_mask)
            if loss is not None:  # Hugging Face's heads read the coefficient they copied from the config at init
                coef = aux_loss_weight if aux_loss_weight is not None else \
                    getattr(self, "router_aux_loss_coef", config.router_aux_loss_coef)
                loss = loss + float(coef) * aux.to(loss.device)
            extra = {"aux_loss": aux, "router_logits": outputs.router_logits}
        fields = {
            "loss": loss,
            "logits": logits,
            out_cache: getattr(outputs, "cache", None) if hasattr(outputs, "cache") else getattr(outputs, "past_key_values", None),
            "hidden_states": getattr(outputs, "hidden_states", None),
            "attentions": getattr(outputs, "attentions", None),
        }
        result = MoeCausalLMOutputWithPast(**fields, **extra) if moe else CausalLMOutputWithPast(**fields)
        if return_dict is False:
            return result.to_tuple()
        return result

    return causal_lm_forward


def adds_router_loss(model: nn.Module) -> bool:
    """Whether ``model``'s causal-LM forward is notebookkit's mixture-of-experts head: with
    ``output_router_logits=True`` and labels its loss is ``loss + w * aux_loss``, ``w`` the
    ``aux_loss_weight`` argument (default: the model's ``router_aux_loss_coef``)."""
    return bool(getattr(model, ROUTER_LOSS_HEAD, False))


def lm_head_ready(model: nn.Module) -> Optional[str]:
    """None when the causal-LM forward of ``model`` can be patched, else the reason."""
    if not isinstance(getattr(model, "model", None), nn.Module):
        return f"{type(model).__name__} has no .model backbone"
    if not isinstance(model.get_output_embeddings(), nn.Linear):
        return "output embedding is not a plain linear layer"
    if kernel("fused_linear_cross_entropy", "fused_linear_cross_entropy") is None:
        return "notebookkit.kernels.fused_linear_cross_entropy is unavailable"
    return None


def trl_own_lm_head() -> Optional[str]:
    """The installed TRL version when its trainers score tokens with their own LM head, else ``None``.

    True of every TRL whose ``trl.trainer`` exports ``add_fused_lm_head`` (1.15 and 1.16 do); with
    older TRL, ``SFTTrainer`` reads the loss this model's forward returns. Reads TRL's lazy export
    table only, so nothing heavy is imported.
    """
    import importlib.util

    try:
        if importlib.util.find_spec("trl") is None:
            return None
        import trl
        from importlib.metadata import version

        if "add_fused_lm_head" not in dir(trl.trainer):
            return None
        return version("trl")
    except Exception:  # noqa: BLE001 - a broken TRL install only loses a banner note
        return None


def describe_lm_head(banner: Any, final_softcap: Optional[float]) -> None:
    """Write the ``fused CE loss`` line (and, with TRL 1.15+, which trainers use it) into ``banner``."""
    banner.feature(
        "fused CE loss",
        True,
        "model(..., labels=...) in training: fused linear cross-entropy, no full logits"
        + (f" (final soft-cap {final_softcap:g})" if final_softcap else ""),
    )
    trl_version = trl_own_lm_head()
    if trl_version is not None:
        banner.note(
            f"TRL {trl_version} trainers score tokens with TRL's own chunked LM head (no full logits either); "
            "SFT runs the fused CE only through notebookkit.train.make_sft_trainer / "
            "notebookkit.train.sft.FastSFTTrainer"
        )


def patch_lm_head(model: nn.Module, final_softcap: Optional[float], moe: bool = False) -> None:
    """Rebind the causal-LM forward of ``model`` (and its backbone's, for the length check); ``moe``: a
    mixture-of-experts model (its routers' load-balancing loss)."""
    rebind(model, make_causal_lm_forward(model, final_softcap, moe), "causal_lm")
    object.__setattr__(model, ROUTER_LOSS_HEAD, moe)
    record_fused_lm_head(model, True)  # for the memory model: training computes no [N, V] logits
    object.__setattr__(model.model, LM_HEAD_OWNER, WeakOwner(model))  # weak: no reference cycle
    rebind(model.model, backbone_forward, "backbone")
