"""The tiny default models: one small model of every supported family, built offline and cached.

Reserved names resolve to local Hugging Face folders that this module builds on first use::

    from notebookkit.embedded.tiny import ensure_tiny_model, resolve_model_name, TINY_MODELS
    path = ensure_tiny_model("notebookkit/tiny-llama")     # builds once (~30 s), then instant
    resolve_model_name("notebookkit/tiny-qwen3")           # -> "/home/you/.cache/notebookkit/tiny/..."
    resolve_model_name("Qwen/Qwen2.5-0.5B")                # hub names pass through unchanged

From a shell, ``python -m notebookkit.embedded`` builds every model and the bundled datasets and
prints a table (:mod:`.cli`).

What gets built (all deterministic; nothing is downloaded):

1. the corpus (:mod:`notebookkit.embedded.corpus`): 8000 short English documents about a small
   world (1.4 MB), plus 300 held-out documents drawn with another seed;
2. a 2048-entry byte-level BPE tokenizer trained on it (:mod:`.generate_tokenizer`);
3. one folder per row of the family record (:mod:`notebookkit.families`, built by
   :mod:`.generate_models`): ``config.json``, ``model.safetensors``, ``generation_config.json``,
   ``tokenizer.json``, ``tokenizer_config.json`` with the family's chat template; ``tiny-llama`` is
   pre-trained for a few hundred steps on the corpus (:mod:`.generate_pretrain`), the others keep
   their seeded random weights;
4. ``tiny-llama-ternary`` (:data:`TINY_LOW_BIT_MODELS`): ``tiny-llama`` with ternary projections, saved
   pre-quantised (:mod:`notebookkit.models.low_bit`);
5. one tiny vision-language model per family with a vision row (``Family.vision``: ``tiny-qwen2.5-vl``,
   ``tiny-gemma3-vision``, built by :mod:`.generate_vision_models`): the family's tiny decoder,
   a small vision tower, the tokenizer with the image tokens, and the processor.

Each is a folder of the cache (:mod:`.cache`) whose version hashes the generator sources, the
family record, the recipe constants below and the versions of torch/transformers/tokenizers/
safetensors, so changing any of them builds afresh.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from notebookkit.families import FAMILIES

from .cache import cache_root, cached_build, read_stamp, source_version
from .generate_models import build_model_folder

#: Reserved model names and the family each one builds (one per row of the family record).
TINY_MODELS: dict[str, str] = {f.tiny_name: f.name for f in FAMILIES.values()}
#: Families that get the short pre-training on the corpus.
PRETRAINED_FAMILIES: frozenset[str] = frozenset(f.name for f in FAMILIES.values() if f.tiny.pretrained)
#: Reserved names of the tiny vision-language models and the family each one's decoder is.
TINY_VISION_MODELS: dict[str, str] = {f.vision.tiny_name: f.name for f in FAMILIES.values() if f.vision is not None}
#: Reserved names of tiny models saved pre-quantised in a low-bit base format: ``(the tiny model it is
#: quantised from, base format)``. ``tiny-llama-ternary`` is the pre-trained ``tiny-llama`` with its
#: projections ternarised (``load_in_ternary``: per-row scales, least-squares refits) and saved as
#: notebookkit's pre-quantised checkpoint, so it loads as a ternary base with no flag.
TINY_LOW_BIT_MODELS: dict[str, tuple[str, str]] = {"notebookkit/tiny-llama-ternary": ("notebookkit/tiny-llama", "ternary")}

MODEL_SEED = 1234
CORPUS_SEED, CORPUS_DOCS = 0, 8000
HELDOUT_SEED, HELDOUT_DOCS = 1, 300
BUILD_THREADS = 2

# What the artifacts depend on: the generator modules, the family record they read, the recipe
# constants above and the library versions. (This module's own code, the cache and the report, is
# deliberately not hashed, so editing it does not force a rebuild.) Paths are relative to this package.
_MODEL_SOURCES = ("../families.py", "../tokenizer_templates.py", "generate_tokenizer.py", "generate_models.py",
                  "generate_pretrain.py", "corpus/world.py", "corpus/generate.py")
_MODEL_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")
# The vision models also depend on their own builder (hashed for them only, so editing it leaves the
# text models' version alone) and on pillow (the image processors).
_VISION_SOURCES = _MODEL_SOURCES + ("generate_vision_models.py",)
_VISION_PACKAGES = _MODEL_PACKAGES + ("pillow",)


class UnknownTinyModelError(ValueError):
    """A ``notebookkit/...`` name that is not one of :data:`TINY_MODELS`."""


# ----------------------------------------------------------------------------------- naming

def _canonical_name(name: str) -> str | None:
    lowered = name.strip().lower()
    return lowered if lowered in TINY_MODELS or lowered in TINY_VISION_MODELS or lowered in TINY_LOW_BIT_MODELS else None


def _unknown_name_error(name: str) -> UnknownTinyModelError:
    valid = "\n".join([f"  - {n}  ({fam})" for n, fam in TINY_MODELS.items()]
                      + [f"  - {n}  (vision-language, {fam} decoder; FastVisionModel)" for n, fam in TINY_VISION_MODELS.items()]
                      + [f"  - {n}  ({src} saved pre-quantised, {fmt} base)" for n, (src, fmt) in TINY_LOW_BIT_MODELS.items()])
    return UnknownTinyModelError(
        f"{name!r} is not one of the bundled tiny models. The valid names are:\n{valid}\n"
        "For a Hugging Face Hub model pass its hub id (for example 'Qwen/Qwen2.5-0.5B-Instruct'); "
        "for a model on disk pass its folder."
    )


def is_tiny_model_name(name: str | os.PathLike) -> bool:
    """Whether ``name`` is one of the reserved :data:`TINY_MODELS` names (case-insensitive)."""
    return _canonical_name(os.fspath(name)) is not None


def resolve_model_name(name: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """Map a model name to what ``from_pretrained`` should load.

    * a reserved tiny name (``"notebookkit/tiny-llama"``) -> its local folder, built on first use;
    * an existing local folder -> unchanged;
    * another ``"notebookkit/..."`` name -> :class:`UnknownTinyModelError` listing the valid names;
    * anything else (a hub id) -> unchanged.
    """
    text = os.fspath(name)
    canonical = _canonical_name(text)
    if canonical is not None:
        return str(ensure_tiny_model(canonical, cache_dir=cache_dir))
    if os.path.isdir(text):
        return text
    if text.strip().lower().startswith("notebookkit/"):
        raise _unknown_name_error(text)
    return text


# ---------------------------------------------------------------------------------- build

def _recipe() -> str:
    """The build settings the artifacts depend on besides the sources (part of the version hash)."""
    return json.dumps({
        "models": TINY_MODELS, "pretrained": sorted(PRETRAINED_FAMILIES), "seed": MODEL_SEED,
        "corpus": [CORPUS_SEED, CORPUS_DOCS, HELDOUT_SEED, HELDOUT_DOCS], "threads": BUILD_THREADS,
    }, sort_keys=True)


def model_version() -> str:
    """Hash naming the current build of corpus, tokenizer and models (sources + library versions)."""
    return source_version(_MODEL_SOURCES, _MODEL_PACKAGES, _recipe())


def vision_model_version() -> str:
    """Hash naming the current build of the tiny vision-language models."""
    return source_version(_VISION_SOURCES, _VISION_PACKAGES, _recipe())


_LOW_BIT_SOURCES = _MODEL_SOURCES + ("generate_low_bit_models.py", "../base_formats.py", "../kernels/ternary.py")


def low_bit_model_version() -> str:
    """Hash naming the current build of the tiny pre-quantised low-bit models."""
    return source_version(_LOW_BIT_SOURCES, _MODEL_PACKAGES, _recipe())


def is_tiny_vision_model_name(name: str | os.PathLike) -> bool:
    """Whether ``name`` is one of the reserved :data:`TINY_VISION_MODELS` names (case-insensitive)."""
    return os.fspath(name).strip().lower() in TINY_VISION_MODELS


@contextmanager
def _quiet_build(threads: int = BUILD_THREADS) -> Iterator[None]:
    """Fixed torch thread count and no progress bars / warnings from transformers while building."""
    import torch
    from transformers.utils import logging as hf_logging

    old_threads = torch.get_num_threads()
    old_verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        hf_logging.set_verbosity(old_verbosity)
        if bars:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------------------------- corpus

def ensure_corpus(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder with ``train.jsonl`` and ``heldout.jsonl`` (one JSON string per document)."""
    from .corpus import generate_corpus

    def build(tmp: Path, _final: Path) -> dict[str, Any]:
        counts = {}
        for split, seed, n in (("train", CORPUS_SEED, CORPUS_DOCS), ("heldout", HELDOUT_SEED, HELDOUT_DOCS)):
            docs = generate_corpus(seed, n, cover_all_facts=split == "train")
            with open(tmp / f"{split}.jsonl", "w", encoding="utf-8") as fh:
                for d in docs:
                    fh.write(json.dumps(d, ensure_ascii=False) + "\n")
            counts[split] = {"documents": len(docs), "characters": sum(map(len, docs))}
        return {"corpus": counts}

    return cached_build("corpus", model_version(), build, cache_dir)


