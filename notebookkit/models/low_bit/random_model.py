"""A random-weight causal LM built directly in the 2-bit (or ternary) format, layer by layer, on a device.

For benchmarks at shapes whose 16-bit weights can never exist here (Llama-3.1-70B: 140 GB of bf16,
more than the GPU machine's disk and its GPU): the model is built from a config with its parameters on
the meta device (:func:`.stream_load.empty_low_bit_model`), then each projection's packed tensors are
drawn on ``device`` one layer at a time, so the device holds the packed model and never more than one
projection's temporaries; nothing passes through the host.

Weights (``std`` the spread of the dense model it stands in for):

* 2-bit projections: codes uniform in ``0..3``, ``zero = 1.5``, ``scale = std / sqrt(1.25)`` for every
  group (the four levels ``(-1.5, -0.5, 0.5, 1.5) * scale`` have standard deviation ``std``); with
  ``exact_fit=True`` instead a Gaussian ``[N, K]`` weight is drawn on the device and fitted by
  :func:`~notebookkit.kernels.q2.quantize_q2` (what loading a checkpoint does; slower);
* ternary projections: codes uniform in ``{-1, 0, +1}``, one scale a row ``std * sqrt(3 / 2)``;
* everything else in ``dtype``: matrices (embeddings, LM head) Gaussian ``N(0, std^2)``, vectors (norm
  weights) the identity of their norm (1, or 0 for Gemma's ``(1 + w)`` norms), biases 0.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn as nn

from notebookkit.base_layers.low_bit_linear import Q2Linear, TernaryLinear
from notebookkit.families import for_model_type
from notebookkit.kernels.q2 import DEFAULT_GROUP_SIZE, Q2Weight, pack_codes, quantize_q2
from notebookkit.kernels.ternary import TernaryWeight, pack_ternary

from .flags import CONFIG_KEY
from .stream_load import empty_low_bit_model

__all__ = ["random_low_bit_model"]


def _random_q2(module: Q2Linear, std: float, generator: torch.Generator, exact_fit: bool) -> Q2Weight:
    n, k, g = module.out_features, module.in_features, module.group_size
    device = generator.device
    if exact_fit:
        w = torch.randn((n, k), generator=generator, device=device) * std
        return quantize_q2(w, g)
    codes = torch.randint(0, 4, (n, k), generator=generator, device=device, dtype=torch.uint8)
    scale = torch.full((n, k // g), std / math.sqrt(1.25), dtype=torch.float16, device=device)
    zero = torch.full((n, k // g), 1.5, dtype=torch.float16, device=device)
    return Q2Weight(pack_codes(codes), scale, zero, (n, k), g)


def _random_ternary(module: TernaryLinear, std: float, generator: torch.Generator) -> TernaryWeight:
    n, k = module.out_features, module.in_features
    device = generator.device
    t = torch.randint(-1, 2, (n, k), generator=generator, device=device, dtype=torch.int8)
    scales = torch.full((n, 1), std * math.sqrt(1.5), dtype=torch.float16, device=device)
    return TernaryWeight(pack_ternary(t), scales, k, k)


def random_low_bit_model(config: Any, base_format: str = "2bit", device: Any = None,
                         dtype: torch.dtype = torch.bfloat16, seed: int = 0, std: float = 0.02,
                         group_size: int = DEFAULT_GROUP_SIZE, exact_fit: bool = False) -> nn.Module:
    """A causal LM of ``config`` with random weights, its projections in ``base_format`` (module docstring).

    Args:
        config: a Hugging Face causal-LM config (e.g. ``LlamaConfig(**llama_3_1_70b)``).
        base_format: ``"2bit"`` or ``"ternary"``.
        device: where the model is built (default: this GPU, else the CPU).
        dtype: dtype of the embeddings, norms and LM head, and the compute dtype.
        seed: seeds the device generator (same seed and device: the same model).
        std: spread of the weights the random ones stand in for.
        group_size: 2-bit group size.
        exact_fit: 2-bit only: fit a Gaussian weight per projection instead of drawing codes.

    Returns:
        The model in eval mode, its base format recorded (``record_base_format``).
    """
    from notebookkit.memory.model_setup import record_base_format
    from transformers import AutoModelForCausalLM

    if base_format not in ("2bit", "ternary"):
        raise ValueError(f"random_low_bit_model builds '2bit' or 'ternary' models, not {base_format!r}.")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    generator = torch.Generator(device=device).manual_seed(seed)
    model, names = empty_low_bit_model(config, base_format, AutoModelForCausalLM, dtype, group_size=group_size)
    for name in names:  # one projection's temporaries at a time
        module = model.get_submodule(name)
        if isinstance(module, Q2Linear):
            module.set_packed(_random_q2(module, std, generator, exact_fit))
        else:
            module.set_packed(_random_ternary(module, std, generator))
        if module.bias is not None:
            module.bias = nn.Parameter(torch.zeros(module.out_features, dtype=dtype, device=device), requires_grad=False)
    family = for_model_type(getattr(config, "model_type", None))
    norm_identity = 0.0 if family is not None and family.gemma_norm else 1.0
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, p in list(model.named_parameters()):
        if not p.is_meta or (tied and name == "lm_head.weight"):
            continue
        if p.dim() >= 2:
            value = torch.randn(p.shape, generator=generator, device=device, dtype=torch.float32).mul_(std).to(dtype)
        else:
            value = torch.full(p.shape, 0.0 if name.endswith("bias") else norm_identity, dtype=dtype, device=device)
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    if tied:
        model.tie_weights()
    model.to(device)
    still = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still:
        raise ValueError(f"random_low_bit_model left {still[:3]} unbuilt: this architecture keeps weights "
                         "outside its parameters; build it in 16-bit instead.")
    setattr(model.config, CONFIG_KEY, {"format": base_format, "group_size": group_size if base_format == "2bit" else None,
                                       "modules": names})
    record_base_format(model, base_format)
    return model.eval()
