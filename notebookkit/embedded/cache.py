"""The cache of the embedded default: versioned folders, built once under a file lock.

Every artifact (corpus, tokenizer, each tiny model, the bundled datasets) lives in
``$NOTEBOOKKIT_CACHE/tiny/<key>-<version>/`` (default ``~/.cache/notebookkit/tiny/``), where
``<version>`` (:func:`source_version`) hashes the generator source files, the recipe constants and
the versions of the libraries the artifact depends on, so changing any of them builds afresh.

:func:`cached_build` builds a folder under a temporary name, writes its stamp file last and renames
it into place while a file lock is held, so parallel test workers never see or produce a half-built
folder; a folder without a stamp (left by a crash) is rebuilt.
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

#: file written last into every complete folder: the build record
STAMP_FILE = ".notebookkit-complete.json"

_HERE = Path(__file__).resolve().parent


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


@lru_cache(maxsize=None)
def source_version(sources: tuple[str, ...], packages: tuple[str, ...], recipe: str = "") -> str:
    """12 hex digits hashing ``recipe``, the files ``sources`` (paths relative to this package) and
    the installed versions of ``packages``."""
    h = hashlib.sha256(recipe.encode())
    for rel in sources:
        h.update(rel.encode())
        h.update((_HERE / rel).read_bytes())
    for pkg in packages:
        h.update(f"{pkg}={_package_version(pkg)}".encode())
    return h.hexdigest()[:12]


def read_stamp(folder: Path) -> dict[str, Any] | None:
    """The build record of a complete cache folder, ``None`` when the folder is missing or half built."""
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
    if read_stamp(final) is not None:
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / ".locks" / f"{key}-{version}.lock"):
        if read_stamp(final) is not None:
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


__all__ = ["STAMP_FILE", "cache_root", "cached_build", "read_stamp", "source_version"]
