"""The embedded tiny default: small models of every supported family, built offline and cached.

Reserved names resolve to local Hugging Face folders that this module builds on first use::

    from notebookkit.data.tiny import ensure_tiny_model, resolve_model_name, TINY_MODELS
    path = ensure_tiny_model("notebookkit/tiny-llama")     # builds once (~30 s), then instant
    resolve_model_name("notebookkit/tiny-qwen3")           # -> "/home/you/.cache/notebookkit/tiny/..."
    resolve_model_name("Qwen/Qwen2.5-0.5B")                # hub names pass through unchanged

From a shell, ``python -m notebookkit.data.tiny`` builds every model and the bundled datasets and
prints a table.

What gets built (all deterministic; nothing is downloaded):

1. the corpus (:mod:`notebookkit.data.corpus`): 8000 short English documents about a small
   world (1.4 MB), plus 300 held-out documents drawn with another seed;
2. a 2048-entry byte-level BPE tokenizer trained on it (:mod:`.generate_tokenizer`);
3. one folder per family (:mod:`.generate_models`): ``config.json``, ``model.safetensors``,
   ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` with the family's
   chat template; ``tiny-llama`` is pre-trained for a few hundred steps on the corpus
   (:mod:`.generate_pretrain`), the others keep their seeded random weights;
4. the bundled datasets (:mod:`.bundled`).

Cache layout: ``$NOTEBOOKKIT_CACHE/tiny/`` (default ``~/.cache/notebookkit/tiny/``) holds
``<name>-<version>/`` folders, where ``<version>`` hashes the generator source files and the
versions of torch/transformers/tokenizers, so changing either builds afresh. A folder is built
under a temporary name, gets its stamp file last, and is renamed into place while a file lock is
held, so parallel test workers never see or produce a half-built folder; a folder without a stamp
(left by a crash) is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from contextlib import contextmanager
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

from .generate_models import INFO_FILE, build_model_folder

#: Reserved model names and the family each one builds.
TINY_MODELS: dict[str, str] = {
    "notebookkit/tiny-llama": "llama",
    "notebookkit/tiny-mistral": "mistral",
    "notebookkit/tiny-qwen2": "qwen2",
    "notebookkit/tiny-qwen3": "qwen3",
    "notebookkit/tiny-gemma": "gemma",
    "notebookkit/tiny-gemma2": "gemma2",
    "notebookkit/tiny-gemma3": "gemma3",
}
#: Families that get the short pre-training on the corpus.
PRETRAINED_FAMILIES: frozenset[str] = frozenset({"llama"})

MODEL_SEED = 1234
CORPUS_SEED, CORPUS_DOCS = 0, 8000
HELDOUT_SEED, HELDOUT_DOCS = 1, 300
BUILD_THREADS = 2

STAMP_FILE = ".notebookkit-complete.json"

_HERE = Path(__file__).resolve().parent
# What the artifacts depend on: the generator modules, the recipe constants above and the library
# versions. (This module's own code, the cache and the report, is deliberately not hashed, so
# editing it does not force a rebuild.)
_MODEL_SOURCES = ("generate_tokenizer.py", "generate_models.py", "generate_pretrain.py",
                  "corpus/world.py", "corpus/generate.py")
_MODEL_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")
_DATA_SOURCES = ("generate_datasets.py", "corpus/world.py")
_DATA_PACKAGES = ("pillow",)


class UnknownTinyModelError(ValueError):
    """A ``notebookkit/...`` name that is not one of :data:`TINY_MODELS`."""


# ----------------------------------------------------------------------------------- naming

def _canonical_name(name: str) -> str | None:
    lowered = name.strip().lower()
    return lowered if lowered in TINY_MODELS else None


def _unknown_name_error(name: str) -> UnknownTinyModelError:
    valid = "\n".join(f"  - {n}  ({fam})" for n, fam in TINY_MODELS.items())
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


# ------------------------------------------------------------------------------------ cache

def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder holding the tiny builds: ``<cache_dir or $NOTEBOOKKIT_CACHE or ~/.cache/notebookkit>/tiny``."""
    if cache_dir is None:
        env = os.environ.get("NOTEBOOKKIT_CACHE")
        base = Path(env).expanduser() if env else Path.home() / ".cache" / "notebookkit"
    else:
        base = Path(cache_dir).expanduser()
    return base / "tiny"


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"


