"""Before/after check of a refactor: what the records decide, and the LoRA training the models run.

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
  version suffixes and build stamps left out, since they hash the generator sources);
* with ``--losses`` (key ``losses``): LoRA training through the public API on the CPU. For each text
  family of :data:`notebookkit.families.FAMILIES` (its tiny model) x ``use_gradient_checkpointing`` in
  ``False``, ``True``, ``"unsloth"`` (the offload alias; on a CPU offload runs as recompute): an fp32
  base (``load_in_4bit=False``), a seeded r=8 adapter on the seven projections (``lora_dropout=0``),
  3 plain AdamW steps on a fixed seeded batch (one row right-padded), each step's loss as
  ``float.hex`` and ``repr``, the SHA-256 of the base weights and of the adapters before and after,
  the loss and gradients of a packed row, the banner's feature lines, and of the first step the
  number of module forward calls (recomputation shows) and of the tensors saved for the backward;
  per family also the same with a bf16 base (no checkpointing) and, after ``for_inference``, greedy
  ``generate`` ids (one prompt, and two left-padded). With the tiny VLMs (``FastVisionModel``, all
  three modes, a caption batch; ``--no-vision`` leaves them out) likewise, plus one image-prompt
  generation. No NF4 base: bitsandbytes' CPU ``dequantize_4bit`` is wrong on AVX-512 CPUs, and the
  NF4 export above already covers the 4-bit path's bytes. One thread, deterministic algorithms;
  about 15 s (a whole run with ``--exports``: 30-40 s).

Run it at the old and the new commit (each tree first on ``PYTHONPATH``, each with a tiny cache of
its own, the same hash seed: PEFT writes ``target_modules`` in set order), the same copy of this
script both times (``$SCRIPT``; it prints which ``notebookkit`` it imported), and compare the two
files. Build each cache first (``PYTHONPATH=$NEW NOTEBOOKKIT_CACHE=/tmp/cache-new python -m
notebookkit.embedded``, about 1.5 min): a model this script has to build is built on its one thread,
many times slower (the same bytes either way)::

    PYTHONHASHSEED=0 PYTHONPATH=$OLD NOTEBOOKKIT_CACHE=/tmp/cache-old python $SCRIPT \
        --exports --losses --out /tmp/before.json
    PYTHONHASHSEED=0 PYTHONPATH=$NEW NOTEBOOKKIT_CACHE=/tmp/cache-new python $SCRIPT \
        --exports --losses --out /tmp/after.json
    cmp /tmp/before.json /tmp/after.json

The exports' recipe (``tests/export/conftest.py``) is read from the script's own tree, the package
under test from ``PYTHONPATH``; the losses import public names only. When the files differ, the
``losses`` entries tell a changed load (``base_sha256``, ``load_banner``) from a changed setup
(``adapter_init_sha256``, ``banner``, ``trainable``) from changed arithmetic (``losses``,
``adapter_sha256``, ``packed``) or changed checkpointing (``module_calls_step1``,
``saved_tensors_step1``).

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
            try:
                out[f"gguf_family {mt}"] = _plain(gguf_family(type("C", (), {"model_type": mt})()))
            except Exception as exc:  # noqa: BLE001 - a family GGUF refuses (mixture of experts): its message
                out[f"gguf_family {mt}"] = str(exc)
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


# ------------------------------------------------------------------------------------------- losses
#: ``use_gradient_checkpointing`` values the losses are recorded under: no checkpointing, recompute,
#: and offload through its ``"unsloth"`` alias (on a CPU offload runs as recompute, the banner says so)
CHECKPOINT_MODES = (False, True, "unsloth")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LOSS_STEPS = 3
LORA_SEED = 3407


def _hex(x: float) -> str:
    return float(x).hex()


def _tensors_sha(named) -> str:
    """SHA-256 over ``(name, dtype, shape, raw bytes)`` of each tensor, in name order."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        t = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _adapter_sha(model) -> str:
    return _tensors_sha((n, p) for n, p in model.named_parameters() if p.requires_grad)


def _banner_record(model) -> dict:
    """The banner's feature lines and notes (its header holds versions and free memory: left out)."""
    banner = getattr(model, "notebookkit_banner", None)
    if banner is None:
        return {}
    return {"features": {k: [bool(on), why] for k, (on, why) in banner.features.items()}, "notes": list(banner.notes)}