def load_corpus(split: str = "train", cache_dir: str | os.PathLike | None = None) -> list[str]:
    """The bundled corpus documents: ``split`` is ``"train"`` or ``"heldout"``."""
    if split not in ("train", "heldout"):
        raise ValueError(f"corpus split must be 'train' or 'heldout', not {split!r}")
    path = ensure_corpus(cache_dir) / f"{split}.jsonl"
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


# ------------------------------------------------------------------------------- tokenizer

def ensure_tokenizer(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder with the shared base ``tokenizer.json`` (byte-level BPE, no bos post-processor)."""
    from .generate_tokenizer import VOCAB_SIZE, train_base_tokenizer

    def build(tmp: Path, _final: Path) -> dict[str, Any]:
        tok = train_base_tokenizer(load_corpus("train", cache_dir), VOCAB_SIZE)
        (tmp / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
        return {"vocab_size": tok.get_vocab_size()}

    return cached_build("tokenizer", model_version(), build, cache_dir)


def load_base_tokenizer(cache_dir: str | os.PathLike | None = None):
    """The shared base tokenizer as a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(ensure_tokenizer(cache_dir) / "tokenizer.json"))


# ---------------------------------------------------------------------------------- models

def _short(name: str) -> str:
    return name.split("/", 1)[1]


