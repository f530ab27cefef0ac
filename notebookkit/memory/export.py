"""Memory of a merged export: what merging LoRA into the base weights needs beyond the loaded model.

The export merges one linear layer at a time (``notebookkit.export.merge``): for a projection of
``out x in`` with LoRA rank ``r`` it holds, on the device that merges it,

    fp32 weight (NF4 / 2-bit / ternary decoded,       4 * out * in
    or 16-bit upcast)
    fp32 LoRA factors A [r, in] and B [out, r]        4 * r * (out + in)
    the merged weight in the written dtype            b * out * in       (b = 2 for 16-bit)

and frees them before the next one; ``W += s * B @ A`` runs in place (``addmm_``), so no product
buffer of its own. On a GPU a packed base (NF4, 2-bit, ternary) is decoded by its kernel straight into
that fp32 weight, from the packed tensors already there; a 2-bit / ternary projection without an adapter
is written dense the same way (``r = 0``). The host holds one merged tensor at a time on its way to the file
(``b * out * in``, the largest one, usually the embedding). :func:`merge_working_bytes` is the
per-layer formula the export's GPU budget check uses; :func:`export_memory` applies it to a whole
model shape.

``merged_4bit_forced`` re-quantises each merged weight to NF4 on the merging device
(``notebookkit.export.nf4_quantize``): the fp32 merged weight and factors as above, the packed codes
and scales (``n/2 + n/16`` bytes), and the quantiser's temporaries for one chunk of
``NF4_CHUNK_ELEMENTS`` values (about 40 bytes each: fp32 and int64 copies, the fp64 error sums):
:func:`nf4_merge_working_bytes`.

Which of these a form holds is the ``memory`` of its row in :mod:`notebookkit.export_forms`
(``"merge"``, ``"merge_nf4"``, or ``"adapter"``: nothing merged): :func:`layer_working_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from notebookkit.export_forms import export_form

from .shapes import PROJECTIONS, ModelShape

__all__ = ["merge_working_bytes", "nf4_merge_working_bytes", "layer_working_bytes", "NF4_CHUNK_ELEMENTS", "ExportMemory",
           "export_memory"]

NF4_CHUNK_ELEMENTS = 2**21  # values the NF4 quantiser processes at a time
_NF4_BYTES_PER_CHUNK_ELEMENT = 40


def merge_working_bytes(out_features: int, in_features: int, rank: int, out_bytes: int = 2) -> int:
    """Device bytes to merge one linear layer: fp32 weight and factors, and the written copy."""
    return out_features * in_features * (4 + out_bytes) + rank * (out_features + in_features) * 4


def nf4_merge_working_bytes(out_features: int, in_features: int, rank: int) -> int:
    """Device bytes to merge one linear layer and re-quantise it to NF4 (module docstring)."""
    n = out_features * in_features
    packed = (n + 1) // 2 + -(-n // 64) * 5 + 256 * 4
    return 4 * n + rank * (out_features + in_features) * 4 + packed + _NF4_BYTES_PER_CHUNK_ELEMENT * min(n, NF4_CHUNK_ELEMENTS)


def layer_working_bytes(form: str, out_features: int, in_features: int, rank: int, out_bytes: int = 2) -> int:
    """Device bytes to export one linear layer in ``form`` (``"merged_16bit"``, ``"gguf"``, ...)."""
    kind = export_form(form).memory
    if kind == "adapter":
        return 0
    if kind == "merge_nf4":
        return nf4_merge_working_bytes(out_features, in_features, rank)
    if kind == "merge":
        return merge_working_bytes(out_features, in_features, rank, out_bytes)
    raise ValueError(f"notebookkit.memory: export form {form!r} has memory={kind!r}, which this model does not count.")


@dataclass(frozen=True)
class ExportMemory:
    """What a merged export of one model shape needs on top of the loaded model."""

    device_peak_bytes: int  # largest single-layer merge working set (one layer at a time)
    host_peak_bytes: int  # largest tensor on its way to the file
    total_bytes: int  # size of the merged checkpoint on disk


def _projection_dims(shape: ModelShape) -> dict[str, tuple[int, int]]:
    H, I = shape.hidden_size, shape.intermediate_size
    return {
        "q_proj": (shape.q_dim, H), "k_proj": (shape.kv_dim, H), "v_proj": (shape.kv_dim, H), "o_proj": (H, shape.q_dim),
        "gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I),
    }


def export_memory(shape: ModelShape, r: int = 16, out_bytes: int = 2, target_modules: Optional[Iterable[str]] = None,
                  form: str = "merged_16bit") -> ExportMemory:
    """The export's working set for ``shape`` with LoRA rank ``r`` on ``target_modules`` (default all seven).

    ``form`` picks the per-layer working set (:func:`layer_working_bytes`); the host peak and the size
    on disk are those of ``out_bytes``-byte tensors."""
    targets = set(target_modules) if target_modules is not None else set(PROJECTIONS)
    dims = _projection_dims(shape)
    device_peak = max(layer_working_bytes(form, o, i, r if name in targets else 0, out_bytes) for name, (o, i) in dims.items())
    embed = shape.vocab_size * shape.hidden_size
    largest = max(embed, *(o * i for o, i in dims.values()))
    layer = sum(o * i for o, i in dims.values())
    params = shape.num_layers * layer + embed * (1 if shape.tie_word_embeddings else 2)
    return ExportMemory(device_peak, largest * out_bytes, params * out_bytes)