def _recipe() -> str:
    return json.dumps({
        "models": TINY_MODELS, "pretrained": sorted(PRETRAINED_FAMILIES), "seed": MODEL_SEED,
        "corpus": [CORPUS_SEED, CORPUS_DOCS, HELDOUT_SEED, HELDOUT_DOCS], "threads": BUILD_THREADS,
    }, sort_keys=True)


@lru_cache(maxsize=None)
def _version_hash(sources: tuple[str, ...], packages: tuple[str, ...]) -> str:
    h = hashlib.sha256(_recipe().encode())
    for rel in sources:
        h.update(rel.encode())
        h.update((_HERE / rel).read_bytes())
    for pkg in packages:
        h.update(f"{pkg}={_package_version(pkg)}".encode())
    return h.hexdigest()[:12]


def model_version() -> str:
    """Hash naming the current build of corpus, tokenizer and models (sources + library versions)."""
    return _version_hash(_MODEL_SOURCES, _MODEL_PACKAGES)


def data_version() -> str:
    """Hash naming the current build of the bundled datasets."""
    return _version_hash(_DATA_SOURCES, _DATA_PACKAGES)


def _read_stamp(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock on ``path`` (flock on POSIX, msvcrt on Windows)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            import msvcrt

            while True:
                try:
                    msvcrt.locking(fh.fileno(), msvcrt.LK_LOCK, 1)
                    break
                except OSError:
                    time.sleep(0.2)
            try:
                yield
            finally:
                fh.seek(0)
                msvcrt.locking(fh.fileno(), msvcrt.LK_UNLCK, 1)
            return
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


Builder = Callable[[Path, Path], "dict[str, Any] | None"]


def cached_build(key: str, version: str, builder: Builder, cache_dir: str | os.PathLike | None = None,
                 announce: str | None = None) -> Path:
    """Return ``<cache>/<key>-<version>``, building it with ``builder(tmp_dir, final_dir)`` if needed.

    ``builder`` writes into ``tmp_dir`` and may return a dict recorded in the stamp. The stamp is
    written last and the folder renamed into place under a lock, so readers only ever see
    complete folders and concurrent callers build once.
    """
    root = cache_root(cache_dir)
    final = root / f"{key}-{version}"
    if _read_stamp(final) is not None:
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / ".locks" / f"{key}-{version}.lock"):
        if _read_stamp(final) is not None:
            return final
        if final.exists():  # no stamp: a crashed or interrupted build
            shutil.rmtree(final)
        for stale in root.glob(f".tmp-{key}-{version}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f".tmp-{key}-{version}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        if announce:
            print(announce, file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            info = builder(tmp, final) or {}
            stamp = {"key": key, "version": version, "build_seconds": round(time.perf_counter() - start, 3),
                     **info}
            (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


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


def ensure_tiny_model(name: str, cache_dir: str | os.PathLike | None = None, verbose: bool = False) -> Path:
    """Local folder of the reserved tiny model ``name``, building it on first use.

    ``name`` is one of :data:`TINY_MODELS` (for example ``"notebookkit/tiny-llama"``). The first
    call builds the corpus, tokenizer and model (about 30 s for the pre-trained ``tiny-llama``,
    a second for the others); later calls return the cached folder at once.
    """
    canonical = _canonical_name(os.fspath(name))
    if canonical is None:
        raise _unknown_name_error(os.fspath(name))
    family = TINY_MODELS[canonical]
    key = _short(canonical)
    version = model_version()
    final = cache_root(cache_dir) / f"{key}-{version}"
    if _read_stamp(final) is not None:
        return final

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
    return cached_build(key, version, build, cache_dir,
                        announce=f"notebookkit: building {canonical} once{slow} -> {final}")


def tiny_model_info(name: str, cache_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Build record of a tiny model: family, params, folder, size in bytes, build seconds, losses."""
    folder = ensure_tiny_model(name, cache_dir)
    stamp = _read_stamp(folder) or {}
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    return {"name": _canonical_name(name), "folder": str(folder), "size_bytes": size, **stamp}


# -------------------------------------------------------------------------------- command

def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def _fmt_size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def build_all(cache_dir: str | os.PathLike | None = None, datasets: bool = True,
              verbose: bool = True) -> dict[str, Any]:
    """Build (or find cached) every tiny model and, if ``datasets``, the bundled datasets.

    Returns ``{"models": [...info dicts...], "datasets": [...listing rows...], "seconds": float}``.
    """
    start = time.perf_counter()
    models = []
    for name in TINY_MODELS:
        t0 = time.perf_counter()
        folder = cache_root(cache_dir) / f"{_short(name)}-{model_version()}"
        cached = _read_stamp(folder) is not None
        ensure_tiny_model(name, cache_dir, verbose=verbose)
        info = tiny_model_info(name, cache_dir)
        info["cached"] = cached
        info["wall_seconds"] = time.perf_counter() - t0
        models.append(info)
    parts = {"corpus": _read_stamp(ensure_corpus(cache_dir)), "tokenizer": _read_stamp(ensure_tokenizer(cache_dir))}
    rows = []
    if datasets:
        from .bundled import ensure_bundled_datasets, list_bundled

        rows = list_bundled(cache_dir=cache_dir)
        parts["datasets"] = _read_stamp(ensure_bundled_datasets(cache_dir))
    return {"models": models, "datasets": rows, "parts": parts, "seconds": time.perf_counter() - start}


def format_report(report: dict[str, Any], cache_dir: str | os.PathLike | None = None) -> str:
    """The table that ``python -m notebookkit.data.tiny`` prints."""
    lines = [f"{'name':<26} {'family':<8} {'params':>8} {'size':>10} {'build s':>8}  status"]
    for m in report["models"]:
        status = "cached" if m.get("cached") else "built"
        pre = m.get("pretrain")
        if pre:
            status += (f"; pre-trained {pre['steps']} steps, held-out loss "
                       f"{pre['heldout_loss_before']:.2f} -> {pre['heldout_loss_after']:.2f}")
        lines.append(f"{m['name']:<26} {m['family']:<8} {_fmt_params(m['params']):>8} "
                     f"{_fmt_size(m['size_bytes']):>10} {m['build_seconds']:>8.1f}  {status}")
    parts = report.get("parts") or {}
    if parts:
        lines.append("shared parts: " + ", ".join(
            f"{k} {v.get('build_seconds', 0.0):.1f} s" for k, v in parts.items() if v)
            + f" (tokenizer vocab {(parts.get('tokenizer') or {}).get('vocab_size', '?')})")
    if report["datasets"]:
        lines += ["", f"{'dataset':<16} {'split':<6} {'rows':>6}  path"]
        for d in report["datasets"]:
            lines.append(f"{d['kind']:<16} {d['split']:<6} {d['rows']:>6}  {d['path']}")
    lines += ["", f"total {report['seconds']:.1f} s (cache: {cache_root(cache_dir)})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m notebookkit.data.tiny``."""
    import argparse

    parser = argparse.ArgumentParser(description="Build the notebookkit tiny models and bundled datasets.")
    parser.add_argument("--cache-dir", default=None,
                        help="cache root (default $NOTEBOOKKIT_CACHE or ~/.cache/notebookkit)")
    parser.add_argument("--no-datasets", action="store_true", help="build only the models")
    parser.add_argument("--quiet", action="store_true", help="no pre-training log")
    args = parser.parse_args(argv)
    report = build_all(args.cache_dir, datasets=not args.no_datasets, verbose=not args.quiet)
    print(format_report(report, args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