def _text_batch(tokenizer, vocab: int) -> dict:
    """Two rows of 24 seeded token ids; the second right-padded after 17; labels off the first 3
    tokens (a prompt) and the padding."""
    import torch

    g = torch.Generator().manual_seed(0)
    seq = 24
    ids = torch.randint(3, vocab, (2, seq), generator=g)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, 17:] = 0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = ids.masked_fill(mask == 0, pad)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _probed_step(model, batch: dict, record: dict):
    """Forward and backward of one step, watched: the forward calls of every module over both (a layer
    that checkpointing recomputes runs its modules again in the backward) and the tensors autograd
    saves in the forward outside checkpointed regions (count, bytes: what the step holds for its
    backward). Returns the output."""
    import torch

    calls = [0]
    saved = [0, 0]

    def count(*_):
        calls[0] += 1

    def pack(t):
        saved[0] += 1
        saved[1] += t.numel() * t.element_size()
        return t

    handles = [m.register_forward_hook(count) for m in model.modules()]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(**batch)
        out.loss.backward()
    finally:
        for h in handles:
            h.remove()
    record["module_calls_step1"] = calls[0]
    record["saved_tensors_step1"] = saved
    return out


def _train(model, batch: dict, steps: int = LOSS_STEPS, lr: float = 5e-3) -> dict:
    """``steps`` plain AdamW steps on ``batch`` (the trainable parameters, in name order): each step's
    loss (``float.hex`` and ``repr``), and what :func:`_probed_step` sees of the first step."""
    import torch

    model.train()
    params = [p for _, p in sorted(model.named_parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, eps=1e-6)
    losses, rec = [], {}
    for step in range(steps):
        if step == 0:
            out = _probed_step(model, batch, rec)
        else:
            out = model(**batch)
            out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.detach().float().item())
    rec.update(losses=[_hex(x) for x in losses], losses_repr=[repr(x) for x in losses])
    return rec


def _packed_batch(vocab: int) -> dict:
    """One packed row of three seeded examples (positions restart; no label across a boundary)."""
    import torch

    g = torch.Generator().manual_seed(1)
    lengths = (7, 9, 6)
    ids = torch.cat([torch.randint(3, vocab, (n,), generator=g) for n in lengths])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.masked_fill(pos == 0, -100)
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def _loss_and_grads(model, batch: dict) -> dict:
    """One forward and backward (no step) in training mode: the loss and the SHA-256 of the gradients."""
    model.train()
    out = model(**batch)
    out.loss.backward()
    rec = {"loss": _hex(out.loss.detach().float().item()),
           "grads_sha256": _tensors_sha((n, p.grad) for n, p in model.named_parameters() if p.grad is not None)}
    model.zero_grad(set_to_none=True)
    return rec


def _generate(model, inputs: dict, new_tokens: int = 6) -> dict:
    """Greedy ``generate`` ids, and the warnings it gave (a fallback to Hugging Face's generate says so)."""
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return {"ids": ids.tolist(), "warnings": sorted({f"{w.category.__name__}: {w.message}" for w in caught})}


