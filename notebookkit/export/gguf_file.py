"""``model.save_pretrained_gguf``: the merged model as a GGUF file for llama.cpp / Ollama / LM Studio.

The merged weights come from :mod:`.merge` in fp32 (NF4, 2-bit and ternary bases decoded by notebookkit,
``W + s*B@A``),
are converted to llama.cpp's layout by the family's row of :mod:`.gguf_arch` and encoded with the
``gguf`` package: ``f32``, ``f16``, ``bf16``, ``q8_0`` and ``q4_0`` directly (``gguf.quants``), the
K-quants ``q4_k_m``, ``q5_k_m``, ``q6_k`` and ``q2_k`` by llama.cpp's own quantiser (``llama_model_quantize``
from ``llama-cpp-python``) from a 16-bit GGUF written first. 1-D tensors (norms, biases) and
``rope_freqs`` stay F32; a 2-D tensor whose rows do not divide into the quant's blocks falls back
to F16, as llama.cpp's converter does. A mixture of experts' stacked expert weights become llama.cpp's
per-projection expert tensors (:mod:`.gguf_experts`; gate and up are cut from one merge of ``gate_up``).

Several methods in one call share one pass over the merged weights (each tensor is merged once
and encoded for every file). Files are written under a temporary name in the target folder and
renamed when complete. An Ollama ``Modelfile`` (:mod:`.modelfile`) is written beside them.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn as nn

from notebookkit.export_forms import GGUF_TYPES, gguf_aliases
from notebookkit.models.patching.checkpointing import release_host_buffers

from .checks import ExportError, check_output_folder, format_bytes, require_notebookkit_model
from .gguf_experts import ExpertPart, add_moe_metadata, expert_parts, stored_in_f32
from .gguf_arch import GGUFFamily, add_yarn_metadata, gguf_family, llama3_rope_factors, permute_for_llama_rope, rope_parameters
from .gguf_vocab import tokenizer_metadata
from .merge import PlannedTensor, base_model_of, plan_merged_tensors
from .merged import model_dtype
from .merged_folder import ExportResult, MergeDevice

__all__ = ["save_pretrained_gguf", "GGUF_METHODS", "KQUANT_METHODS", "normalize_quantization_methods", "gguf_file_name"]

#: the types notebookkit encodes itself, and those llama.cpp's quantiser makes (with its ``llama_ftype``)
GGUF_METHODS = tuple(t.name for t in GGUF_TYPES.values() if not t.needs_llama_cpp)
KQUANT_METHODS = {t.name: t.llama_ftype for t in GGUF_TYPES.values() if t.needs_llama_cpp}
ALIASES = gguf_aliases()


def normalize_quantization_methods(methods: Union[str, Sequence[str]]) -> list[str]:
    """Lower-cased canonical method names, aliases resolved; raises listing the valid ones."""
    items = [methods] if isinstance(methods, str) else list(methods)
    if not items:
        raise ExportError("quantization_method is empty: pass one method such as 'q8_0', or a list of them.")
    out: list[str] = []
    for item in items:
        name = ALIASES.get(str(item).strip().lower(), str(item).strip().lower())
        if name not in GGUF_METHODS and name not in KQUANT_METHODS:
            valid = ", ".join([*GGUF_METHODS, *KQUANT_METHODS])
            aliases = ", ".join(f"{a} = {b}" for a, b in ALIASES.items() if "_" in a)
            raise ExportError(f"quantization_method={item!r} is not one GGUF export knows. Valid: {valid} (aliases: {aliases}).")
        if name not in out:
            out.append(name)
    return out


def gguf_file_name(folder: Path, method: str) -> Path:
    return folder / f"{folder.name}.{method.upper()}.gguf"


def _ggml_type(method: str):
    import gguf

    return gguf.GGMLQuantizationType[GGUF_TYPES[method].ggml_type]


def _file_type(method: str) -> int:
    import gguf

    return int(gguf.LlamaFileType[GGUF_TYPES[method].file_type])


@dataclass
class GGUFTensor:
    """One tensor of the GGUF file: its llama.cpp name and how it is derived from the merged weights."""

    name: str
    shape: tuple[int, ...]
    source: Optional[PlannedTensor]  # None for tensors made from the config (rope_freqs)
    constant: Optional[torch.Tensor] = None
    permute_heads: int = 0  # > 0: reorder rows for llama.cpp's rotary layout
    add: float = 0.0  # Gemma's (1 + w) norms
    part: Optional[ExpertPart] = None  # cut from a stacked expert tensor (gguf_experts)
    keep_f32: bool = False  # stored F32 whatever the method (biases and router of a mixture of experts)

    def merged(self, chooser: MergeDevice) -> torch.Tensor:
        """The merged source tensor, fp32 on the CPU."""
        return self.source.make(chooser.pick(self.source)).to(device="cpu", dtype=torch.float32)

    def compute(self, chooser: MergeDevice, merged: Optional[torch.Tensor] = None) -> np.ndarray:
        """The values as the file stores them; ``merged``: the source already merged (an expert part's stack)."""
        if self.source is None:
            values = self.constant
        else:
            values = merged if merged is not None else self.merged(chooser)
            if self.part is not None:
                values = self.part.take(values)
        if self.permute_heads:
            values = permute_for_llama_rope(values, self.permute_heads)
        if self.add:
            values = values + self.add
        return values.contiguous().numpy()


def decoder_config(config: Any) -> Any:
    """The text decoder's config (a multimodal config's text part; the config itself otherwise)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def gguf_tensors(model: nn.Module, family: GGUFFamily) -> list[GGUFTensor]:
    """Every tensor the GGUF file holds for ``model``: llama.cpp's name and the conversion it needs."""
    import gguf

    config = decoder_config(base_model_of(model).config)
    n_layers = int(config.num_hidden_layers)
    n_heads = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == family.arch)
    names = gguf.get_tensor_name_map(arch, n_layers)
    tensors: list[GGUFTensor] = []
    rope = rope_parameters(config)
    rope_type = rope.get("rope_type", "default")
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // n_heads)
    if rope_type == "llama3":
        factors = llama3_rope_factors(head_dim, rope)
        tensors.append(GGUFTensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", tuple(factors.shape), None, factors))
    for planned in plan_merged_tensors(model, torch.float32):
        parts = expert_parts(planned.name, planned.shape, family.moe) if family.moe is not None else None
        if parts is not None:  # a stacked expert weight / bias: llama.cpp's gate / up / down tensors
            for hf_name, part, shape in parts:
                gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
                if gname is None:
                    raise ExportError(f"GGUF export does not know where {hf_name!r} goes in llama.cpp's {family.arch} layout.")
                tensors.append(GGUFTensor(gname, shape, planned, part=part, keep_f32=stored_in_f32(planned.name, family.moe)))
            continue
        gname = names.get_name(planned.name, try_suffixes=(".weight", ".bias"))
        if gname is not None and not gname.endswith((".weight", ".bias")):  # a bare parameter (gpt-oss's sinks)
            gname += ".weight"
        if gname is None:
            raise ExportError(f"GGUF export does not know where the tensor {planned.name!r} goes in llama.cpp's {family.arch} layout.")
        heads = 0
        if family.permute_qk and planned.name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = n_heads
        elif family.permute_qk and planned.name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = n_kv
        add = family.norm_shift if planned.name.endswith("norm.weight") else 0.0
        tensors.append(GGUFTensor(gname, planned.shape, planned, permute_heads=heads, add=add,
                                  keep_f32=stored_in_f32(planned.name, family.moe)))
    return tensors


def _add_model_metadata(writer: Any, model: nn.Module, family: GGUFFamily, method: str) -> None:
    import gguf

    config = decoder_config(base_model_of(model).config)
    n_heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // n_heads)
    writer.add_name(str(getattr(config, "_name_or_path", "") or "notebookkit export").rstrip("/").split("/")[-1])
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    if family.moe is not None:
        add_moe_metadata(writer, config, family.moe)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or n_heads))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    writer.add_file_type(_file_type(method))
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", "default")
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope_type == "yarn":
        add_yarn_metadata(writer, rope)
    elif rope_type not in ("default", "llama3"):
        raise ExportError(f"GGUF export does not write rope_type={rope_type!r} yet (supported: default, linear, llama3, yarn).")
    if family.softcaps:
        if getattr(config, "attn_logit_softcapping", None):
            writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        if getattr(config, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    elif getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    if family.sliding_pattern and getattr(config, "sliding_window", None):
        writer.add_sliding_window(int(config.sliding_window))
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in layer_types])
        local = rope_parameters(config, "sliding_attention")
        if "rope_theta" in local:
            writer.add_rope_freq_base_swa(float(local["rope_theta"]))
    query_scalar = getattr(config, "query_pre_attn_scalar", None)
    if query_scalar is not None and int(query_scalar) != head_dim:
        raise ExportError(
            f"query_pre_attn_scalar={query_scalar} differs from head_dim={head_dim}; llama.cpp scales attention by "
            "1/sqrt(head_dim) for this family, so the GGUF would not match the model."
        )


