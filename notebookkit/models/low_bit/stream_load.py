"""Load a causal LM with 2-bit or ternary projections, one checkpoint tensor at a time.

The whole 16-bit model never exists, on the GPU or on the host (a 70B is 140 GB of bf16):

1. the model is built from its config with its parameters on the meta device
   (``accelerate.init_empty_weights(include_buffers=False)``: no memory; the buffers a module computes
   in ``__init__`` -- RoPE frequencies, Gemma's embedding scale -- are made for real, they are tiny and
   are not in checkpoints);
2. every q/k/v/o and gate/up/down projection of the decoder layers is swapped for an empty
   :class:`~notebookkit.base_layers.low_bit_linear.Q2Linear` / ``TernaryLinear`` (on meta; a layer that the
   format cannot serve is refused first, naming it);
3. the safetensors files are read with ``safe_open``, one tensor at a time (the host holds one tensor,
   never a whole shard): a projection's 16-bit weight goes to the target device and is quantised there
   (:func:`~notebookkit.kernels.q2.quantize_q2` / :func:`~notebookkit.kernels.ternary.quantize_ternary`),
   then freed; a pre-quantised checkpoint's packed tensors are placed as they are; a BitNet layer's
   ``weight`` + ``weight_scale`` pair goes through :func:`~notebookkit.kernels.ternary.ternary_from_bitnet`;
   every other tensor (embeddings, norms, LM head) is cast to the compute dtype and placed;
4. tied weights are tied again, the computed buffers moved to the device, and anything still on meta
   (a tensor the checkpoint lacks) is an error that names it.

Peak memory on the device: the packed model plus one 16-bit projection and its fit's temporaries.
The config gets :data:`.flags.CONFIG_KEY`, so ``save_pretrained`` writes a checkpoint (packed tensors
and that record) that loads back without quantising again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from notebookkit.base_formats import BASE_FORMATS
from notebookkit.base_layers.low_bit_linear import LOW_BIT_LINEARS, Q2Linear, TernaryLinear
from notebookkit.kernels.q2 import DEFAULT_GROUP_SIZE, quantize_q2
from notebookkit.kernels.ternary import quantize_ternary, ternary_from_bitnet

from ..common.decoder_layers import decoder_layers
from .flags import CONFIG_KEY, is_bitnet_config, saved_low_bit_record

__all__ = ["checkpoint_files", "projection_names", "check_servable", "empty_low_bit_model", "load_low_bit"]

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def checkpoint_files(path: str, kind: str = "local", token: Optional[str] = None) -> list[Path]:
    """The ``*.safetensors`` files of a model folder (or Hub repo, downloaded), in index order."""
    if kind == "hub":
        from huggingface_hub import snapshot_download

        path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors"], token=token)
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"{folder} holds no model.safetensors (or its index): loading in 2-bit or ternary reads "
                     "safetensors files one tensor at a time. Save the model with "
                     "model.save_pretrained(folder, safe_serialization=True) first.")


def projection_names(model: nn.Module) -> list[str]:
    """Full names of the q/k/v/o and gate/up/down projections of ``model``'s decoder layers."""
    where = {id(m): n for n, m in model.named_modules()}
    names = []
    for layer in decoder_layers(model):
        for owner_name, children in PROJECTIONS.items():
            owner = getattr(layer, owner_name, None)
            for child in children:
                module = getattr(owner, child, None) if owner is not None else None
                if isinstance(module, nn.Linear):
                    names.append(f"{where[id(owner)]}.{child}")
    return names


def check_servable(model: nn.Module, names: list[str], base_format: str, group_size: int = DEFAULT_GROUP_SIZE) -> None:
    """Refuse, naming the first layer, a model whose projections ``base_format`` cannot hold."""
    if not names:
        raise ValueError(f"{type(model).__name__} has no q/k/v/o or gate/up/down projections in decoder layers "
                         f"notebookkit can find; {BASE_FORMATS[base_format].label} loading is for decoder-only "
                         "causal LMs of the supported families. Load it in 16-bit or 4-bit instead.")
    if base_format != "2bit":
        return
    for name in names:
        k = model.get_submodule(name).in_features
        if k % group_size:
            raise ValueError(
                f"load_in_2bit: {name} has in_features={k}, not a multiple of the 2-bit group size {group_size} "
                "(groups of 64 weights share a scale and may not straddle rows). Load this model with "
                "load_in_ternary=True (any width), load_in_4bit=True or in 16-bit instead."
            )


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    owner_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(owner_name), child, new)


def empty_low_bit_model(config: Any, base_format: str, model_class: Any, dtype: torch.dtype,
                        names: Optional[list[str]] = None, group_size: int = DEFAULT_GROUP_SIZE,
                        attn_implementation: Optional[str] = None) -> tuple[nn.Module, list[str]]:
    """``(model, projection names)``: ``model_class`` built from ``config`` with meta parameters and its
    projections (``names``, default :func:`projection_names`) swapped for empty low-bit layers on meta."""
    from accelerate import init_empty_weights

    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with init_empty_weights(include_buffers=False):
        model = model_class.from_config(config, dtype=dtype, **extra)
    names = list(names) if names is not None else projection_names(model)
    check_servable(model, names, base_format, group_size)
    for name in names:
        dense = model.get_submodule(name)
        kw = {"group_size": group_size} if base_format == "2bit" else {}
        _replace(model, name, LOW_BIT_LINEARS[base_format](dense.in_features, dense.out_features,
                                                            dense.bias is not None, compute_dtype=dtype,
                                                            device="meta", **kw))
    return model, names