def _text_run(family: str, dtype_name: str, mode, generate: bool) -> dict:
    import torch

    from notebookkit import FastLanguageModel

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    model, tokenizer = FastLanguageModel.from_pretrained(f"notebookkit/tiny-{family}", max_seq_length=64,
                                                         dtype=dtype, load_in_4bit=False, show_banner=False)
    rec = {"base_sha256": _tensors_sha(model.state_dict().items()), "load_banner": _banner_record(model)}
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=list(LORA_TARGETS), random_state=LORA_SEED,
                                             use_gradient_checkpointing=mode, show_banner=False)
    rec["banner"] = _banner_record(model)
    rec["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rec["adapter_init_sha256"] = _adapter_sha(model)
    rec.update(_train(model, _text_batch(tokenizer, model.config.vocab_size)))
    rec["adapter_sha256"] = _adapter_sha(model)
    rec["packed"] = _loss_and_grads(model, _packed_batch(model.config.vocab_size))
    if generate:
        FastLanguageModel.for_inference(model)
        tokenizer.padding_side = "left"
        rec["generate"] = _generate(model, dict(tokenizer(["The old"], return_tensors="pt")))
        if tokenizer.pad_token_id is not None:
            enc = tokenizer(["The old", "A small river runs past the"], return_tensors="pt", padding=True)
            rec["generate_left_padded"] = _generate(model, dict(enc))
    return rec


def _vision_run(family: str, mode, generate: bool) -> dict:
    import torch

    from notebookkit import FastVisionModel
    from notebookkit.data import VisionDataCollator
    from notebookkit.embedded import load_bundled
    from notebookkit.families import FAMILIES

    torch.manual_seed(0)
    model, processor = FastVisionModel.from_pretrained(FAMILIES[family].vision.tiny_name, max_seq_length=128,
                                                       dtype=torch.float32, load_in_4bit=False, show_banner=False)
    rec = {"base_sha256": _tensors_sha(model.state_dict().items()), "load_banner": _banner_record(model)}
    model = FastVisionModel.get_peft_model(model, r=8, lora_alpha=16, lora_dropout=0.0, random_state=LORA_SEED,
                                           use_gradient_checkpointing=mode, show_banner=False)
    rec["banner"] = _banner_record(model)
    rec["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rec["adapter_init_sha256"] = _adapter_sha(model)
    rows = load_bundled("captions", split="train")
    rows = [rows[i] for i in range(2)]
    batch = VisionDataCollator(model, processor)(rows)
    rec["batch_sha256"] = _tensors_sha(batch.items())
    rec.update(_train(model, batch))
    rec["adapter_sha256"] = _adapter_sha(model)
    if generate:
        FastVisionModel.for_inference(model)
        questions = ["Describe this image.", "What colour is the shape?"]
        texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                             {"type": "text", "text": q}]}],
                                               tokenize=False, add_generation_prompt=True) for q in questions]
        processor.tokenizer.padding_side = "left"
        inputs = processor(text=texts, images=[[r["image"]] for r in rows], return_tensors="pt", padding=True,
                           add_special_tokens=False)
        rec["generate_images_left_padded"] = _generate(model, dict(inputs))
    return rec


def losses(vision: bool = True) -> dict:
    """The ``losses`` section (module docstring): per text family x checkpointing mode an fp32 run,
    per family a bf16 one, and with ``vision`` each tiny VLM x mode; one thread, deterministic
    algorithms (both restored on return)."""
    import time

    import torch

    from notebookkit.families import FAMILIES

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = {}
    try:
        for family in FAMILIES:
            for mode in CHECKPOINT_MODES:
                t0 = time.perf_counter()
                out[f"text {family} float32 checkpointing={mode!r}"] = _text_run(family, "float32", mode,
                                                                                 generate=mode is False)
                print(f"  losses {family} float32 {mode!r}: {time.perf_counter() - t0:.1f} s", flush=True)
            out[f"text {family} bfloat16 checkpointing=False"] = _text_run(family, "bfloat16", False, generate=False)
        for name, fam in FAMILIES.items():
            if vision and fam.vision is not None:
                for mode in CHECKPOINT_MODES:
                    t0 = time.perf_counter()
                    out[f"vision {fam.vision.tiny_name} float32 checkpointing={mode!r}"] = _vision_run(
                        name, mode, generate=mode is False)
                    print(f"  losses {fam.vision.tiny_name} {mode!r}: {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--exports", action="store_true")
    parser.add_argument("--tiny-cache", default=None)
    parser.add_argument("--no-grid", action="store_true")
    parser.add_argument("--losses", action="store_true", help="record the LoRA training losses (key 'losses')")
    parser.add_argument("--no-vision", action="store_true", help="with --losses: leave out the tiny VLMs")
    args = parser.parse_args()
    import notebookkit  # from PYTHONPATH, before the exports put this script's tree on sys.path

    print(f"notebookkit from {Path(notebookkit.__file__).parent}", file=sys.stderr, flush=True)
    result = {}
    if not args.no_grid:
        result["tables"] = tables()
        result["memory"] = memory_grid()
    if args.exports:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            result["exports"] = exports(Path(tmp))
    if args.losses:
        result["losses"] = losses(vision=not args.no_vision)
    if args.tiny_cache:
        result["tiny_cache"] = _folder_hashes(Path(args.tiny_cache))
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"{args.out}: {sum(len(v) for v in result.values())} entries")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