def _add_tokenizer_metadata(writer: Any, meta: dict[str, Any]) -> None:
    writer.add_tokenizer_model(meta["model"])
    writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["token_type"])
    if "scores" in meta:  # SentencePiece-style: llama.cpp merges by score
        writer.add_token_scores(meta["scores"])
        writer.add_add_space_prefix(meta["add_space_prefix"])
    if "merges" in meta:
        writer.add_token_merges(meta["merges"])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id), ("pad", writer.add_pad_token_id),
                     ("unk", writer.add_unk_token_id), ("eot", writer.add_eot_token_id)):
        if key in meta:
            add(meta[key])
    writer.add_add_bos_token(meta["add_bos"])
    writer.add_add_eos_token(meta["add_eos"])
    if "chat_template" in meta:
        writer.add_chat_template(meta["chat_template"])


def tensor_type(shape: tuple[int, ...], method: str, from_weights: bool = True, keep_f32: bool = False):
    """The ggml type a tensor of ``shape`` is stored in, in ``method``'s file (a direct method): F32 for
    1-D tensors, tensors made from the config (``from_weights=False``) and ``keep_f32`` ones (a mixture of
    experts' biases and router), else the method's type, or F16 where a row (the last axis, the input
    features) does not divide into the type's blocks."""
    import gguf

    t = gguf.GGMLQuantizationType
    if len(shape) < 2 or not from_weights or keep_f32 or method == "f32":
        return t.F32
    qtype = _ggml_type(method)
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return t.F16 if shape[-1] % block else qtype