def _place(model: nn.Module, key: str, tensor: torch.Tensor) -> bool:
    """Put ``tensor`` at ``key`` (a parameter, frozen, or a buffer); False when ``model`` has no such entry."""
    owner_name, _, leaf = key.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        return False
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        return True
    if leaf in owner._buffers:
        owner._buffers[leaf] = tensor
        return True
    return False


class _BitNetPairs:
    """A BitNet layer needs its ``weight`` and ``weight_scale``; whichever comes first waits for the other."""

    def __init__(self, quantization_config: dict) -> None:
        self.cfg, self.waiting = quantization_config, {}

    def take(self, module: TernaryLinear, leaf: str, tensor: torch.Tensor) -> bool:
        """Keep one of the pair; when both are here, set the layer (True)."""
        parts = self.waiting.setdefault(id(module), {})
        parts[leaf] = tensor
        if len(parts) < 2:
            return False
        del self.waiting[id(module)]
        t = ternary_from_bitnet(parts["weight"], parts["weight_scale"], self.cfg, module.out_features)
        if t.in_features != module.in_features:
            raise ValueError(f"A BitNet layer of {t.in_features} inputs where the config says {module.in_features}.")
        module.set_packed(t)
        return True


def load_low_bit(path: str, config: Any, base_format: str, model_class: Any, dtype: torch.dtype,
                 device: torch.device, kind: str = "local", token: Optional[str] = None,
                 attn_implementation: Optional[str] = None, group_size: int = DEFAULT_GROUP_SIZE,
                 notes: Optional[list[str]] = None) -> nn.Module:
    """The model at ``path`` with its projections in ``base_format`` on ``device`` (steps: module docstring).

    ``notes`` collects what the banner should say (tensors of the checkpoint the model has no place for).
    """
    saved = saved_low_bit_record(config)
    bitnet = saved is None and is_bitnet_config(config)
    if saved is not None:
        group_size = int(saved.get("group_size") or group_size)
    qcfg: dict = {}
    if bitnet:
        q = config.quantization_config
        qcfg = dict(q) if isinstance(q, dict) else q.to_dict()
        # the skeleton is a plain model: the projections become TernaryLinear from the checkpoint's codes
        config = _without_quantization(config)
    model, names = empty_low_bit_model(config, base_format, model_class, dtype,
                                       saved.get("modules") if saved else None, group_size, attn_implementation)
    targets = {name: model.get_submodule(name) for name in names}
    pairs = _BitNetPairs(qcfg)
    unused: list[str] = []
    from safetensors import safe_open

    for file in checkpoint_files(path, kind, token):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                owner, _, leaf = key.rpartition(".")
                tensor = f.get_tensor(key)
                module = targets.get(owner)
                if module is not None and leaf != "bias":
                    if not _low_bit_tensor(module, leaf, tensor.to(device), saved is not None, bitnet, pairs,
                                           group_size):
                        unused.append(key)
                    continue
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                if not _place(model, key, tensor.to(device)):
                    unused.append(key)
                del tensor
    if pairs.waiting:
        raise ValueError(f"This BitNet checkpoint has a weight without its weight_scale (or the reverse) in "
                         f"{len(pairs.waiting)} layers; it is not transformers' BitNet layout.")
    _tie(model)
    _missing(model, path, unused)
    model.to(device)  # the buffers a module computes in __init__ (RoPE frequencies) were made on the host
    if notes is not None and unused:
        notes.append(f"{len(unused)} checkpoint tensors have no place in the model and were skipped "
                     f"(e.g. {unused[0]})")
    record = {"format": base_format, "group_size": group_size if base_format == "2bit" else None, "modules": names}
    setattr(model.config, CONFIG_KEY, record)
    return model.eval()


def _without_quantization(config: Any) -> Any:
    import copy

    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    return config


def _low_bit_tensor(module: nn.Module, leaf: str, tensor: torch.Tensor, prequantised: bool, bitnet: bool,
                    pairs: _BitNetPairs, group_size: int) -> bool:
    """One checkpoint tensor of a low-bit projection: quantise, place or pair it; False: not one of its."""
    if bitnet:
        if leaf not in ("weight", "weight_scale"):
            return False
        pairs.take(module, leaf, tensor)
        return True
    if prequantised:
        if leaf not in module._buffers:
            return False
        want = module._buffers[leaf]
        if tuple(want.shape) != tuple(tensor.shape) or want.dtype != tensor.dtype:
            raise ValueError(f"Pre-quantised tensor {leaf} of {tuple(tensor.shape)} {tensor.dtype} does not fit "
                             f"the layer ({tuple(want.shape)} {want.dtype}): the checkpoint and its config.json "
                             "disagree. Quantise the 16-bit checkpoint again.")
        module._buffers[leaf] = tensor
        return True
    if leaf != "weight":
        return False
    if isinstance(module, Q2Linear):
        module.set_packed(quantize_q2(tensor, group_size))
    else:
        module.set_packed(quantize_ternary(tensor))
    return True


def _tie(model: nn.Module) -> None:
    if getattr(model.config, "tie_word_embeddings", False) or getattr(
            getattr(model.config, "get_text_config", lambda: None)(), "tie_word_embeddings", False):
        model.tie_weights()


def _missing(model: nn.Module, path: str, unused: list[str]) -> None:
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        names = (f" Its tensors are named otherwise (e.g. {unused[0]}): it was saved by another model class or "
                 "library version, which the low-bit loader does not rename." if unused else "")
        raise ValueError(f"The checkpoint at {path} lacks {len(missing)} tensors {type(model).__name__} needs (e.g. "
                         f"{', '.join(missing[:3])}).{names} Load it with load_in_4bit=True or in 16-bit, save it "
                         "with save_pretrained, and load that folder in 2-bit / ternary.")
