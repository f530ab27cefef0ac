"""The merged weights of a LoRA model, one tensor at a time, planned before any is computed.

For a LoRA-adapted linear layer with frozen base weight ``W`` (16-bit, NF4-packed, or 2-bit / ternary
packed) and active adapters ``(A_i, B_i, s_i)`` (``A_i``: ``[r, in]``, ``B_i``: ``[out, r]``,
``s_i`` = PEFT's scaling, ``alpha / r`` or ``alpha / sqrt(r)`` with rsLoRA) the merged weight is

    W' = dtype( fp32(W) + sum_i s_i * fp32(B_i) @ fp32(A_i) )

with one rounding, to the model's 16-bit dtype, at the end. The product runs in IEEE fp32 even where
TF32 is switched on (``tf32=True`` training, ``torch.set_float32_matmul_precision("high")``): TF32
keeps 10 mantissa bits, which shows in the 16-bit result wherever ``s B @ A`` is small. A packed weight
is decoded by its format's own decode straight to fp32, on the device that merges it (its packed
tensors move there, never the fp32 result):

* NF4: :func:`notebookkit.kernels.nf4.dequantize_nf4`, never bitsandbytes' CPU dequantisation;
* 2-bit (``load_in_2bit``): ``fp32(W)[n, k] = (code(n, k) - zero[n, k // G]) * scale[n, k // G]``
  (:func:`notebookkit.kernels.q2.dequantize_q2`);
* ternary (``load_in_ternary``): ``fp32(W)[n, k] = scale[n, k // G] * t(n, k)``, ``t`` in {-1, 0, +1}
  (:func:`notebookkit.kernels.ternary.dequantize_ternary`).

A 2-bit or ternary projection without an adapter is written the same way with no sum: a dense
``weight`` (and its ``bias``), never its packed buffers, so the folder loads in plain transformers.
A mixture-of-experts block's stacked expert weights (Qwen3-MoE, gpt-oss) with PEFT's ``target_parameters``
adapters are merged by :mod:`.merge_experts` (``W_e + s B_e A_e`` in the parameter's own orientation) and
planned under the experts module's name, stacked as the model holds them (``PlannedTensor.experts`` keeps
the per-expert maker for :mod:`.checkpoint_layout` and the GGUF writer).

Every other parameter and persistent buffer of the model is passed through under its Hugging Face
name (cast to the 16-bit dtype when floating point); a tied LM head is written once, as the embedding.

:func:`plan_merged_tensors` walks the modules once and returns, for every output tensor, its name,
shape and dtype plus a ``make(device)`` that computes it. The writers use the plan to size shards
and check disk space before anything is computed, then call ``make`` tensor by tensor, so at most
one merged tensor (and its fp32 working copy) exists at a time. :func:`merged_config` is the config
the merged tensors belong to: the base's without its quantisation entries.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional

import torch
import torch.nn as nn

from notebookkit.base_formats import PREQUANTISED_CONFIG_KEY
from notebookkit.base_layers.linear4bit import is_linear4bit
from notebookkit.base_layers.low_bit_linear import is_low_bit_linear
from notebookkit.kernels.nf4 import dequantize_nf4
from notebookkit.memory.export import merge_working_bytes

from .active_adapters import active_adapter_names
from .ieee_fp32 import ieee_fp32_matmul
from .merge_experts import StackedExperts, experts_module, stacked_experts

__all__ = ["PlannedTensor", "plan_merged_tensors", "base_model_of", "merged_config", "QUANTISATION_CONFIG_KEYS"]

#: the config entries of a quantised base that the merged (dense) model must not carry: transformers'
#: ``quantization_config`` (bitsandbytes, BitNet) and notebookkit's pre-quantised low-bit record, which
#: would make ``from_pretrained`` look for packed tensors in the merged folder
QUANTISATION_CONFIG_KEYS = ("quantization_config", "_pre_quantization_dtype", PREQUANTISED_CONFIG_KEY)


@dataclass
class PlannedTensor:
    """One tensor of the merged checkpoint: where it goes, what it is, and how to compute it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[torch.device], torch.Tensor]  # computes the tensor on (or via) the given device
    source_device: torch.device  # where its inputs live
    working_bytes: int  # device memory make() needs beyond its inputs (fp32 copies, products)
    linear_rank: Optional[int] = None  # the weight of a linear layer: its LoRA rank (0: no adapter); else None
    experts: Optional[StackedExperts] = None  # a stacked expert weight: its per-expert merge (merge_experts)
    in_dim: int = -1  # the axis of the input features (what a product reduces over; GGUF blocks run along it)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n * torch.empty((), dtype=self.dtype).element_size()


