"""The formats a frozen base weight can be held in: one record per format, read by every layer.

A base format says how the decoder's projection weights sit in memory under the LoRA adapters:
16-bit (the model's dtype), NF4 (bitsandbytes' 4-bit, QLoRA), notebookkit's own 2-bit groups, or
ternary (BitNet b1.58: ``{-1, 0, +1}`` times a scale). Adding a format is one :class:`BaseFormat`
row in :data:`BASE_FORMATS` plus its kernels and tests; everything that depends on a format reads
the row:

* the loader (``from_pretrained(..., <load_flag>=True)``) and the model panel's weight choice;
* the memory model (:mod:`notebookkit.memory.estimate`): the bytes of a projection weight,
  :meth:`BaseFormat.bytes_per_weight`;
* the kernels (:mod:`notebookkit.kernels`: ``kernel_module`` holds the format's packing, its
  dequantisation and the products through it);
* export (``gguf_type``: the llama.cpp type ``save_pretrained_gguf`` suggests for a base that was
  trained in this format);
* the memory model's working sets (``product``: how a GEMM reads the weight, below).

How a product ``x W^T`` (and the input gradient ``dy W``) reads the weight, ``product``:

* ``"dense"``: the weight is used as it is (16-bit);
* ``"dequantise"``: a dense copy of the whole weight in the compute dtype is made for each product and
  freed after it (NF4 on the fused LoRA path: ``max(in * out) * s`` bytes at a time);
* ``"chunks"``: few rows (fewer than :data:`DEQUANT_CHUNK_MIN_ROWS`: decode, short prompts) are
  dequantised tile by tile inside the GEMM (``kernels/q2_matmul.py``, ``kernels/ternary_matmul.py``);
  more rows on a GPU go through cuBLAS on the weight dequantised a chunk of at most
  :data:`DEQUANT_CHUNK_BYTES` at a time (``kernels/chunked_dequant_matmul.py``: about 3.5x faster for
  2-bit and 15x for ternary at 8,192 rows), so one such chunk is alive during a product. Either way each
  product writes a fresh output, so the input gradient of a projection that shares its input with
  another (q/k/v, gate/up) is a new ``[N, in]`` buffer added to the first one's, where the dense paths
  accumulate in place (``addmm_``).

Bytes per weight, with ``K`` the input features of the projection (a weight is ``[N, K]``):

* 16-bit: ``s`` (2 for fp16 / bf16);
* NF4: half a byte of code plus the absmax of each 64 weights: fp32 (``4 / 64``), or with
  double quantisation a uint8 absmax plus one fp32 per 256 absmax (``1 / 64 + 4 / (64 * 256)``);
* 2-bit: a quarter byte of code plus an fp16 scale and an fp16 zero per 64 weights
  (``0.25 + 4 / 64`` = 2.5 bits);
* ternary: a quarter byte of code (four codes a byte) plus one fp16 scale per row
  (``0.25 + 2 / K``; about 2 bits).

This module imports nothing (no torch), so every layer can read it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BaseFormat", "BASE_FORMATS", "base_format", "PREQUANTISED_CONFIG_KEY", "DEQUANT_CHUNK_BYTES",
           "DEQUANT_CHUNK_MIN_ROWS"]

#: ``"chunks"`` products: the most bytes of dense weight one chunk holds, and the rows from which a GPU
#: product goes through dense chunks rather than the in-tile kernels
DEQUANT_CHUNK_BYTES = 32 * 2**20
DEQUANT_CHUNK_MIN_ROWS = 256

#: the ``config.json`` entry of a checkpoint saved with its projections in a low-bit format (2-bit,
#: ternary): ``{"format": name, "group_size": G or None, "modules": [full names of the packed layers]}``;
#: each listed layer's tensors are ``<name>.qweight`` (uint8 codes), ``<name>.scale`` (fp16) and, for
#: 2-bit, ``<name>.zero`` (fp16). Written and read by :mod:`notebookkit.models.low_bit`.
PREQUANTISED_CONFIG_KEY = "notebookkit_base_format"


@dataclass(frozen=True)
class BaseFormat:
    """Everything notebookkit knows about one format of frozen base weights.

    * ``name``: the key (``"16bit"``, ``"nf4"``, ``"2bit"``, ``"ternary"``); ``label``: what panels print;
    * ``load_flag``: the ``from_pretrained`` keyword that asks for it (``""``: the default, 16-bit);
    * ``kernel_module``: the ``notebookkit.kernels`` module of its packing and products (``""``: none);
    * ``code_bytes``: bytes of code per weight;
    * ``group_size``: weights that share one scale along a row (``0``: the whole row shares it);
    * ``group_bytes``: bytes of scale (and zero) per group; ``nested_group_bytes``: the same with
      double quantisation (NF4 only; ``None``: the format has no such option);
    * ``gguf_type``: the llama.cpp quantisation suggested for a GGUF export of a model trained on it;
    * ``product``: how a GEMM reads the weight, ``"dense"``, ``"dequantise"`` or ``"chunks"`` (module docstring).
    """

    name: str
    label: str
    load_flag: str
    kernel_module: str
    code_bytes: float
    group_size: int
    group_bytes: float
    nested_group_bytes: float | None
    gguf_type: str
    product: str = "dense"

    @property
    def quantised(self) -> bool:
        """Whether the weights are held in fewer bits than the compute dtype (every format but 16-bit)."""
        return bool(self.load_flag)

    def bytes_per_weight(self, in_features: int, dtype_bytes: int = 2, double_quant: bool = True) -> float:
        """Bytes one projection weight takes in this format (module docstring)."""
        if self.name == "16bit":
            return float(dtype_bytes)
        group = self.group_size or in_features
        scale = self.nested_group_bytes if (double_quant and self.nested_group_bytes is not None) else self.group_bytes
        return self.code_bytes + scale / group


BASE_FORMATS: dict[str, BaseFormat] = {
    f.name: f
    for f in (
        BaseFormat("16bit", "16-bit", "", "", code_bytes=0.0, group_size=0, group_bytes=0.0,
                   nested_group_bytes=None, gguf_type="q8_0"),
        BaseFormat("nf4", "NF4 (4-bit)", "load_in_4bit", "nf4", code_bytes=0.5, group_size=64, group_bytes=4.0,
                   nested_group_bytes=1.0 + 4.0 / 256, gguf_type="q4_k_m", product="dequantise"),
        BaseFormat("2bit", "2-bit (groups of 64)", "load_in_2bit", "q2", code_bytes=0.25, group_size=64,
                   group_bytes=4.0, nested_group_bytes=None, gguf_type="q2_k", product="chunks"),
        BaseFormat("ternary", "ternary (1.58-bit)", "load_in_ternary", "ternary", code_bytes=0.25, group_size=0,
                   group_bytes=2.0, nested_group_bytes=None, gguf_type="tq2_0", product="chunks"),
    )
}


def base_format(name: str) -> BaseFormat:
    """The record of ``name``, or a message that lists the formats there are."""
    try:
        return BASE_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown base format {name!r}; notebookkit holds base weights as one of "
                         f"{sorted(BASE_FORMATS)}.") from None
