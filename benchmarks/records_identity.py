"""Before/after check of a refactor of the records (families, export forms, training methods).

Writes one JSON file of everything the records decide that a CPU can compute:

* the memory model over a grid: every family's shape (hub-sized numbers and the curated checkpoints)
  x every training method x checkpoint mode x sequence length x 16-bit / NF4, through the public
  :func:`notebookkit.memory.estimate_training_memory` (every field, floats as ``repr``), the planner's
  choice for a few budgets, and :func:`notebookkit.memory.export_memory`;
* the tables the layers read (save methods, GGUF types and their tolerances, the panels' options and
  values, each family's GGUF row, vision model types);
* with ``--exports``: the files (names, sizes, SHA-256) of a LoRA, merged_16bit and GGUF f16 / q8_0
  export of a tiny model (seeded adapters), on the CPU;
* with ``--tiny-cache DIR``: the SHA-256 of every file of a built embedded-default cache (folder
  version suffixes and build stamps left out, since they hash the generator sources).

Run it at the old and the new commit (each tree first on ``PYTHONPATH``, each with a tiny cache of
its own, the same hash seed: PEFT writes ``target_modules`` in set order) and compare the two files::

    PYTHONHASHSEED=0 PYTHONPATH=$OLD NOTEBOOKKIT_CACHE=/tmp/cache-old python benchmarks/records_identity.py \
        --exports --out /tmp/before.json
    PYTHONHASHSEED=0 PYTHONPATH=$NEW NOTEBOOKKIT_CACHE=/tmp/cache-new python benchmarks/records_identity.py \
        --exports --out /tmp/after.json
    cmp /tmp/before.json /tmp/after.json

``--tiny-cache DIR`` hashes a built cache (``python -m notebookkit.embedded --cache-dir DIR``); a tiny
model's ``notebookkit_tiny.json`` records its pre-training's wall time, which differs from run to run.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import sys
from pathlib import Path


def _plain(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, (int, str, bool)) or x is None:
        return x
    return repr(x)


def _family_shapes() -> dict:
    from notebookkit.families import FAMILIES
    from notebookkit.memory.shapes import KNOWN_MODELS, model_shape

    shapes = {}
    for name, fam in FAMILIES.items():
        for mt in fam.model_types + fam.multimodal_model_types:
            numbers = dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                           intermediate_size=5632, vocab_size=128256, max_position_embeddings=8192, model_type=mt)
            shapes[f"{name}:{mt}"] = model_shape(numbers)
    for key in ("meta-llama/Llama-3.2-1B-Instruct", "Qwen/Qwen3-0.6B", "google/gemma-2-2b-it",
                "google/gemma-3-1b-it", "mistralai/Mistral-7B-Instruct-v0.3"):
        shapes[key] = KNOWN_MODELS[key]
    return shapes


def memory_grid() -> dict:
    from notebookkit.memory import estimate_training_memory, export_memory, plan_activations

    out = {}
    for key, shape in _family_shapes().items():
        out[f"shape {key}"] = _plain(shape)
        out[f"export_memory {key}"] = _plain(export_memory(shape, r=16))
        for method in ("sft", "dpo", "orpo", "grpo"):
            for mode in ("keep", "recompute", "offload"):
                for seq in (256, 2048, 8192):
                    for nf4 in (False, True):
                        kw = dict(load_in_4bit=nf4, dtype="float16", lora_r=16, batch_size=2, seq_len=seq,
                                  activation_plan=mode, method=method)
                        if method == "grpo":
                            kw["completion_len"] = seq // 2
                        est = estimate_training_memory(shape, **kw)
                        out[f"estimate {key} {method} {mode} {seq} nf4={nf4}"] = _plain(est)
            for budget in (6, 15):
                try:
                    plan = plan_activations(shape, f"{budget}GiB", batch_size=2, seq_len=2048, method=method,
                                            load_in_4bit=True, dtype="float16", card="t4",
                                            host_memory_bytes=64 * 2**30)
                    out[f"plan {key} {method} {budget}GiB"] = _plain(plan)
                except Exception as exc:  # noqa: BLE001 - the error is part of the behaviour
                    out[f"plan {key} {method} {budget}GiB"] = f"{type(exc).__name__}: {exc}"
    for vlm in ("Qwen/Qwen2.5-VL-7B-Instruct", "google/gemma-3-4b-it"):
        for method in ("sft", "dpo", "orpo", "grpo"):
            for mode in ("keep", "recompute"):
                est = estimate_training_memory(_vlm_config(vlm), load_in_4bit=True, dtype="float16", batch_size=1,
                                               seq_len=1024, activation_plan=mode, method=method)
                out[f"vlm estimate {vlm} {method} {mode}"] = _plain(est)
            plan = plan_activations(_vlm_config(vlm), "15GiB", batch_size=2, seq_len=1024, method=method,
                                    load_in_4bit=True, dtype="float16", card="t4", host_memory_bytes=64 * 2**30)
            out[f"vlm plan {vlm} {method}"] = _plain(plan)
    return out


def _vlm_config(name: str):
    from notebookkit.memory.vision_shapes import vlm_shape

    return vlm_shape(name)


def tables() -> dict:
    out = {}
    from notebookkit.export.merged import SAVE_METHODS
    from notebookkit.export.gguf_file import ALIASES, GGUF_METHODS, KQUANT_METHODS
    from notebookkit.export.verify import GGUF_TOLERANCE
    from notebookkit.export.bind import EXPORT_METHODS
    from notebookkit.export.gguf_arch import gguf_family
    from notebookkit.families import FAMILIES
    from notebookkit.memory import vision_shapes
    from notebookkit.widgets.export_panel import ExportChoice, ExportPanel
    from notebookkit.widgets.training_panel import TrainingChoice, TrainingPanel

    out["SAVE_METHODS"] = list(SAVE_METHODS)
    out["GGUF_METHODS"] = list(GGUF_METHODS)
    out["KQUANT_METHODS"] = dict(KQUANT_METHODS)
    out["ALIASES"] = dict(ALIASES)
    out["GGUF_TOLERANCE"] = _plain(GGUF_TOLERANCE)
    out["EXPORT_METHODS"] = list(EXPORT_METHODS)
    for name, fam in FAMILIES.items():
        for mt in fam.model_types:
            out[f"gguf_family {mt}"] = _plain(gguf_family(type("C", (), {"model_type": mt})()))
    try:
        gguf_family(type("C", (), {"model_type": "phi3"})())
    except Exception as exc:  # noqa: BLE001
        out["gguf_family phi3"] = str(exc)
    out["vision KNOWN_VLMS"] = _plain(getattr(vision_shapes, "KNOWN_VLMS", None))
    panel = ExportPanel()
    out["export panel"] = dict(forms=_plain([panel.forms._options_labels, panel.forms._options_values]),
                               gguf=_plain([panel.gguf._options_labels, panel.gguf._options_values]),
                               value=_plain(panel.value), kwargs=_plain(ExportChoice().kwargs()),
                               html=_plain([c.value for c in panel.widget.children if hasattr(c, "value") and isinstance(c.value, str)]))
    for method in ("sft", "dpo", "orpo", "grpo"):
        p = TrainingPanel(method=method, optim="adamw_torch")
        out[f"training panel {method}"] = dict(
            value=_plain(p.value), kwargs=_plain(p.value.trainer_kwargs()), summary=p.summary.value,
            children=[type(c).__name__ + ":" + str(getattr(c, "description", "")) for c in p.widget.children],
            method_options=_plain([p.method._options_labels, p.method._options_values]), beta=p.beta.description)
    try:
        TrainingChoice(method="ppo")
    except Exception as exc:  # noqa: BLE001
        out["training choice ppo"] = str(exc)
    from notebookkit.memory import estimate_training_memory

    try:
        estimate_training_memory("Qwen/Qwen3-0.6B", method="ppo")
    except Exception as exc:  # noqa: BLE001
        out["estimate ppo"] = str(exc)
    return out


def _folder_hashes(folder: Path, replace: dict[bytes, bytes] | None = None) -> dict:
    """``{relative path: [size, sha256]}`` of every file; ``replace``: byte strings to normalise first
    (the cache's path and version, which a loaded model's name carries into an export)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != ".notebookkit-complete.json" and ".lock" not in p.name:
            rel = re.sub(r"-[0-9a-f]{12}(?=/|$)", "-<v>", str(p.relative_to(folder)))
            data = p.read_bytes()
            for old, new in (replace or {}).items():
                data = data.replace(old, new)
            out[rel] = [len(data), hashlib.sha256(data).hexdigest()]
    return out