def base_model_of(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT wrapper (the model itself when it is not wrapped)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def merged_config(base: nn.Module):
    """A copy of ``base``'s config for the merged model: its quantisation entries
    (:data:`QUANTISATION_CONFIG_KEYS`) removed, the rest as it is."""
    config = copy.deepcopy(base.config)
    for key in QUANTISATION_CONFIG_KEYS:
        if hasattr(config, key):
            delattr(config, key)
    return config


def _is_nf4(weight: torch.Tensor) -> bool:
    return getattr(weight, "quant_state", None) is not None


def _weight_shape(weight: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in weight.quant_state.shape) if _is_nf4(weight) else tuple(weight.shape)


def _linear_shape(layer: nn.Module) -> tuple[int, int]:
    """``(out, in)`` of a linear base layer: from its features for a packed 2-bit / ternary layer (no ``weight``)."""
    if is_low_bit_linear(layer):
        return int(layer.out_features), int(layer.in_features)
    out_f, in_f = _weight_shape(layer.weight)
    return out_f, in_f


def _stored_weight(layer: nn.Module) -> torch.Tensor:
    """The tensor that holds a linear base layer's weight (the packed codes of a 2-bit / ternary layer):
    where the merge's inputs live."""
    return layer.qweight if is_low_bit_linear(layer) else layer.weight


def _quant_state_on(quant_state, device: torch.device) -> SimpleNamespace:
    """The fields of a bitsandbytes ``QuantState`` that :func:`dequantize_nf4` reads, moved to ``device``."""
    state2 = getattr(quant_state, "state2", None)
    nested = None if state2 is None else SimpleNamespace(
        code=state2.code.to(device), absmax=state2.absmax.to(device), blocksize=state2.blocksize)
    offset = getattr(quant_state, "offset", None)
    return SimpleNamespace(absmax=quant_state.absmax.to(device), shape=quant_state.shape, dtype=quant_state.dtype,
                           blocksize=quant_state.blocksize, quant_type=getattr(quant_state, "quant_type", "nf4"),
                           state2=nested, offset=None if offset is None else offset.to(device))


def _dense_fp32(weight: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The base weight in fp32 on ``device``: NF4 decoded by notebookkit, 16-bit upcast. An NF4 weight
    merged on another device is decoded there (its packed bytes, n/2, move; not the fp32 result),
    so a layer the memory budget sends to the CPU takes no GPU memory."""
    if _is_nf4(weight):
        if weight.device == device:
            return dequantize_nf4(weight, out_dtype=torch.float32)
        return dequantize_nf4(weight.data.to(device), _quant_state_on(weight.quant_state, device), out_dtype=torch.float32)
    return weight.detach().to(device=device, dtype=torch.float32, copy=True)


def _base_fp32(layer: nn.Module, device: torch.device) -> torch.Tensor:
    """A linear base layer's weight in fp32 on ``device`` (a new tensor): a 2-bit / ternary layer decoded
    there by its format (its packed tensors move, not the fp32 result), else :func:`_dense_fp32`."""
    if is_low_bit_linear(layer):
        return layer.dequantized_weight(torch.float32, device)
    return _dense_fp32(layer.weight, device)


def _check_supported_lora(module: nn.Module, name: str) -> None:
    dora = getattr(module, "use_dora", {}) or {}
    if any(dora.get(a, False) for a in active_adapter_names(module)):
        raise NotImplementedError(
            f"{name} uses DoRA (use_dora=True); notebookkit's merge writes plain LoRA (W + s*B@A). "
            "Train without DoRA, or merge with peft's merge_and_unload() on a 16-bit model."
        )
    if getattr(module, "fan_in_fan_out", False):
        raise NotImplementedError(f"{name} stores its weight transposed (fan_in_fan_out); only nn.Linear layers merge.")
    if any(getattr(module, "lora_bias", {}).get(a, False) for a in active_adapter_names(module)):
        raise NotImplementedError(f"{name} has a LoRA bias (lora_bias=True), which the merge does not write.")


def _lora_factors(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """``(A_i, B_i, s_i)`` of each active adapter of a LoRA layer."""
    return [(module.lora_A[a].weight, module.lora_B[a].weight, float(module.scaling[a])) for a in active_adapter_names(module)]


def _merged_linear_maker(base: nn.Module, adapters: list[tuple[torch.Tensor, torch.Tensor, float]],
                         out_dtype: torch.dtype) -> Callable[[torch.device], torch.Tensor]:
    """``make(device)`` of ``dtype(fp32(W) + sum_i s_i B_i @ A_i)`` for the linear layer ``base`` (``adapters``
    may be empty: a packed layer without an adapter, written dense)."""

    def make(device: torch.device) -> torch.Tensor:
        merged = _base_fp32(base, device)
        with ieee_fp32_matmul():
            for lora_a, lora_b, scaling in adapters:
                a = lora_a.detach().to(device=device, dtype=torch.float32)
                b = lora_b.detach().to(device=device, dtype=torch.float32)
                merged.addmm_(b, a, alpha=scaling)  # W += s * B @ A, in place, fp32
        return merged.to(out_dtype)

    return make


def _plain_maker(tensor: torch.Tensor, out_dtype: Optional[torch.dtype]) -> Callable[[torch.device], torch.Tensor]:
    def make(device: torch.device) -> torch.Tensor:
        if _is_nf4(tensor):
            return _dense_fp32(tensor, device).to(out_dtype)
        t = tensor.detach()
        return t.to(device=device, dtype=out_dtype if out_dtype is not None else t.dtype)

    return make


def _experts_maker(stack: StackedExperts, out_dtype: torch.dtype) -> Callable[[torch.device], torch.Tensor]:
    def make(device: torch.device) -> torch.Tensor:
        return stack.full(device).to(out_dtype)

    return make


def plan_merged_tensors(model: nn.Module, dtype: torch.dtype) -> list[PlannedTensor]:
    """Every tensor of the merged Hugging Face checkpoint, in the model's module order (not computed).

    Args:
        model: a ``PeftModel`` or a plain Hugging Face model (16-bit, NF4, 2-bit or ternary base weights).
        dtype: the 16-bit (or fp32) dtype floating-point tensors are written in.
    """
    from notebookkit.families import for_model_type

    base = base_model_of(model)
    family = for_model_type(getattr(base.config, "model_type", None))
    moe = family.moe if family is not None else None
    plan: list[PlannedTensor] = []
    out_bytes = torch.empty((), dtype=dtype).element_size()
    seen: set[int] = set()
    skip_prefixes: list[str] = []

    def add(name: str, tensor: torch.Tensor, make: Callable, shape: tuple[int, ...], out_dtype: torch.dtype, work: int,
            linear_rank: Optional[int] = None, **extra):
        plan.append(PlannedTensor(name, shape, out_dtype, make, tensor.device, work, linear_rank, **extra))

    for mod_name, module in base.named_modules():
        if any(mod_name == p or mod_name.startswith(p + ".") for p in skip_prefixes):
            continue
        prefix = mod_name + "." if mod_name else ""
        found = experts_module(module) if moe is not None else None
        if found is not None:  # stacked experts (PEFT-wrapped or not): merged per expert, biases as they are
            skip_prefixes.append(mod_name)
            for pname, stack in stacked_experts(module, moe.transposed).items():
                seen.add(id(stack.weight))
                add(prefix + pname, stack.weight, _experts_maker(stack, dtype), tuple(stack.weight.shape), dtype,
                    stack.working_bytes(out_bytes), experts=stack, in_dim=1 if moe.transposed else 2)
            for pname, p in found[0].named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    add(prefix + pname, p, _plain_maker(p, dtype), tuple(p.shape), dtype, 0)
            continue
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):  # a PEFT LoRA layer
            _check_supported_lora(module, mod_name)
            skip_prefixes.append(mod_name)
            weight = _stored_weight(module.base_layer)
            out_f, in_f = _linear_shape(module.base_layer)
            rank = sum(module.lora_A[a].weight.shape[0] for a in active_adapter_names(module))
            seen.add(id(weight))
            add(prefix + "weight", weight, _merged_linear_maker(module.base_layer, _lora_factors(module), dtype),
                (out_f, in_f), dtype, merge_working_bytes(out_f, in_f, rank, out_bytes), rank)
            bias = getattr(module.base_layer, "bias", None)
            if bias is not None:
                add(prefix + "bias", bias, _plain_maker(bias, dtype), tuple(bias.shape), dtype, 0)
            continue
        if is_low_bit_linear(module):  # a 2-bit / ternary projection without an adapter: dense weight (+ bias)
            out_f, in_f = _linear_shape(module)
            add(prefix + "weight", module.qweight, _merged_linear_maker(module, [], dtype), (out_f, in_f), dtype,
                merge_working_bytes(out_f, in_f, 0, out_bytes), 0)
            if module.bias is not None:
                seen.add(id(module.bias))
                add(prefix + "bias", module.bias, _plain_maker(module.bias, dtype), tuple(module.bias.shape), dtype, 0)
            continue
        if type(module).__name__ == "ModulesToSaveWrapper":  # modules_to_save: the trained copy
            skip_prefixes.append(mod_name)
            active = module.active_adapter if isinstance(module.active_adapter, str) else module.active_adapter[0]
            source = module.modules_to_save[active] if active in module.modules_to_save else module.original_module
            for pname, p in source.named_parameters():
                seen.add(id(p))
                add(prefix + pname, p, _plain_maker(p, dtype), tuple(p.shape), dtype, 0)
            continue
        linear = type(module) is nn.Linear or is_linear4bit(module)
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # tied weights (the LM head of a tied model): written once
                continue
            seen.add(id(p))
            rank = 0 if linear and pname == "weight" else None
            if _is_nf4(p):
                shape = _weight_shape(p)
                add(prefix + pname, p, _plain_maker(p, dtype), shape, dtype, shape[0] * shape[1] * 6, rank)
            else:
                out_dtype = dtype if p.is_floating_point() else p.dtype
                add(prefix + pname, p, _plain_maker(p, out_dtype if p.is_floating_point() else None), tuple(p.shape), out_dtype, 0, rank)
        non_persistent = getattr(module, "_non_persistent_buffers_set", set())
        for bname, buf in module.named_buffers(recurse=False):
            if bname in non_persistent or buf is None or id(buf) in seen:
                continue
            seen.add(id(buf))
            out_dtype = dtype if buf.is_floating_point() else buf.dtype
            add(prefix + bname, buf, _plain_maker(buf, out_dtype if buf.is_floating_point() else None), tuple(buf.shape), out_dtype, 0)
    return plan