def tiny_model_folder(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the current build of the reserved tiny model ``name`` lives (built or not)."""
    canonical = _canonical_name(os.fspath(name))
    if canonical is None:
        raise _unknown_name_error(os.fspath(name))
    if canonical in TINY_VISION_MODELS:
        version = vision_model_version()
    elif canonical in TINY_LOW_BIT_MODELS:
        version = low_bit_model_version()
    else:
        version = model_version()
    return cache_root(cache_dir) / f"{_short(canonical)}-{version}"


def ensure_tiny_model(name: str, cache_dir: str | os.PathLike | None = None, verbose: bool = False) -> Path:
    """Local folder of the reserved tiny model ``name``, building it on first use.

    ``name`` is one of :data:`TINY_MODELS` (for example ``"notebookkit/tiny-llama"``) or of
    :data:`TINY_VISION_MODELS`. The first call builds the corpus, tokenizer and model (about 30 s
    for the pre-trained ``tiny-llama``, a second for the others); later calls return the cached
    folder at once.
    """
    final = tiny_model_folder(name, cache_dir)
    if read_stamp(final) is not None:
        return final
    canonical = _canonical_name(os.fspath(name))
    if canonical in TINY_VISION_MODELS:
        return _ensure_tiny_vision_model(canonical, final, cache_dir, verbose)
    if canonical in TINY_LOW_BIT_MODELS:
        return _ensure_tiny_low_bit_model(canonical, cache_dir, verbose)
    family = TINY_MODELS[canonical]

    def build(tmp: Path, _final: Path) -> dict[str, Any]:
        with _quiet_build():
            base = load_base_tokenizer(cache_dir)
            if family in PRETRAINED_FAMILIES:
                from .generate_pretrain import PretrainConfig

                return build_model_folder(family, tmp, base, MODEL_SEED, PretrainConfig(),
                                          heldout_docs=load_corpus("heldout", cache_dir),
                                          train_docs=load_corpus("train", cache_dir),
                                          log=print if verbose else None)
            return build_model_folder(family, tmp, base, MODEL_SEED)

    slow = " (pre-training on the bundled corpus, about 30 s)" if family in PRETRAINED_FAMILIES else ""
    return cached_build(_short(canonical), model_version(), build, cache_dir,
                        announce=f"notebookkit: building {canonical} once{slow} -> {final}")


def _ensure_tiny_vision_model(canonical: str, final: Path, cache_dir, verbose: bool) -> Path:
    """Build (once) the tiny vision-language model ``canonical`` into ``final``."""
    from notebookkit.families import family as family_record

    family = TINY_VISION_MODELS[canonical]
    pretrained = family_record(family).vision.tiny.pretrained

    def build(tmp: Path, _final: Path) -> dict[str, Any]:
        from .generate_vision_models import build_vision_model_folder

        with _quiet_build():
            base = load_base_tokenizer(cache_dir)
            if not pretrained:
                return build_vision_model_folder(family, tmp, base, MODEL_SEED)
            from .generate_pretrain import PretrainConfig

            return build_vision_model_folder(family, tmp, base, MODEL_SEED, PretrainConfig(),
                                             heldout_docs=load_corpus("heldout", cache_dir),
                                             train_docs=load_corpus("train", cache_dir),
                                             log=print if verbose else None)

    slow = " (its decoder pre-trained on the bundled corpus, about 30 s)" if pretrained else ""
    return cached_build(_short(canonical), vision_model_version(), build, cache_dir,
                        announce=f"notebookkit: building {canonical} once{slow} -> {final}")


def _ensure_tiny_low_bit_model(canonical: str, cache_dir, verbose: bool) -> Path:
    """Build (once) the pre-quantised tiny model ``canonical`` from its source tiny model's folder
    (:func:`.generate_low_bit_models.build_low_bit_model_folder`)."""
    source, base_format = TINY_LOW_BIT_MODELS[canonical]

    def build(tmp: Path, _final: Path) -> dict[str, Any]:
        from .generate_low_bit_models import build_low_bit_model_folder

        folder = ensure_tiny_model(source, cache_dir, verbose)
        return {"family": TINY_MODELS[source], "source": source,
                **build_low_bit_model_folder(folder, tmp, base_format)}

    return cached_build(_short(canonical), low_bit_model_version(), build, cache_dir,
                        announce=f"notebookkit: building {canonical} once (from {source}) -> "
                                 f"{tiny_model_folder(canonical, cache_dir)}")


def tiny_model_info(name: str, cache_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Build record of a tiny model: family, params, folder, size in bytes, build seconds, losses."""
    folder = ensure_tiny_model(name, cache_dir)
    stamp = read_stamp(folder) or {}
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    return {"name": _canonical_name(name), "folder": str(folder), "size_bytes": size, **stamp}
