"""The export forms notebookkit writes: one record per form, read by every layer.

Adding a form is one :class:`ExportForm` row in :data:`EXPORT_FORMS` (or a GGUF quantisation: one
:class:`GGUFType` row in :data:`GGUF_TYPES`) plus its writer and tests; everything that depends on a
form reads the row:

* the writers (:mod:`notebookkit.export.merged`'s ``save_method`` list, :mod:`notebookkit.export.gguf_file`'s
  quantisation methods, encodings and size estimate, :mod:`notebookkit.export.kquants`'s llama.cpp file types);
* the model methods (:mod:`notebookkit.export.bind`: ``writer`` and ``hub`` name them) and the upload
  (:mod:`notebookkit.export.hub`);
* the reload checks (:mod:`notebookkit.export.verify`: ``check``, and each GGUF type's tolerance);
* the report (:mod:`notebookkit.export.report`): one row per chosen form, in this table's order;
* the memory model (:mod:`notebookkit.memory.export`): ``memory`` names what a merge holds per layer;
* the export panel (:mod:`notebookkit.widgets.export_panel`): ``label``, the forms and GGUF types it offers.

``tests/test_export_forms.py`` fails when a row lacks any of these consumers.

This module imports nothing (no torch, no gguf), so every layer can read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ExportForm:
    """One thing ``save_pretrained_merged`` / ``save_pretrained_gguf`` can write.

    * ``writes``: what lands on disk, in a sentence;
    * ``writer`` / ``hub``: the model methods (:mod:`notebookkit.export.bind`) that write it and upload it;
    * ``check``: the reload check of :mod:`notebookkit.export.verify` (``"merged_folder"``: reload with
      transformers and compare logits; ``"gguf_file"``: llama.cpp against Hugging Face; ``None``: none);
    * ``memory``: what :mod:`notebookkit.memory.export` counts on the merging device per layer
      (``"adapter"``: nothing is merged; ``"merge"``: the fp32 merge and its copy in the written dtype;
      ``"merge_nf4"``: the fp32 merge re-quantised to NF4);
    * ``label``: the export panel's label; ``""`` when the panel does not offer the form;
    * ``quantized``: the form takes GGUF quantisation types (:data:`GGUF_TYPES`).
    """

    name: str  # save_method for save_pretrained_merged, the report's form, the panel's value
    writes: str
    writer: str
    hub: str
    check: Optional[str]
    memory: str
    label: str = ""
    quantized: bool = False


@dataclass(frozen=True)
class GGUFType:
    """One GGUF ``quantization_method``.

    * ``ggml_type`` / ``file_type``: the ``gguf`` package's ``GGMLQuantizationType`` and ``LlamaFileType``
      member names, for a type notebookkit encodes itself; ``None`` for one llama.cpp's quantiser makes;
    * ``llama_ftype``: llama.cpp's ``llama_ftype`` value for its quantiser (``llama_model_quantize``,
      from ``llama-cpp-python``), which reads a 16-bit GGUF notebookkit wrote first; ``None`` otherwise;
    * ``bytes_per_param``: size on disk per weight, for the free-space check;
    * ``tolerance``: the largest teacher-forced logit difference, relative to the largest logit, that
      :func:`notebookkit.export.verify.check_gguf_file` allows (see ``GGUF_TOLERANCE`` there);
    * ``aliases``: other names ``quantization_method`` accepts for it;
    * ``in_panel``: offered by the export panel.
    """

    name: str
    ggml_type: Optional[str]
    file_type: Optional[str]
    llama_ftype: Optional[int]
    bytes_per_param: float
    tolerance: float
    aliases: tuple[str, ...] = ()
    in_panel: bool = True

    @property
    def needs_llama_cpp(self) -> bool:
        """True when llama.cpp's quantiser makes this type (``pip install llama-cpp-python``)."""
        return self.llama_ftype is not None


