"""``python -m notebookkit.embedded``: build every tiny model and the bundled datasets, print a table.

Everything is built once into the cache (:mod:`.cache`) and found there afterwards, so a second run
only prints the table. ``--no-datasets`` builds only the models, ``--cache-dir`` moves the cache.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .bundled import ensure_bundled_datasets, list_bundled
from .cache import cache_root, read_stamp
from .tiny import TINY_LOW_BIT_MODELS, TINY_MODELS, TINY_VISION_MODELS, ensure_corpus, ensure_tiny_model, ensure_tokenizer, tiny_model_folder, tiny_model_info


def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def _fmt_size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def build_all(cache_dir: str | os.PathLike | None = None, datasets: bool = True,
              verbose: bool = True) -> dict[str, Any]:
    """Build (or find cached) every tiny model (text and vision-language) and, if ``datasets``, the
    bundled datasets.

    Returns ``{"models": [...info dicts...], "datasets": [...listing rows...], "seconds": float}``.
    """
    start = time.perf_counter()
    models = []
    for name in [*TINY_MODELS, *TINY_VISION_MODELS, *TINY_LOW_BIT_MODELS]:
        t0 = time.perf_counter()
        cached = read_stamp(tiny_model_folder(name, cache_dir)) is not None
        ensure_tiny_model(name, cache_dir, verbose=verbose)
        info = tiny_model_info(name, cache_dir)
        info["cached"] = cached
        info["wall_seconds"] = time.perf_counter() - t0
        models.append(info)
    parts = {"corpus": read_stamp(ensure_corpus(cache_dir)), "tokenizer": read_stamp(ensure_tokenizer(cache_dir))}
    rows = []
    if datasets:
        rows = list_bundled(cache_dir=cache_dir)
        parts["datasets"] = read_stamp(ensure_bundled_datasets(cache_dir))
    return {"models": models, "datasets": rows, "parts": parts, "seconds": time.perf_counter() - start}


def format_report(report: dict[str, Any], cache_dir: str | os.PathLike | None = None) -> str:
    """The table that ``python -m notebookkit.embedded`` prints."""
    lines = [f"{'name':<30} {'family':<8} {'params':>8} {'size':>10} {'build s':>8}  status"]
    for m in report["models"]:
        status = "cached" if m.get("cached") else "built"
        pre = m.get("pretrain")
        if pre:
            status += (f"; pre-trained {pre['steps']} steps, held-out loss "
                       f"{pre['heldout_loss_before']:.2f} -> {pre['heldout_loss_after']:.2f}")
        if m.get("vision"):
            status += f"; vision-language ({m['model_type']})"
        lines.append(f"{m['name']:<30} {m['family']:<8} {_fmt_params(m['params']):>8} "
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
    """Entry point of ``python -m notebookkit.embedded``."""
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