def _cache_names() -> dict[bytes, bytes]:
    """The tiny cache's root and folder versions, as they appear in an export of a tiny model."""
    from notebookkit.embedded.cache import cache_root

    root = cache_root()
    names = {str(root).encode(): b"<cache>"}
    for d in root.iterdir() if root.is_dir() else ():
        m = re.search(r"-([0-9a-f]{12})$", d.name)
        if m:
            names[m.group(1).encode()] = b"<v>"
    return names


def exports(work: Path) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.export.conftest import lora_model

    torch.set_num_threads(1)
    out = {}
    for family, nf4 in (("qwen2", False), ("gemma2", False), ("llama", True)):
        model, tokenizer = lora_model(family, load_in_4bit=nf4)
        base = work / family
        for method in ("lora", "merged_16bit") if family != "gemma2" else ("merged_16bit",):
            model.save_pretrained_merged(base / method, tokenizer, save_method=method, verbose=False)
        model.save_pretrained_gguf(base / "gguf", tokenizer, ["f16", "q8_0"], verbose=False)
        out[family] = _folder_hashes(base, _cache_names())
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--exports", action="store_true")
    parser.add_argument("--tiny-cache", default=None)
    parser.add_argument("--no-grid", action="store_true")
    args = parser.parse_args()
    result = {}
    if not args.no_grid:
        result["tables"] = tables()
        result["memory"] = memory_grid()
    if args.exports:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            result["exports"] = exports(Path(tmp))
    if args.tiny_cache:
        result["tiny_cache"] = _folder_hashes(Path(args.tiny_cache))
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"{args.out}: {sum(len(v) for v in result.values())} entries")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
