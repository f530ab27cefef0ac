"""One LoRA training step of a vision-language model with a batch of images: time and peak memory,
notebookkit vs transformers + PEFT vs Unsloth's FastVisionModel, each system in its own process.

    python benchmarks/vision_step.py --out benchmarks/results                  # Qwen2.5-VL-7B shape, NF4
    python benchmarks/vision_step.py --shape gemma-3-4b --out benchmarks/results
    python benchmarks/vision_step.py --tiny --out /tmp/vision                  # CPU check of the script

The model is random-weight, of the real model's shapes (config numbers from the public
``config.json``: text decoder and vision tower), saved once as a bf16 checkpoint with the tiny
VLM's tokenizer (its image tokens as the config's ids) and a processor for ``--image-size`` square
images, so nothing is downloaded. Every system loads that folder in 4-bit (NF4, double
quantisation; ``--quant none`` for 16-bit), puts LoRA r=16 (alpha 16, dropout 0) on the attention
and MLP projections of the vision tower and of the decoder (the same layers for every system: the
``finetune_*`` switches all on), and trains on the same batch: ``--batch`` rows of one image and a
caption (``notebookkit.data.VisionDataCollator``: labels on the caption only). Timed: ``--steps``
steps (forward with labels, backward, AdamW step) after ``--warmup`` steps; peak allocated CUDA
memory over the whole run (load included), beside the memory model's predicted allocated peak of the step
(``notebookkit.memory.estimate_for_model``: the model as set up, its batch's rows and length, one image
per row) for the notebookkit rows. ``--tiny`` runs the tiny VLM on the CPU in fp32 (no
4-bit: bitsandbytes' CPU decode is wrong on AVX-512 CPUs), peak = the process's max RSS.

Systems (``--systems``, comma-separated):

* ``notebookkit``          FastVisionModel, ``use_gradient_checkpointing="auto"`` (the planner fits free VRAM);
* ``notebookkit-offload``  the same with ``"offload"`` (layer inputs in pinned host memory, Unsloth's mode);
* ``notebookkit-lean``     ``"offload"`` and ``offload_embedding=True`` (the language model's input embedding
  table in host memory too);
* ``hf``                   the wrapper class + ``prepare_model_for_kbit_training`` (gradient checkpointing) + PEFT;
* ``unsloth``              Unsloth's FastVisionModel with ``use_gradient_checkpointing="unsloth"``;
* ``unsloth-lean``         the same with its ``offload_embedding=True``;
* ``notebookkit-lean-<N>GiB`` (or ``notebookkit-<N>GiB``, ``notebookkit-offload-<N>GiB``): that row planned by
  ``"auto"`` under ``max_memory="<N>GiB"`` for the batch's own rows and length (every step has that shape; a cap
  counts the CUDA context, and the planner keeps an 8% margin): the fastest plan at no more than a peer's peak.

The parent writes ``<out>/<date>-<device>-vision-<shape>-<system>_<system>....json`` and ``.md`` and prints the
table (one file per set of systems, so rows split over several runs do not overwrite each other). A
system whose package is missing is reported as "not installed", a failed one with its error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import subprocess
import sys
import time

if "--system" in sys.argv and sys.argv[sys.argv.index("--system") + 1].startswith("unsloth"):
    import unsloth  # noqa: F401  (Unsloth must be imported before transformers)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from process_rounds import median_rows, rounds, spread_lines  # noqa: E402
from train_step import plan_counts, versions  # noqa: E402  (this folder: the row's plan and package versions)

from notebookkit.memory.vision_shapes import VLM_CONFIGS  # noqa: E402

# Text decoder and vision tower numbers of the public configs (random weights of these shapes): the
# memory model's curated VLMs, one source for both.
SHAPES: dict[str, dict] = VLM_CONFIGS
SYSTEMS = ["notebookkit", "notebookkit-offload", "notebookkit-lean", "hf", "unsloth", "unsloth-lean"]
NEEDS = {"unsloth": "unsloth", "unsloth-lean": "unsloth"}


def capped(system: str) -> tuple[str, str | None]:
    """``(system, max_memory)``: ``"notebookkit-lean-9GiB"`` is ``notebookkit-lean`` planned by ``"auto"`` under
    ``max_memory="9GiB"`` (a row at no more than a peer's peak), as ``benchmarks/run.py``'s ``notebookkit-<N>GiB``."""
    head, _, cap = system.rpartition("-")
    if head in SYSTEMS and head.startswith("notebookkit") and cap.endswith("GiB"):
        try:
            float(cap[:-3])
            return head, cap
        except ValueError:
            pass
    return system, None


def setup_max_memory(cap: str | None, max_memory: str | None) -> str | None:
    """The cap ``get_peft_model`` plans under. A capped row (:func:`capped`) is planned later for its batch's own
    rows and length, so its setup plans without the cap: under it, the setup's plan for ``max_seq_length`` tokens
    a row can refuse a cap the batch fits (Gemma-3-4B at 6 GiB: 4 rows of 2,048 tokens need 6.11 GiB, its 4 rows
    of 307 plan at 5.48; session 43's call 4 was refused so). ``--max-memory`` alone plans at setup."""
    return None if cap else max_memory


def system_name(system: str) -> str:
    """argparse type of ``--system``: one of SYSTEMS or a capped notebookkit row (:func:`capped`)."""
    if system not in SYSTEMS and capped(system)[1] is None:
        raise argparse.ArgumentTypeError(f"unknown system {system!r}: one of {', '.join(SYSTEMS)}, or "
                                         "notebookkit[-offload|-lean]-<N>GiB")
    return system
R, ALPHA, SEED = 16, 16, 3407


# ------------------------------------------------------------------------------------ checkpoint

def checkpoint_dir(shape: str, image_size: int) -> str:
    root = os.environ.get("NOTEBOOKKIT_BENCH_CKPT", os.path.expanduser("~/.cache/notebookkit/bench"))
    return os.path.join(root, f"{shape}-{image_size}px")


def build_checkpoint(shape: str, image_size: int) -> str:
    """A random-weight bf16 checkpoint of ``shape`` (once), with the tiny VLM's tokenizer and a processor
    for ``image_size`` x ``image_size`` images."""
    import shutil

    import torch
    import transformers as tf

    from notebookkit.embedded.tiny import ensure_tiny_model
    from notebookkit.families import family

    spec = SHAPES[shape]
    vision = family(spec["family"]).vision
    folder = checkpoint_dir(shape, image_size)
    if os.path.exists(os.path.join(folder, "done")):
        return folder
    tiny = str(ensure_tiny_model(vision.tiny_name))
    tiny_config = tf.AutoConfig.from_pretrained(tiny)
    ids = {key: getattr(tiny_config, key) for key in vision.tiny.token_ids}
    text = dict(spec["text"], bos_token_id=tiny_config.get_text_config().bos_token_id,
                eos_token_id=tiny_config.get_text_config().eos_token_id,
                pad_token_id=tiny_config.get_text_config().pad_token_id)
    config = getattr(tf, vision.config_class)(text_config=text, vision_config=dict(spec["vision"]), **ids,
                                              **spec.get("config", {}),
                                              tie_word_embeddings=text.get("tie_word_embeddings", True))
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = getattr(tf, vision.model_class)._from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # Gemma 3's projection starts at zero in transformers: no image would reach the decoder
        for name in vision.tiny.redraw:
            dict(model.named_parameters())[name].normal_(0.0, 0.02)
    model.save_pretrained(folder)
    del model
    for f in os.listdir(tiny):
        if f.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(os.path.join(tiny, f), os.path.join(folder, f))
    processor = json.load(open(os.path.join(tiny, "processor_config.json")))
    image = dict(processor["image_processor"], **spec.get("image_processor", {}))
    if "min_pixels" in vision.tiny.image_processor or "longest_edge" in image.get("size", {}):
        image["size"] = {"shortest_edge": image_size * image_size, "longest_edge": image_size * image_size}
    else:
        image["size"] = {"height": image_size, "width": image_size}
    processor["image_processor"] = image
    processor.update(spec.get("processor", {}))
    if "video_processor" in processor:
        processor["video_processor"] = dict(processor["video_processor"], **spec.get("image_processor", {}),
                                            size=image["size"])
    json.dump(processor, open(os.path.join(folder, "processor_config.json"), "w"), indent=2)
    open(os.path.join(folder, "done"), "w").close()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return folder


def tiny_folder(shape_family: str = "qwen2") -> str:
    from notebookkit.embedded.tiny import ensure_tiny_model
    from notebookkit.families import family

    return str(ensure_tiny_model(family(shape_family).vision.tiny_name))


# ----------------------------------------------------------------------------------------- rows

def caption_rows(batch: int, image_size: int) -> list[dict]:
    """``batch`` rows of the bundled caption layout: one drawn image (resized to ``image_size``), a caption."""
    from notebookkit.embedded.bundled import load_bundled

    ds = load_bundled("captions")
    rows = []
    for i in range(batch):
        row = ds[i]
        image = row["image"].convert("RGB")
        if image.size != (image_size, image_size):
            image = image.resize((image_size, image_size))
        rows.append({"messages": row["messages"], "images": [image]})
    return rows


def load_system(system: str, folder: str, quant: str, seq: int, batch: int, device: str, max_memory=None,
                dtype_name: str = "bfloat16"):
    """(model, processor) of ``system`` with LoRA on every attention / MLP projection of both towers."""
    import torch

    dtype = getattr(torch, dtype_name) if device == "cuda" else torch.float32
    if system.startswith("notebookkit"):
        from notebookkit import FastVisionModel

        mode = "auto" if system == "notebookkit" or max_memory else "offload"  # a cap: the planner's plan under it
        mode = mode if device == "cuda" else False
        model, processor = FastVisionModel.from_pretrained(folder, max_seq_length=seq, dtype=dtype,
                                                           load_in_4bit=quant == "nf4",
                                                           offload_embedding=system == "notebookkit-lean")
        model = FastVisionModel.get_peft_model(model, r=R, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                                               use_gradient_checkpointing=mode, random_state=SEED,
                                               planning_batch_size=batch, max_memory=max_memory)
        return model, processor
    if system.startswith("unsloth"):
        from unsloth import FastVisionModel as UnslothVision

        lean = dict(offload_embedding=True) if system == "unsloth-lean" else {}
        model, processor = UnslothVision.from_pretrained(folder, load_in_4bit=quant == "nf4", dtype=dtype,
                                                         max_seq_length=seq, use_gradient_checkpointing="unsloth",
                                                         **lean)
        model = UnslothVision.get_peft_model(model, finetune_vision_layers=True, finetune_language_layers=True,
                                             finetune_attention_modules=True, finetune_mlp_modules=True, r=R,
                                             lora_alpha=ALPHA, lora_dropout=0, bias="none", random_state=SEED,
                                             use_gradient_checkpointing="unsloth")
        UnslothVision.for_training(model)
        return model, processor
    return load_hf(folder, quant, dtype, device)


def load_hf(folder: str, quant: str, dtype, device: str):
    """The wrapper class + (4-bit) ``prepare_model_for_kbit_training`` + PEFT, as most notebooks run it."""
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    from notebookkit.families import for_vision_model_type
    from notebookkit.models.common.banner import Banner
    from notebookkit.models.vision.processor import load_processor
    from notebookkit.models.vision.targets import select_targets

    vision = for_vision_model_type(tf.AutoConfig.from_pretrained(folder).model_type).vision
    kwargs = dict(dtype=dtype, attn_implementation="sdpa")
    if device == "cuda":
        kwargs["device_map"] = {"": 0}
    if quant == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    model = getattr(tf, vision.model_class).from_pretrained(folder, **kwargs)
    if quant == "nf4":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    elif device == "cuda":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    names = select_targets(model, vision).names
    torch.manual_seed(SEED)
    model = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                                             target_modules=names, task_type="CAUSAL_LM"))
    return model, load_processor(folder, vision, Banner())


