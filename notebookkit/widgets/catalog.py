"""Curated models for the model panel, grouped by family, and their shapes for the estimate.

The hub checkpoints and their config numbers live in :mod:`notebookkit.memory.shapes`
(``KNOWN_MODELS``: hidden size, layers, heads, kv heads, head dim, intermediate size, vocabulary,
tied embeddings, copied from each model's public ``config.json``). This module groups them for
the UI and adds the project's tiny default models (``notebookkit/tiny-<family>``, built offline by
:mod:`notebookkit.data.tiny`), whose shape is read from their folder when built, or from the
generator's constants when not, so the panel never has to build a model to show an estimate.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from notebookkit.memory.shapes import KNOWN_MODELS, ModelShape, model_shape


@dataclass(frozen=True)
class CatalogEntry:
    name: str  # what FastLanguageModel.from_pretrained takes
    label: str  # what the dropdown shows
    family: str


TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")
TINY_NAMES = tuple(f"notebookkit/tiny-{f}" for f in TINY_FAMILIES)

_CURATED = {
    "Tiny (CPU / CI)": [(n, f"{n} (tiny, random weights)") for n in TINY_NAMES],
    "Llama 3.x": [
        ("meta-llama/Llama-3.2-1B-Instruct", "Llama 3.2 1B Instruct"),
        ("meta-llama/Llama-3.2-3B-Instruct", "Llama 3.2 3B Instruct"),
        ("meta-llama/Llama-3.1-8B-Instruct", "Llama 3.1 8B Instruct"),
    ],
    "Qwen3": [
        ("Qwen/Qwen3-0.6B", "Qwen3 0.6B"),
        ("Qwen/Qwen3-1.7B", "Qwen3 1.7B"),
        ("Qwen/Qwen3-4B", "Qwen3 4B"),
        ("Qwen/Qwen3-8B", "Qwen3 8B"),
    ],
    "Gemma 2": [
        ("google/gemma-2-2b-it", "Gemma 2 2B it"),
        ("google/gemma-2-9b-it", "Gemma 2 9B it"),
    ],
    "Gemma 3": [
        ("google/gemma-3-1b-it", "Gemma 3 1B it"),
        ("google/gemma-3-4b-it", "Gemma 3 4B it (text)"),
    ],
    "Mistral": [("mistralai/Mistral-7B-Instruct-v0.3", "Mistral 7B Instruct v0.3")],
}

CATALOG: dict[str, list[CatalogEntry]] = {
    fam: [CatalogEntry(n, label, fam) for n, label in rows] for fam, rows in _CURATED.items()
}


def families() -> list[str]:
    return list(CATALOG)


def model_names(family: str | None = None) -> list[str]:
    """Curated model names, all or of one family."""
    fams = [family] if family and family in CATALOG else list(CATALOG)
    return [e.name for f in fams for e in CATALOG[f]]


def family_of(name: str) -> str | None:
    for fam, entries in CATALOG.items():
        if any(e.name == name for e in entries):
            return fam
    return None


def _tiny_shape_from_generator(name: str) -> ModelShape | None:
    family = name.rsplit("tiny-", 1)[-1]
    if family not in TINY_FAMILIES:
        return None
    try:
        from notebookkit.data import generate_models as gm
        from notebookkit.data.generate_tokenizer import VOCAB_SIZE

        H, nh, nk, hd, inter = gm.HIDDEN, gm.HEADS, gm.KV_HEADS, gm.HEAD_DIM, gm.INTERMEDIATE
        layers = gm.FAMILY_LAYERS[family]
        vocab = VOCAB_SIZE
    except Exception:  # generator not importable: the numbers it documents
        H, nh, nk, hd, inter, vocab = 128, 4, 2, 32, 384, 2048
        layers = 4 if family == "llama" else 2
    mtype = {"gemma3": "gemma3_text"}.get(family, family)
    return model_shape(
        dict(model_type=mtype, hidden_size=H, num_hidden_layers=layers, num_attention_heads=nh,
             num_key_value_heads=nk, head_dim=hd, intermediate_size=inter, vocab_size=vocab,
             tie_word_embeddings=family != "mistral", max_position_embeddings=2048,
             _name_or_path=name)
    )


@functools.lru_cache(maxsize=64)
def resolve_shape(name: str) -> ModelShape:
    """The :class:`ModelShape` of a curated, tiny, local or hub model name.

    Never downloads weights; hub names outside the catalog need their config in the local
    Hugging Face cache (or the network).
    """
    name = name.strip()
    if name in KNOWN_MODELS:
        return KNOWN_MODELS[name]
    if name.startswith("notebookkit/tiny-"):
        try:
            from notebookkit.data.tiny import resolve_model_name

            folder = Path(resolve_model_name(name))
            if (folder / "config.json").is_file():
                return model_shape(json.loads((folder / "config.json").read_text()) | {"_name_or_path": name})
        except Exception:
            pass
        shape = _tiny_shape_from_generator(name)
        if shape is not None:
            return shape
    return model_shape(name)
