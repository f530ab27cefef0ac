"""Curated models for the model panel, grouped by family, and their shapes for the estimate.

The hub checkpoints and their config numbers live in :mod:`notebookkit.memory.shapes`
(``KNOWN_MODELS``: hidden size, layers, heads, kv heads, head dim, intermediate size, vocabulary,
tied embeddings, copied from each model's public ``config.json``). This module groups them for
the UI and adds the project's tiny default models (``notebookkit/tiny-<family>``, one per row of
:mod:`notebookkit.families`, built offline by :mod:`notebookkit.embedded.tiny`), whose shape is read
from their folder when built, or from the family's tiny recipe and the builder's constants when
not, so the panel never has to build a model to show an estimate.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from notebookkit.families import FAMILIES
from notebookkit.memory.shapes import KNOWN_MODELS, ModelShape, model_shape
from notebookkit.memory.vision_shapes import VLMShape, is_vlm, vlm_shape


@dataclass(frozen=True)
class CatalogEntry:
    name: str  # what FastLanguageModel.from_pretrained takes
    label: str  # what the dropdown shows
    family: str


TINY_FAMILIES = tuple(FAMILIES)
TINY_NAMES = tuple(f.tiny_name for f in FAMILIES.values())

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
    "Mixture of experts": [
        ("Qwen/Qwen3-30B-A3B", "Qwen3 30B-A3B (128 experts, 8 active)"),
        ("openai/gpt-oss-20b", "gpt-oss 20B (32 experts, 4 active)"),
        ("unsloth/gpt-oss-20b-BF16", "gpt-oss 20B, 16-bit copy (load_in_4bit: NF4 experts)"),
    ],
    "Vision-language": [
        *[(f.vision.tiny_name, f"{f.vision.tiny_name} (tiny VLM, random weights)")
          for f in FAMILIES.values() if f.vision is not None],
        ("Qwen/Qwen2.5-VL-7B-Instruct", "Qwen2.5-VL 7B Instruct"),
    ],
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
    """The shape ``notebookkit/tiny-<family>`` will have, without building it."""
    family = FAMILIES.get(name.rsplit("tiny-", 1)[-1])
    if family is None:
        return None
    from notebookkit.embedded import generate_models as gm
    from notebookkit.embedded.generate_tokenizer import VOCAB_SIZE

    moe_keys = (family.moe.num_experts, family.moe.intermediate, "num_experts_per_tok", "norm_topk_prob") \
        if family.moe is not None else ()
    return model_shape(
        dict(model_type=family.model_types[0], hidden_size=gm.HIDDEN, num_hidden_layers=family.tiny.layers,
             num_attention_heads=gm.HEADS, num_key_value_heads=gm.KV_HEADS, head_dim=gm.HEAD_DIM,
             intermediate_size=gm.INTERMEDIATE, vocab_size=VOCAB_SIZE,
             tie_word_embeddings=family.tiny.tie_word_embeddings, max_position_embeddings=gm.MAX_POSITIONS,
             _name_or_path=name)
        | {k: v for k, v in family.tiny.config.items() if k == family.attn_softcap_attr or k in moe_keys}
    )


@functools.lru_cache(maxsize=64)
def resolve_shape(name: str) -> ModelShape | VLMShape:
    """The :class:`ModelShape` of a curated, tiny, local or hub model name; a :class:`VLMShape` for a
    vision-language one (a curated VLM, a tiny VLM once built, a local VLM folder).

    Never downloads weights; hub names outside the catalog need their config in the local
    Hugging Face cache (or the network).
    """
    name = name.strip()
    if name in KNOWN_MODELS:
        return KNOWN_MODELS[name]
    if is_vlm(name):
        return vlm_shape(name)
    if name.startswith("notebookkit/tiny-"):
        try:
            from notebookkit.embedded.tiny import resolve_model_name

            folder = Path(resolve_model_name(name))
            if (folder / "config.json").is_file():
                return model_shape(json.loads((folder / "config.json").read_text()) | {"_name_or_path": name})
        except Exception:
            pass
        shape = _tiny_shape_from_generator(name)
        if shape is not None:
            return shape
    return model_shape(name)