EXPORT_FORMS: dict[str, ExportForm] = {f.name: f for f in (
    ExportForm("lora", "the LoRA adapter in PEFT's format, with the tokenizer",
               writer="save_pretrained_merged", hub="push_to_hub_merged", check=None, memory="adapter", label="lora"),
    ExportForm("merged_16bit", "the adapter merged into 16-bit safetensors shards that plain transformers loads",
               writer="save_pretrained_merged", hub="push_to_hub_merged", check="merged_folder", memory="merge",
               label="merged_16bit"),
    ExportForm("merged_4bit_forced", "the merge re-quantised to NF4, a folder transformers + bitsandbytes load in 4-bit",
               writer="save_pretrained_merged", hub="push_to_hub_merged", check="merged_folder", memory="merge_nf4"),
    ExportForm("gguf", "one GGUF file per quantisation type for llama.cpp / Ollama / LM Studio, and a Modelfile",
               writer="save_pretrained_gguf", hub="push_to_hub_gguf", check="gguf_file", memory="merge", label="gguf",
               quantized=True),
)}

GGUF_TYPES: dict[str, GGUFType] = {t.name: t for t in (
    GGUFType("f32", "F32", "ALL_F32", None, 4, 2.0**-10, aliases=("fp32",), in_panel=False),
    GGUFType("f16", "F16", "MOSTLY_F16", None, 2, 2.0**-8, aliases=("not_quantized", "fp16")),
    GGUFType("bf16", "BF16", "MOSTLY_BF16", None, 2, 2.0**-5, aliases=("bf",)),
    GGUFType("q8_0", "Q8_0", "MOSTLY_Q8_0", None, 34 / 32, 2.0**-4, aliases=("fast_quantized",)),
    GGUFType("q4_0", "Q4_0", "MOSTLY_Q4_0", None, 18 / 32, 2.0**-1),
    GGUFType("q4_k_m", None, None, 15, 0.6, 2.0**-2, aliases=("quantized",)),
    GGUFType("q5_k_m", None, None, 17, 0.7, 2.0**-3),
    GGUFType("q6_k", None, None, 18, 0.82, 2.0**-4),
    # q2_k (LLAMA_FTYPE_MOSTLY_Q2_K; the type base_formats suggests for a 2-bit base): 84 bytes a block of 256,
    # but llama.cpp's Q2_K mix keeps v/o/down in Q3_K-Q4_K and the output in Q6_K: about 0.39 bytes a weight
    # on disk at 8B (like q4_k_m's 0.6, the mix's average, for the free-space check).
    # Measured with verify.check_gguf_file (relative teacher-forced logit difference, 4 prompts x 8 tokens) on
    # llama models whose rows are whole Q2_K blocks (hidden 256, MLP 512, random weights of std 0.02, three
    # seeds; llama.cpp's mix: Q2_K q/k/gate/up, Q3_K v/o/down, Q6_K embedding): 0.19-0.22 from a 2-bit base,
    # 0.20-0.25 ternary, 0.23-0.29 16-bit, each explained by the file's own rounding; on tiny-llama (rows of
    # 128 and 384, which llama.cpp writes in Q4_0 instead) 0.03-0.06. 2^-1 keeps 1.7x over the largest.
    GGUFType("q2_k", None, None, 10, 0.39, 2.0**-1),
)}

#: The refused form: re-quantising the merge to 4-bit silently is lossy (``merged_4bit_forced`` says so).
REFUSED_SAVE_METHOD = "merged_4bit"


def export_form(name: str) -> ExportForm:
    """The record of form ``name`` (``"merged_16bit"``, ``"gguf"``, ...); a readable error otherwise."""
    try:
        return EXPORT_FORMS[name]
    except KeyError:
        raise ValueError(f"Unknown export form {name!r}; the forms are: {', '.join(EXPORT_FORMS)}.") from None


def forms_written_by(writer: str) -> tuple[str, ...]:
    """The forms one model method writes (``"save_pretrained_merged"`` -> ``("lora", "merged_16bit", ...)``)."""
    return tuple(f.name for f in EXPORT_FORMS.values() if f.writer == writer)


def gguf_aliases() -> dict[str, str]:
    """Every alias of a GGUF type, to the type's name (``"fast_quantized"`` -> ``"q8_0"``)."""
    return {alias: t.name for t in GGUF_TYPES.values() for alias in t.aliases}