def _encoding(tensor: GGUFTensor, method: str):
    """(ggml type, numpy dtype for add_tensor_info, byte count) of one tensor in one method's file."""
    import gguf

    t = gguf.GGMLQuantizationType
    qtype = tensor_type(tensor.shape, method, tensor.source is not None, tensor.keep_f32)
    n = int(np.prod(tensor.shape))
    if qtype == t.F32:
        return qtype, np.float32, n * 4, tensor.shape
    if qtype == t.F16:
        return qtype, np.float16, n * 2, tensor.shape
    byte_shape = gguf.quants.quant_shape_to_byte_shape(tensor.shape, qtype)
    return qtype, np.uint8, int(np.prod(byte_shape)), byte_shape


def _encode(values: np.ndarray, qtype) -> np.ndarray:
    import gguf

    if qtype == gguf.GGMLQuantizationType.F32:
        return values.astype(np.float32, copy=False)
    if qtype == gguf.GGMLQuantizationType.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


def _write_gguf_files(model, tokenizer, family, methods: list[str], paths: list[Path], chooser: MergeDevice) -> None:
    """One pass over the merged weights, writing one GGUF file per method."""
    import gguf

    config = decoder_config(base_model_of(model).config)
    tensors = gguf_tensors(model, family)
    vocab = tokenizer_metadata(tokenizer, int(config.vocab_size))
    writers, encodings = [], []
    for method, path in zip(methods, paths):
        writer = gguf.GGUFWriter(path, family.arch)
        _add_model_metadata(writer, model, family, method)
        _add_tokenizer_metadata(writer, vocab)
        codes = [_encoding(t, method) for t in tensors]
        for t, (qtype, np_dtype, nbytes, shape) in zip(tensors, codes):
            raw = None if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else qtype
            writer.add_tensor_info(t.name, shape, np.dtype(np_dtype), nbytes, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writers.append(writer)
        encodings.append(codes)
    try:
        held = (None, None)  # the stacked expert tensor last merged: its gate and up parts are cut from one merge
        for i, tensor in enumerate(tensors):
            if tensor.part is None:
                held = (None, None)
            elif held[0] is not tensor.source:
                held = (tensor.source, tensor.merged(chooser))
            values = tensor.compute(chooser, held[1])
            for writer, codes in zip(writers, encodings):
                writer.write_tensor_data(_encode(values, codes[i][0]))
            del values
    finally:
        for writer in writers:
            writer.close()


def _estimated_bytes(model: nn.Module, methods: list[str]) -> int:
    n = sum(int(np.prod(t.shape)) for t in plan_merged_tensors(model, torch.float32))
    need = sum(n * GGUF_TYPES[m].bytes_per_param for m in methods)
    if any(m in KQUANT_METHODS for m in methods):
        need += n * 2  # the 16-bit GGUF llama.cpp's quantiser reads
    return int(need) + 32 * 2**20


def save_pretrained_gguf(
    model: nn.Module,
    save_directory: Union[str, os.PathLike],
    tokenizer: Any = None,
    quantization_method: Union[str, Sequence[str]] = "q8_0",
    maximum_memory_usage: float = 0.75,
    temporary_location: Optional[Union[str, os.PathLike]] = None,
    modelfile: bool = True,
    verbose: bool = True,
    **kwargs: Any,
) -> list[ExportResult]:
    """Write the merged model as GGUF file(s) for llama.cpp, Ollama and LM Studio.

    Args:
        save_directory: folder for ``<folder>.<METHOD>.gguf`` and the Ollama ``Modelfile``.
        tokenizer: the model's tokenizer (required: its vocabulary, merges, special tokens and chat
            template go into the file).
        quantization_method: one of ``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_0`` (written by
            notebookkit), ``q4_k_m``, ``q5_k_m``, ``q6_k``, ``q2_k`` (llama.cpp's quantiser, needs
            ``pip install llama-cpp-python``), or a list of them; aliases ``not_quantized`` (f16),
            ``fast_quantized`` (q8_0), ``quantized`` (q4_k_m).
        maximum_memory_usage: GPU fraction the merge may fill (see ``save_pretrained_merged``).
        temporary_location: folder for the 16-bit GGUF the K-quants are made from (default: the
            target folder); it is deleted afterwards.
        modelfile: also write an Ollama ``Modelfile`` for the first file.

    Returns:
        one :class:`ExportResult` per method, in the order asked.
    """
    base = require_notebookkit_model(model, "save_pretrained_gguf")
    release_host_buffers(model)  # the merge wants host RAM, not offloading's pinned buffers of the last step
    methods = normalize_quantization_methods(quantization_method)
    family = gguf_family(decoder_config(base.config))
    if tokenizer is None:
        raise ExportError("save_pretrained_gguf needs the tokenizer: model.save_pretrained_gguf(folder, tokenizer, ...).")
    kquants = [m for m in methods if m in KQUANT_METHODS]
    if kquants:
        from .kquants import require_llama_cpp

        require_llama_cpp(kquants)
    target = check_output_folder(save_directory, _estimated_bytes(model, methods), "the GGUF export")
    if temporary_location is not None:
        check_output_folder(temporary_location, 0, "the temporary 16-bit GGUF")
    target.mkdir(parents=True, exist_ok=True)
    scratch = Path(temporary_location).expanduser() if temporary_location is not None else target
    scratch.mkdir(parents=True, exist_ok=True)
    source_method = "bf16" if model_dtype(model) == torch.bfloat16 else "f16"
    direct = [m for m in methods if m in GGUF_METHODS]
    if kquants and source_method not in direct:
        direct.append(source_method)
    tag = uuid.uuid4().hex[:8]
    partial = {m: (scratch if (m == source_method and m not in methods) else target) / f".{m}.{tag}.partial.gguf" for m in direct}
    chooser = MergeDevice(maximum_memory_usage)
    start = time.perf_counter()
    results: dict[str, ExportResult] = {}
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            _write_gguf_files(model, tokenizer, family, direct, [partial[m] for m in direct], chooser)
        seconds = time.perf_counter() - start
        for m in kquants:
            from .kquants import quantize_with_llama_cpp

            k_start = time.perf_counter()
            k_partial = target / f".{m}.{tag}.partial.gguf"
            partial[m] = k_partial
            quantize_with_llama_cpp(partial[source_method], k_partial, m)
            results[m] = ExportResult(m, gguf_file_name(target, m), seconds=seconds + time.perf_counter() - k_start)
        for m in direct:
            if m in methods:
                results[m] = ExportResult(m, gguf_file_name(target, m), seconds=seconds)
        for m in methods:
            os.replace(partial[m], results[m].path)
            results[m].files = [results[m].path]
            results[m].bytes_on_disk = results[m].path.stat().st_size
            results[m].merged_on = dict(chooser.counts)
    finally:
        model.train(was_training)
        for path in partial.values():
            if path.exists():
                path.unlink()
    ordered = [results[m] for m in methods]
    if modelfile:
        from .modelfile import write_modelfile

        write_modelfile(target, ordered[0].path, tokenizer)
    if verbose:
        for r in ordered:
            print(f"notebookkit: {r.form} GGUF written to {r.path} ({format_bytes(r.bytes_on_disk)})")
    return ordered
