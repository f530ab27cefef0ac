"""The merged model with its weights rounded as a GGUF file stores them, as a plain fp32 Hugging Face model.

What llama.cpp computes from a GGUF file differs from the adapter model by two roundings: the
weights' rounding to the file's format, and llama.cpp's own arithmetic, whose CPU products round
the activations to the weight's companion type (f16 for F16, bf16 for BF16, q8_0 blocks for Q8_0;
finer q8 blocks for Q4_0 and the K-quants). The first is measured here without llama.cpp, by running
this model in fp32 Hugging Face arithmetic on the same tokens (:func:`notebookkit.export.verify.check_gguf_file`
uses it to say whether llama.cpp's differences are the size the format explains):

* direct formats (``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_0``): every tensor the writer stores in a
  rounded type (:func:`notebookkit.export.gguf_file.tensor_type`) is taken from the merged fp32
  weights and rounded by ``gguf.quants`` (quantise, then dequantise), in Hugging Face's own names
  and layout: independent of the writer's tensor names and layout conversions, so a tensor written
  in the wrong place or permuted wrongly shows as llama.cpp differing from this model (a block runs
  along a weight's input features, ``PlannedTensor.in_dim``: gpt-oss's stacked experts hold them on
  axis 1; a mixture of experts' biases and router stay F32, :func:`notebookkit.export.gguf_experts.stored_in_f32`);
* K-quants: ``gguf`` has no Python quantiser for them, so the file's own tensors are decoded
  (``gguf.quants.dequantize``) and mapped back through the family's table (rows un-permuted,
  Gemma's ``+1`` removed). That relies on the writer's table, which the direct formats check.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from .gguf_arch import gguf_family, unpermute_for_llama_rope
from .merge import base_model_of, merged_config, plan_merged_tensors

__all__ = ["rounded_reference_model"]


def _round_trip(values: np.ndarray, qtype) -> np.ndarray:
    import gguf

    if qtype == gguf.GGMLQuantizationType.F32:
        return values
    if qtype == gguf.GGMLQuantizationType.F16:
        return values.astype(np.float16).astype(np.float32)
    return np.asarray(gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype), dtype=np.float32).reshape(values.shape)


def _from_file(model: nn.Module, path: os.PathLike, state: dict[str, torch.Tensor]) -> None:
    """Overwrite ``state`` with the file's decoded tensors, in Hugging Face names and layout."""
    import gguf

    from .gguf_file import decoder_config, gguf_tensors

    family = gguf_family(decoder_config(base_model_of(model).config))
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for tensor in gguf_tensors(model, family):
        if tensor.source is None:
            continue
        t = stored[tensor.name]
        values = torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).copy())
        values = values.reshape(tensor.shape)
        if tensor.permute_heads:
            values = unpermute_for_llama_rope(values, tensor.permute_heads)
        if tensor.add:
            values = values - tensor.add
        if tensor.part is not None:  # one of the tensors cut from a stacked expert weight
            tensor.part.put(state[tensor.source.name], values)
            continue
        state[tensor.source.name] = values


@torch.no_grad()
def rounded_reference_model(model: nn.Module, method: str, path: Optional[os.PathLike] = None) -> nn.Module:
    """A plain fp32 CPU model with ``model``'s merged weights rounded as ``method``'s GGUF stores them
    (module docstring); ``path`` (the written file) is needed for the K-quants."""
    from transformers import AutoModelForCausalLM

    from .gguf_experts import stored_in_f32
    from .gguf_file import GGUF_METHODS, decoder_config, tensor_type

    base = base_model_of(model)
    moe = gguf_family(decoder_config(base.config)).moe
    plan = plan_merged_tensors(model, torch.float32)
    state = {t.name: t.make(torch.device("cpu")).float() if t.dtype.is_floating_point else t.make(torch.device("cpu"))
             for t in plan}
    if method in GGUF_METHODS:
        for planned in plan:
            values = state[planned.name]
            if values.is_floating_point():
                rows = values.movedim(planned.in_dim, -1)  # blocks run along the input features
                qtype = tensor_type(tuple(rows.shape), method, keep_f32=stored_in_f32(planned.name, moe))
                rounded = torch.from_numpy(_round_trip(rows.contiguous().numpy(), qtype).reshape(rows.shape))
                state[planned.name] = rounded.movedim(-1, planned.in_dim).contiguous()
    else:
        if path is None:
            raise ValueError(f"the rounding of {method} is read from its file: pass path=")
        _from_file(model, path, state)
    config = merged_config(base)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = reference.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"the rounded reference does not match the model: missing {missing}, unexpected {unexpected}")
    if tied:
        reference.tie_weights()
    return reference.eval()