def run_system(args) -> dict:
    """Load one system, time its steps; the result row."""
    import resource

    import torch

    from notebookkit.data import VisionDataCollator

    device = "cpu" if args.tiny else "cuda"
    folder = tiny_folder() if args.tiny else build_checkpoint(args.shape, args.image_size)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    system, cap = capped(args.system)
    model, processor = load_system(system, folder, args.quant, args.seq, args.batch, device,
                                   setup_max_memory(cap, args.max_memory), args.dtype)
    load_s = time.time() - t0
    model.train()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    collator = VisionDataCollator(base, processor, max_seq_length=args.seq)
    batch = collator(caption_rows(args.batch, args.image_size))
    batch = {k: v.to(device) for k, v in batch.items()}
    if cap and device == "cuda":  # every step has this batch's shape: plan for it, as max_seq_length would
        from notebookkit.models.patching.checkpointing import apply_checkpointing

        rows, length = batch["input_ids"].shape
        apply_checkpointing(model, "auto", seq_len=int(length), batch_size=int(rows), max_memory=cap,
                            padded=bool((batch["attention_mask"] == 0).any()), images_per_row=1)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4, **({"fused": True} if device == "cuda" else {}))
    # fp16 (a T4's precision): the loss scaler the Trainer uses under fp16=True; bf16 / fp32 need none
    scaler = torch.amp.GradScaler("cuda", enabled=device == "cuda" and args.dtype == "float16")

    def step() -> float:
        out = model(**batch)
        scaler.scale(out.loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return out.loss.detach()

    losses = [step() for _ in range(args.warmup)]
    times = []
    for _ in range(args.steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(step())
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    losses = [round(float(x), 5) for x in losses]
    if args.profile and device == "cuda":
        try:
            profile_step(step, base, batch, args)
        except Exception:  # noqa: BLE001 - a breakdown that fails must not lose the row
            import traceback

            traceback.print_exc()
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**30
        reserved = torch.cuda.max_memory_reserved() / 2**30
        name = torch.cuda.get_device_name(0)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
        reserved, name = None, "CPU"
    tokens = int(batch["attention_mask"].sum())
    vision = collator_vision(base)
    image_tokens = int((batch["input_ids"] == processor.tokenizer.convert_tokens_to_ids(vision.image_token)).sum())
    banner = getattr(base, "notebookkit_banner", None)
    rows, seq = batch["input_ids"].shape
    padded = bool((batch["attention_mask"] == 0).any())
    predicted = predicted_peak(model, int(rows), int(seq), args.image_size, args.profile, padded) \
        if args.system.startswith("notebookkit") else None
    return dict(
        system=args.system, shape="tiny" if args.tiny else args.shape, quant=args.quant, dtype=args.dtype,
        batch=args.batch,
        image_size=args.image_size, tokens=tokens, image_tokens=image_tokens, seq=int(batch["input_ids"].shape[1]),
        s_step=round(sorted(times)[len(times) // 2], 4), step_s=[round(t, 4) for t in times],
        peak_gib=round(peak, 3), reserved_gib=None if reserved is None else round(reserved, 3), predicted_gib=predicted,
        trainable=sum(p.numel() for p in params), load_s=round(load_s, 1), losses=losses,
        fused=None if banner is None else {k: on for k, (on, _) in banner.features.items()},
        device=name, versions=versions(system), plan=plan_counts(model) if system.startswith("notebookkit") else None,
    )


def profile_step(step, base, batch, args) -> None:
    """One more step, broken down: CUDA-event times of the vision tower's forward, the decoder's forward
    and the rest of the step (head + loss + backward + optimizer), and the torch profiler's op table
    (sorted by CUDA time, then by CPU time), written to ``<profile>/vision-profile-<system>.txt``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from notebookkit.models.vision.patcher import submodule

    vision = collator_vision(base)
    marks: dict[str, list] = {}  # name -> [start event, end event, host start, host end], first call only

    def hooks(name: str, module):
        def pre(*_):
            if name not in marks:
                marks[name] = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                               time.perf_counter(), None]
                marks[name][0].record()

        def post(*_):
            if marks[name][3] is None:
                marks[name][1].record()
                marks[name][3] = time.perf_counter()
        return module.register_forward_pre_hook(pre), module.register_forward_hook(post)

    handles = []
    for name, path in (("vision tower forward", vision.vision_tower), ("decoder forward", vision.language_model)):
        module = submodule(base, path)
        if module is not None:
            handles += hooks(name, module)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    wall = time.perf_counter()
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    for h in handles:
        h.remove()
    tower = submodule(base, vision.vision_tower)
    kinds: dict[str, int] = {}
    for m in tower.modules() if tower is not None else ():
        if isinstance(m, torch.nn.Linear) or "Linear" in type(m).__name__:
            kinds[type(m).__name__] = kinds.get(type(m).__name__, 0) + 1
    checkpointed = sum(bool(getattr(m, "gradient_checkpointing", False)) for m in tower.modules()) if tower else 0
    lines = [f"vision tower: attention {getattr(tower.config, '_attn_implementation', '?') if tower else '?'}, "
             f"linear modules {kinds}, modules with gradient_checkpointing on: {checkpointed}"]
    lines += [f"system {args.system}: step wall {wall * 1e3:.1f} ms, CUDA events {start.elapsed_time(end):.1f} ms"]
    for name, (begin, finish, host_begin, host_finish) in marks.items():
        lines.append(f"  {name}: {begin.elapsed_time(finish):.1f} ms on the GPU, "
                     f"{(host_finish - host_begin) * 1e3:.1f} ms on the host")
    lines += memory_breakdown(base, batch, vision)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in averages)
    lines.append(f"  profiled step: self device time of all ops {kernel_us / 1e3:.1f} ms")
    lines.append(averages.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=60))
    lines.append(averages.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60))
    os.makedirs(args.profile, exist_ok=True)
    with open(os.path.join(args.profile, f"vision-profile-{args.system}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:5]), file=sys.stderr)


def memory_breakdown(model, batch, vision) -> list[str]:
    """Where one step's memory goes: the bytes autograd saves in the vision tower's forward and in the
    rest of the forward (unique storages, as seen by ``saved_tensors_hooks``; parameters and buffers,
    which the step holds anyway, left out), allocated memory at the end of the forward, and the peaks
    of the forward and of the backward."""
    import torch

    from notebookkit.models.vision.patcher import submodule

    seen = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()) if t.is_cuda}
    saved = {"vision tower": 0, "rest of the forward": 0}
    where = ["rest of the forward"]

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                saved[where[0]] += storage.nbytes()
        return t

    tower = submodule(model, vision.vision_tower)
    handles = [tower.register_forward_pre_hook(lambda *_: where.__setitem__(0, "vision tower")),
               tower.register_forward_hook(lambda *_: where.__setitem__(0, "rest of the forward"))]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**batch)
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated()
    forward_peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.loss.backward()
    torch.cuda.synchronize()
    backward_peak = torch.cuda.max_memory_allocated()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    gib = 2 ** 30
    return [f"  memory: allocated before the step {before / gib:.2f} GiB, after the forward {after_forward / gib:.2f}, "
            f"forward peak {forward_peak / gib:.2f}, backward peak {backward_peak / gib:.2f}",
            "  saved for backward: " + ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in saved.items())]


def predicted_peak(model, rows: int, seq: int, image_size: int, profile: str | None = None,
                   padded: bool = False) -> float | None:
    """The memory model's predicted allocated peak (GiB) of this step, as the model is set up (its
    activation plan, 4-bit, LoRA on both towers), for ``rows`` rows of ``seq`` tokens with one image of
    ``image_size`` pixels each (``padded``: rows padded to the longest); ``None`` (and why, on stderr) when it
    cannot say. With ``profile``, the
    estimate's parts go to ``<profile>/vision-estimate.txt`` beside the measured breakdown."""
    try:
        from notebookkit.memory import estimate_for_model
        from notebookkit.models.patching.checkpointing import kv_repeated

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        estimate = estimate_for_model(model, batch_size=rows, seq_len=seq, images_per_row=1, image_size=image_size,
                                      optimizer="adamw", padded=padded, kv_repeated=kv_repeated(base, padded))
        if profile:
            os.makedirs(profile, exist_ok=True)
            with open(os.path.join(profile, "vision-estimate.txt"), "a") as f:
                f.write(f"{rows} rows x {seq} tokens\n{estimate}\n\n")
        return round(estimate.peak_allocated / 2**30, 3)
    except Exception as exc:  # noqa: BLE001 - the prediction is informative, never fatal to a benchmark row
        print(f"(no memory prediction: {exc})", file=sys.stderr)
        return None


def collator_vision(model):
    """The vision row of a loaded wrapper (for its image token)."""
    from notebookkit.families import for_vision_model_type

    return for_vision_model_type(model.config.model_type).vision


# --------------------------------------------------------------------------------------- parent

def child_command(system: str, args) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--system", system, "--shape", args.shape, "--quant", args.quant,
           "--batch", str(args.batch), "--image-size", str(args.image_size), "--seq", str(args.seq),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--dtype", args.dtype] + \
        (["--max-memory", args.max_memory] if args.max_memory else []) + \
        (["--profile", args.profile] if args.profile else [])
    return cmd + (["--tiny"] if args.tiny else [])


def run_all(args) -> list[dict]:
    rows = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    for system, repeat in rounds(args.systems.split(","), args.repeats):
        row = dict(run_one(system, args, env), repeat=repeat)
        rows.append(row)
        print(f"{system}: {row['status']}" + (f", {row['s_step']} s/step, peak {row['peak_gib']} GiB"
                                               if row["status"] == "ok" else ""), flush=True)
        print("ROW " + json.dumps(row), flush=True)  # the whole row in the log, should the run be cut short
    return rows


def run_one(system: str, args, env: dict) -> dict:
    """One system's row, from its own process: ok, not installed, timed out or failed (with its error's tail)."""
    need = NEEDS.get(system)
    if need and importlib.util.find_spec(need) is None:
        return {"system": system, "status": f"not installed ({need})"}
    start = time.time()
    try:
        proc = subprocess.run(child_command(system, args), capture_output=True, text=True, env=env,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:  # a row that runs too long is reported, the others still are
        return {"system": system, "status": f"timed out after {args.timeout} s", "wall_s": round(time.time() - start, 1)}
    results = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode == 0 and results:
        row = json.loads(results[-1])
        row["status"] = "ok"
    else:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        row = {"system": system, "status": f"failed (exit {proc.returncode}): " + " | ".join(tail)}
    row["wall_s"] = round(time.time() - start, 1)
    return row


def markdown(rows: list[dict], args) -> str:
    """The table: one row a system (its median process where ``--repeats`` ran it more than once), then each
    process's step and the round-by-round ratio to Unsloth (or HF, without an Unsloth row)."""
    runs = rows
    rows = median_rows(rows, "s_step")
    repeats = getattr(args, "repeats", 1)
    repeated = f"; every system {repeats} times, a process each, in rounds (its median process shown)" if repeats > 1 else ""
    ok = [r for r in rows if r.get("status") == "ok"]
    first = ok[0] if ok else {}
    hf = next((r for r in ok if r["system"] == "hf"), None)
    lines = [
        f"# Vision-language LoRA step: {first.get('shape', args.shape)} ({args.quant}), "
        f"{args.batch} images of {args.image_size}x{args.image_size}",
        "",
        f"Device {first.get('device', '?')}; {first.get('seq', '?')} tokens per row "
        f"({first.get('image_tokens', '?')} image tokens in the batch); LoRA r={R} on every attention and MLP "
        f"projection of the vision tower and the decoder; {args.warmup} warm-up + {args.steps} timed steps "
        f"(median shown){repeated}. Peak: allocated CUDA memory over the run (CPU: max RSS); predicted: notebookkit's memory "
        "model for the step as set up (allocated peak, CUDA context left out).",
        "",
        "| system | s / step | x hf | peak GiB | predicted GiB | decoder plan | trainable | first loss | status |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['system']} | | | | | | | | {r['status']} |")
            continue
        speed = f"{hf['s_step'] / r['s_step']:.2f}" if hf else ""
        predicted = "" if r.get("predicted_gib") is None else f"{r['predicted_gib']:.2f}"
        lines.append(f"| {r['system']} | {r['s_step']:.3f} | {speed} | {r['peak_gib']:.2f} | {predicted} | "
                     f"{r.get('plan') or ''} | {r['trainable']:,} | "
                     f"{r['losses'][0]:.4f} | ok |")
    peer = "unsloth" if any(r["system"] == "unsloth" for r in ok) else "hf"
    return "\n".join(lines + spread_lines(runs, "s_step", peer, "s", ".3f")) + "\n"


def combine_runs(prefix: str, args) -> str | None:
    """Merge the rows of every run of this day, device and shape (``<prefix>-<systems>.json``; a later run's
    row of a system replaces an earlier one) into ``<prefix>-all.json`` / ``.md``; its table, or ``None``
    when there is only one run."""
    import glob

    files = sorted((f for f in glob.glob(prefix + "-*.json") if not f.endswith("-all.json")), key=os.path.getmtime)
    if len(files) < 2:
        return None
    merged: dict[str, dict] = {}
    for f in files:
        for row in json.load(open(f))["rows"]:
            if row.get("status") == "ok" or row["system"] not in merged:
                merged[row["system"]] = row
    rows = sorted(merged.values(), key=lambda r: (SYSTEMS.index(capped(r["system"])[0])
                                                   if capped(r["system"])[0] in SYSTEMS else len(SYSTEMS), r["system"]))
    table = markdown(rows, args)
    json.dump({"config": vars(args), "runs": files, "rows": rows}, open(prefix + "-all.json", "w"), indent=2)
    open(prefix + "-all.md", "w").write(table)
    print(f"combined {len(files)} runs into {prefix}-all.json and .md")
    return table


def systems_tag(rows: list[dict]) -> str:
    """The result files' name for a run's rows: each system once, in run order (``--repeats`` runs a system several
    times), joined by ``_`` (the names hold ``-``; the device tool refuses ``+`` in a file name)."""
    return "_".join(dict.fromkeys(r["system"] for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", default=None, type=system_name, help="(child) run one system in this process")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--shape", default="qwen2.5-vl-7b", choices=sorted(SHAPES))
    ap.add_argument("--quant", default="nf4", choices=["nf4", "none"], help="none: 16-bit weights (fp32 on CPU)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                    help="compute dtype on the GPU; float16 (a T4's) trains under a loss scaler")
    ap.add_argument("--image-size", type=int, default=None, help="square image side (default 448; Gemma 3: 896)")
    ap.add_argument("--seq", type=int, default=2048, help="max_seq_length given to the systems")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every system this many times, a process each, in rounds (a host-bound step swings "
                         "between processes): the table shows each system's median process")
    ap.add_argument("--tiny", action="store_true", help="the tiny Qwen2.5-VL on the CPU, fp32 (checks the script)")
    ap.add_argument("--prepare", action="store_true", help="only build the checkpoint")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--max-memory", default=None,
                    help='notebookkit rows: the "auto" plan under this VRAM cap (e.g. 7GiB) instead of their mode')
    ap.add_argument("--out", default=None, help="folder for the JSON and markdown results")
    ap.add_argument("--profile", default=None,
                    help="folder: after the timed steps, one step broken down by region and by op per system")
    args = ap.parse_args()
    if args.tiny:
        args.quant, args.image_size = "none", args.image_size or 64
    args.image_size = args.image_size or SHAPES[args.shape].get("image_size", 448)
    if args.prepare:
        print("prepared", build_checkpoint(args.shape, args.image_size))
        return
    if args.system is not None:
        print("RESULT " + json.dumps(run_system(args)), flush=True)
        return
    rows = run_all(args)
    table = markdown(rows, args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        device = next((r["device"] for r in rows if r.get("status") == "ok"), "none").replace(" ", "-")
        prefix = os.path.join(args.out, f"{dt.date.today().isoformat()}-{device}-vision-"
                                        f"{'tiny' if args.tiny else args.shape}")
        stem = prefix + "-" + systems_tag(rows)
        json.dump({"config": vars(args), "rows": rows}, open(stem + ".json", "w"), indent=2)
        open(stem + ".md", "w").write(table)
        print(f"wrote {stem}.json and .md")
        combined = combine_runs(prefix, args)
        if combined is not None:
            table = combined
    print(table)


if __name__ == "__main__":
    main()
