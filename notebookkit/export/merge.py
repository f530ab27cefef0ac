"""The merged weights of a LoRA model, one tensor at a time, planned before any is computed.

For a LoRA-adapted linear layer with frozen base weight ``W`` (16-bit, or NF4-packed) and active
adapters ``(A_i, B_i, s_i)`` (``A_i``: ``[r, in]``, ``B_i``: ``[out, r]``, ``s_i`` = PEFT's scaling,
``alpha / r`` or ``alpha / sqrt(r)`` with rsLoRA) the merged weight is

    W' = dtype( fp32(W) + sum_i s_i * fp32(B_i) @ fp32(A_i) )

with one rounding, to the model's 16-bit dtype, at the end. The product runs in IEEE fp32 even where
TF32 is switched on (``tf32=True`` training, ``torch.set_float32_matmul_precision("high")``): TF32
keeps 10 mantissa bits, which shows in the 16-bit result wherever ``s B @ A`` is small. An NF4 weight is decoded by
notebookkit's own decode (:func:`notebookkit.kernels.nf4.dequantize_nf4`, straight to fp32), never by
bitsandbytes' CPU dequantisation. Every other parameter and persistent buffer of the model is
passed through under its Hugging Face name (cast to the 16-bit dtype when floating point); a tied
LM head is written once, as the embedding.

:func:`plan_merged_tensors` walks the modules once and returns, for every output tensor, its name,
shape and dtype plus a ``make(device)`` that computes it. The writers use the plan to size shards
and check disk space before anything is computed, then call ``make`` tensor by tensor, so at most
one merged tensor (and its fp32 working copy) exists at a time.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional

import torch
import torch.nn as nn

from notebookkit.kernels.nf4 import dequantize_nf4
from notebookkit.memory.export import merge_working_bytes
from notebookkit.base_layers.linear4bit import is_linear4bit

__all__ = ["PlannedTensor", "plan_merged_tensors", "base_model_of"]


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

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n * torch.empty((), dtype=self.dtype).element_size()


def base_model_of(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT wrapper (the model itself when it is not wrapped)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _is_nf4(weight: torch.Tensor) -> bool:
    return getattr(weight, "quant_state", None) is not None


def _weight_shape(weight: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in weight.quant_state.shape) if _is_nf4(weight) else tuple(weight.shape)


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


def active_adapter_names(module: nn.Module) -> list[str]:
    """The LoRA adapters of ``module`` that are active and not yet merged into its weight."""
    active = getattr(module, "active_adapters", None) or []
    if isinstance(active, str):
        active = [active]
    merged = set(getattr(module, "merged_adapters", []) or [])
    return [a for a in active if a in module.lora_A and a not in merged]


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


@contextlib.contextmanager
def _ieee_fp32_matmul():
    """fp32 matrix products at full fp32 precision inside the block (TF32 / bf16 reduced precision off, on CUDA
    and on oneDNN CPUs), the caller's settings back afterwards. torch >= 2.9 keeps these per backend
    (``torch.backends.<backend>.matmul.fp32_precision``, what ``tf32=True`` training sets through transformers);
    reading them through the older ``torch.get_float32_matmul_precision`` would raise after that, so the block
    uses the per-backend settings where they exist."""
    backends = [getattr(getattr(torch.backends, name, None), "matmul", None) for name in ("cuda", "mkldnn")]
    backends = [b for b in backends if b is not None and hasattr(b, "fp32_precision")]
    if not backends:  # torch < 2.9
        before_legacy = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before_legacy)
        return
    before = [b.fp32_precision for b in backends]
    for backend in backends:
        backend.fp32_precision = "ieee"
    try:
        yield
    finally:
        for backend, precision in zip(backends, before):
            backend.fp32_precision = precision


def _merged_linear_maker(module: nn.Module, out_dtype: torch.dtype) -> Callable[[torch.device], torch.Tensor]:
    base = module.base_layer
    adapters = [(module.lora_A[a].weight, module.lora_B[a].weight, float(module.scaling[a]))
                for a in active_adapter_names(module)]

    def make(device: torch.device) -> torch.Tensor:
        merged = _dense_fp32(base.weight, device)
        with _ieee_fp32_matmul():
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


def _refuse_low_bit_bases(model: nn.Module) -> None:
    """A model on a 2-bit or ternary base (:mod:`notebookkit.models.low_bit`) has no dense base weights to
    merge into, and writing its packed tensors as a 16-bit checkpoint is not done yet: say what works."""
    from notebookkit.base_layers.low_bit_linear import is_low_bit_linear

    found = next((m for m in model.modules() if is_low_bit_linear(m)), None)
    if found is not None:
        raise NotImplementedError(
            f"This model's projections are {found.base_format} (load_in_2bit / load_in_ternary): merged and GGUF "
            "exports from such a base are not supported yet. Save the adapter with model.save_pretrained(folder) "
            "(it reloads onto the same base), or load the 16-bit checkpoint the base was quantised from with the "
            "adapter (from_pretrained(folder, load_in_4bit=False)) and export from there."
        )


def plan_merged_tensors(model: nn.Module, dtype: torch.dtype) -> list[PlannedTensor]:
    """Every tensor of the merged Hugging Face checkpoint, in the model's module order (not computed).

    Args:
        model: a ``PeftModel`` or a plain Hugging Face model (16-bit or NF4 weights).
        dtype: the 16-bit (or fp32) dtype floating-point tensors are written in.
    """
    base = base_model_of(model)
    _refuse_low_bit_bases(base)
    plan: list[PlannedTensor] = []
    seen: set[int] = set()
    skip_prefixes: list[str] = []

    def add(name: str, tensor: torch.Tensor, make: Callable, shape: tuple[int, ...], out_dtype: torch.dtype, work: int,
            linear_rank: Optional[int] = None):
        plan.append(PlannedTensor(name, shape, out_dtype, make, tensor.device, work, linear_rank))

    for mod_name, module in base.named_modules():
        if any(mod_name == p or mod_name.startswith(p + ".") for p in skip_prefixes):
            continue
        prefix = mod_name + "." if mod_name else ""
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):  # a PEFT LoRA layer
            _check_supported_lora(module, mod_name)
            skip_prefixes.append(mod_name)
            weight = module.base_layer.weight
            out_f, in_f = _weight_shape(weight)
            rank = sum(module.lora_A[a].weight.shape[0] for a in active_adapter_names(module))
            seen.add(id(weight))
            add(prefix + "weight", weight, _merged_linear_maker(module, dtype), (out_f, in_f), dtype,
                merge_working_bytes(out_f, in_f, rank, torch.empty((), dtype=dtype).element_size()), rank)
            bias = getattr(module.base_layer, "bias", None)
            if bias is not None:
                add(prefix + "bias", bias, _plain_maker(bias, dtype), tuple(bias.shape), dtype, 0)
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
