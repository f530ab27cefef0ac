"""A mixture of experts in llama.cpp's GGUF layout (``qwen3moe``, ``gpt-oss``).

Facts of the format (the ``gguf`` package's name tables, llama.cpp's converter and model loader):

* llama.cpp keeps each projection of all experts in one 3-D tensor in the linear orientation,
  ``blk.N.ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` and ``ffn_down_exps`` ``[E, H, I]`` (PyTorch order;
  ggml's ``ne`` is reversed), with biases ``ffn_*_exps.bias`` ``[E, I]`` / ``[E, H]`` (gpt-oss); the router is
  ``ffn_gate_inp`` (``.bias`` for gpt-oss), gpt-oss's attention sinks ``attn_sinks.weight`` ``[heads]``.
* From Hugging Face's stacked ``gate_up_proj`` (merged by :mod:`.merge_experts`): Qwen3-MoE stores
  ``[E, 2I, H]`` with the halves concatenated, ``gate = W[:, :I]``, ``up = W[:, I:]``; gpt-oss stores
  ``[E, H, 2I]`` interleaved, so ``gate = W^T[:, 0::2]``, ``up = W^T[:, 1::2]`` (``W^T`` swaps the last two
  axes) and ``down = W_down^T``; the gate/up bias ``[E, 2I]`` splits the same way. :class:`ExpertPart`
  is that selection and its inverse (the K-quants' rounded reference maps the file back through it).
* Biases and the router stay F32 in the file, as llama.cpp's converter keeps them (the router
  decides which experts run: rounding it can change the choice).
* Metadata: ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length`` (the experts' ``I``);
  gpt-oss also ``sliding_window``.
* What llama.cpp fixes rather than reads, so a model that differs would compute something else there
  and the export refuses it (:func:`check_llama_cpp_moe`): ``qwen3moe`` always renormalises the top-k
  weights (``norm_topk_prob=True``) and has no dense layers (``mlp_only_layers``, ``decoder_sparse_step``);
  ``gpt-oss`` clamps its SwiGLU at ``alpha = 1.702``, ``limit = 7.0`` and alternates sliding-window and
  full attention starting with a sliding layer (``set_swa_pattern(2)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .checks import ExportError

__all__ = ["ExpertPart", "expert_parts", "stored_in_f32", "add_moe_metadata", "check_llama_cpp_moe",
           "LLAMA_CPP_GPT_OSS_SWIGLU"]

#: gpt-oss's SwiGLU constants as llama.cpp's graph fixes them (``alpha``, ``limit``)
LLAMA_CPP_GPT_OSS_SWIGLU = (1.702, 7.0)


@dataclass(frozen=True)
class ExpertPart:
    """One llama.cpp tensor cut from a stacked Hugging Face one: swap the last two axes (``transpose``),
    then keep ``rows`` of axis 1."""

    transpose: bool
    rows: slice

    def _oriented(self, full: torch.Tensor) -> torch.Tensor:
        return full.transpose(1, 2) if self.transpose else full

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return self._oriented(full)[:, self.rows]

    def put(self, full: torch.Tensor, part: torch.Tensor) -> None:
        """Write ``part`` back where :meth:`take` read it (in place, into ``full``)."""
        self._oriented(full)[:, self.rows] = part


def expert_parts(name: str, shape: tuple[int, ...], moe: Any) -> Optional[list[tuple[str, ExpertPart, tuple[int, ...]]]]:
    """``[(Hugging Face name llama.cpp's name table knows, part, shape in the file), ...]`` for a stacked
    expert weight or bias of family layout ``moe`` (``families.MoE``), None for any other tensor."""
    prefix, _, pname = name.rpartition(".")
    if not ("." + prefix).endswith("." + moe.experts) or pname not in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        return None
    bias = pname.endswith("_bias")
    suffix = ".bias" if bias else ".weight"
    transpose = moe.transposed and not bias
    if pname.startswith("down_proj"):
        part = ExpertPart(transpose, slice(None))
        return [(f"{prefix}.down_proj{suffix}", part, tuple(part.take(torch.empty(shape, device="meta")).shape))]
    interleaved = moe.activation == "gpt_oss"
    width = shape[-1] if (bias or moe.transposed) else shape[1]
    half = width // 2
    gate = ExpertPart(transpose, slice(0, None, 2) if interleaved else slice(0, half))
    up = ExpertPart(transpose, slice(1, None, 2) if interleaved else slice(half, None))
    meta = torch.empty(shape, device="meta")
    return [(f"{prefix}.gate_proj{suffix}", gate, tuple(gate.take(meta).shape)),
            (f"{prefix}.up_proj{suffix}", up, tuple(up.take(meta).shape))]


def stored_in_f32(name: str, moe: Any) -> bool:
    """Whether the GGUF keeps the Hugging Face tensor ``name`` in F32 whatever the method: a bias, or the router."""
    return moe is not None and (name.endswith(("bias", "_bias")) or name.endswith(f".{moe.router}.weight"))


def add_moe_metadata(writer: Any, config: Any, moe: Any) -> None:
    """The expert counts and width (and gpt-oss's sliding window) llama.cpp reads."""
    writer.add_expert_count(int(getattr(config, moe.num_experts)))
    writer.add_expert_used_count(int(config.num_experts_per_tok))
    writer.add_expert_feed_forward_length(int(getattr(config, moe.intermediate)))
    if moe.activation == "gpt_oss":
        writer.add_sliding_window(int(config.sliding_window))


def check_llama_cpp_moe(config: Any, family: str, moe: Any) -> None:
    """Raise :class:`ExportError` where the model differs from what llama.cpp fixes for its architecture
    (module docstring), naming the setting and what to do."""
    tail = ("Save it with model.save_pretrained_merged(folder, tokenizer) instead: that folder loads in "
            "transformers and vLLM.")
    if moe.routing == "softmax_topk":
        if not getattr(config, "norm_topk_prob", True):
            raise ExportError(f"GGUF export: this {family} model has norm_topk_prob=False, but llama.cpp's qwen3moe always "
                              f"renormalises the chosen experts' weights, so the GGUF would compute another model. {tail}")
        dense = list(getattr(config, "mlp_only_layers", None) or [])
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        if dense or step != 1:
            raise ExportError(f"GGUF export: this {family} model has dense MLP layers (mlp_only_layers={dense}, "
                              f"decoder_sparse_step={step}); llama.cpp's qwen3moe expects experts in every layer. {tail}")
    if moe.activation == "gpt_oss":
        alpha, limit = LLAMA_CPP_GPT_OSS_SWIGLU
        got = (float(getattr(config, "swiglu_alpha", alpha)), float(getattr(config, "swiglu_limit", limit)))
        if got != (alpha, limit):
            raise ExportError(f"GGUF export: this {family} model's SwiGLU has alpha={got[0]}, swiglu_limit={got[1]}; "
                              f"llama.cpp's gpt-oss fixes alpha={alpha}, limit={limit}, so the GGUF would compute "
                              f"another model. {tail}")
        layer_types = list(getattr(config, "layer_types", None) or [])
        expected = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(int(config.num_hidden_layers))]
        if layer_types and layer_types != expected:
            raise ExportError(f"GGUF export: this {family} model's attention layers are layer_types={layer_types}; llama.cpp's "
                              f"gpt-oss alternates sliding and full attention starting with a sliding layer. {tail}")
