"""One LoRA training step of a mixture of experts, notebookkit beside Unsloth and HF + PEFT (issue #36).

    python benchmarks/moe_step.py --out benchmarks/results                 # GPU: both shapes + the T4 row
    python benchmarks/moe_step.py --shapes gpt-oss-20b --systems notebookkit,hf --no-t4
    python benchmarks/moe_step.py --tiny --out /tmp/moe                     # CPU: checks this script
    bash benchmarks/moe_session.sh                                          # the whole table, one device call

Shapes: the Qwen3-30B-A3B and gpt-oss-20b numbers of their public configs (``SHAPES``; the layer count
reduced by ``--layers``, default 4, every width kept), random bf16 weights drawn on the GPU and saved
once as a Hugging Face folder with a byte-level tokenizer, so every system loads the same files and
nothing is downloaded. ``--tiny`` uses the embedded tiny models of the same families instead
(``notebookkit/tiny-qwen3_moe``, ``notebookkit/tiny-gpt_oss``) on the CPU in fp32, 16-bit weights.

Step tables (one per shape): NF4 base, bf16 compute, ``--seq`` tokens x ``--batch`` rows, LoRA r=16
alpha=16 on q/k/v/o and the experts, AdamW, ``--warmup`` steps then ``--steps`` timed steps (CUDA events
between steps; tok/s from the median step). Every system trains on the same learnable token stream
(``learning_check.cycle_stream``), so the loss falls within the run. Systems (``--systems``), one process
per row:

* ``unsloth``            Unsloth's FastLanguageModel (imported before transformers), offloaded checkpointing,
                         the seven projection names (Unsloth adds its expert parameters itself);
* ``notebookkit``        FastLanguageModel ``load_in_4bit=True`` + ``get_peft_model`` with the default targets
                         (attention and the stacked experts, as the README's "Mixtures of experts" says),
                         ``use_gradient_checkpointing="auto"`` (the planner fits free VRAM);
* ``notebookkit-device-bounds`` the same with ``NOTEBOOKKIT_MOE_DEVICE_BOUNDS=1`` in its process only (the NF4
                         experts' chunks without a host read, ``SWITCHED``): an A/B in the same rounds;
* ``notebookkit-capped`` the same with ``max_memory`` = the ``unsloth`` row's measured peak (``--cap-gib``
                         instead when given): the planner's fastest activation plan at <= the peer's peak;
* ``hf``                 transformers + bitsandbytes NF4 + PEFT (``target_parameters`` for gpt-oss's experts,
                         PEFT's own mapping for Qwen3-MoE's), gradient checkpointing. bitsandbytes quantises
                         ``nn.Linear`` only, so its experts stay 16-bit (the ``experts`` column measures it):
                         its peak is not comparable. ``prepare_model_for_kbit_training`` is not called, since
                         it would cast those 16-bit experts to fp32; what it does otherwise (freeze,
                         checkpointing, input gradients) is done here.

The experts' adapters differ by system at the Qwen3-30B-A3B shape: PEFT maps ``gate_proj`` + ``up_proj`` onto the
stacked ``gate_up_proj`` at rank 2r (notebookkit and hf follow it: 82.9M trainable at 4 layers), Unsloth adapts it
at r (53.5M). ``--expert-adapters stacked`` gives the notebookkit and hf rows Unsloth's adapters (the stacked
weights at r, named as ``target_parameters``), so the three rows train the same parameters.

Peak = ``torch.cuda.max_memory_allocated`` over the training steps (the weights resident); load peak =
the same over loading (notebookkit quantises each stacked expert weight as transformers reads it: the load
peak shows what that leaves). Predicted =
notebookkit's memory model for the model as set up (``notebookkit.memory.estimate_for_model``, the
function the planner calls). A system that refuses the configuration while loading is a row with its
message; a failure, a timeout or an OOM is a row too.

T4 emulation (``--t4-shape``, default gpt-oss-20b): fp16 weights and autocast, ``torch.amp.GradScaler`` at
its initial scale 65536, ``torch.cuda.set_per_process_memory_fraction`` for ``--t4-cap-gib`` (15), notebookkit
planned for that cap; skipped steps (the scaler found inf/NaN and halved its scale) counted, host RSS
sampled every 0.1 s (resident and anonymous: ``notebookkit.memory.meters.process_memory``), and the memory model's prediction for the full-depth model (recompute) beside.

A host-bound step's time swings between processes on one machine (session 41, Qwen3-30B-A3B on an H200:
notebookkit's median step 36.8-63.2 ms over seven processes, Unsloth's 47.4-52.5 over four):
``--repeats N`` runs every step-table system N times in rounds (a process each), shows each system's median process
in the table, and under it every process's median step and the round-by-round ratio to Unsloth. ``--profile DIR``
profiles one more step of every row (``profile_step``'s report: GPU busy time, the idle split into waits for the
host's launches and the rest).

Writes ``<out>/<date>-<device>-moe-step.json`` and ``.md`` after every row; the table is printed last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

if "--system" in sys.argv and sys.argv[sys.argv.index("--system") + 1] == "unsloth":
    import unsloth  # noqa: F401  (Unsloth must be imported before transformers)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from max_context import OOM_MARKERS, is_out_of_memory  # noqa: E402  (this folder: pure helpers, no torch)
from process_rounds import median_rows, rounds, row_timeout, spread_lines  # noqa: E402
from run import failure_reason, step_host_cell  # noqa: E402

# Public configs (Qwen/Qwen3-30B-A3B, openai/gpt-oss-20b). Qwen3MoeConfig's defaults differ from 30B-A3B in
# head_dim (None: hidden / heads = 64), layers (24), norm_topk_prob and rope theta; GptOssConfig's defaults are
# gpt-oss-120b's (36 layers, 128 experts) with 20b's widths, its yarn RoPE and alternating sliding window of 128.
SHAPES: dict[str, dict] = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=0.001, rope_theta=1000000.0, max_position_embeddings=40960,
        rms_norm_eps=1e-6, use_sliding_window=False, attention_bias=False, tie_word_embeddings=False,
    ),
    "gpt-oss-20b": dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, swiglu_limit=7.0, router_aux_loss_coef=0.9, attention_bias=True,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        # layer_types (sliding, full, ...) and the yarn RoPE (theta 150000, factor 32): GptOssConfig's defaults
    ),
}
TINY = {"qwen3-30b-a3b": "notebookkit/tiny-qwen3_moe", "gpt-oss-20b": "notebookkit/tiny-gpt_oss"}
SYSTEMS = ["unsloth", "notebookkit", "notebookkit-capped", "hf"]
#: systems run as notebookkit with one of the library's A/B switches set in their own process only, so that both
#: sides of an A/B alternate in one run's rounds (``--systems unsloth,notebookkit,notebookkit-device-bounds``)
SWITCHED = {"notebookkit-device-bounds": {"NOTEBOOKKIT_MOE_DEVICE_BOUNDS": "1"}}
T4_SYSTEMS = ["notebookkit", "unsloth"]
NEEDS = {"unsloth": "unsloth"}
ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_ADAPTERS_NOTE = {  # --expert-adapters, as the table's header states it
    "peft": "notebookkit and hf: PEFT's mapping of gate/up/down, Qwen3-MoE's gate_up at 2r; Unsloth: its own, at r",
    "stacked": "every row: the two stacked expert weights at r, named as target_parameters",
}
TARGETS = ATTENTION_TARGETS + ["gate_proj", "up_proj", "down_proj"]
R, ALPHA, SEED = 16, 16, 3407
STREAM_SYMBOLS = 32  # token ids in the learnable cycle (learning_check.cycle_stream)
FIRST_ROW_GRACE_S = {"unsloth": 120}  # Unsloth compiles its patched modules on its first import on a machine
# Learning check: the loss falls by at least MIN_LOSS_DROP over the run and by at least half as much as HF+PEFT's;
# the last loss is within FINAL_LOSS_TOL of HF+PEFT's (looser than run.py's 1%: HF's experts are 16-bit, ours NF4).
MIN_LOSS_DROP = 0.01
FINAL_LOSS_TOL = 0.05


# ------------------------------------------------------------------------------------------ checkpoint

def checkpoint_dir(shape: str, layers: int) -> str:
    root = os.environ.get("NOTEBOOKKIT_BENCH_CKPT", os.path.expanduser("~/.cache/notebookkit/bench"))
    return os.path.join(root, f"{shape}-{layers}-layers")


def shape_config(shape: str, layers: int):
    """The transformers config of ``shape`` with ``layers`` decoder layers (every width as published)."""
    from transformers import AutoConfig

    spec = dict(SHAPES[shape])
    model_type = spec.pop("model_type")
    spec["num_hidden_layers"] = layers
    return AutoConfig.for_model(model_type, bos_token_id=1, eos_token_id=2, pad_token_id=0, **spec)


def build_checkpoint(shape: str, layers: int) -> str:
    """Save a random-weight bf16 checkpoint of ``shape`` with ``layers`` layers (once), with a byte-level
    tokenizer, as ``train_step.build_checkpoint`` does for the dense shapes."""
    from train_step import save_random_checkpoint

    folder = checkpoint_dir(shape, layers)
    if os.path.exists(os.path.join(folder, "done")):
        return folder
    return save_random_checkpoint(shape_config(shape, layers), folder)


def model_folder(shape: str, layers: int, tiny: bool) -> str:
    if tiny:
        from notebookkit.embedded.tiny import ensure_tiny_model

        return str(ensure_tiny_model(TINY[shape]))
    return build_checkpoint(shape, layers)


# ------------------------------------------------------------------------------------------ systems

def stacked_adapter_targets(folder: str) -> dict:
    """``--expert-adapters stacked``: LoRA at rank r on attention and on the experts' two stacked weights named
    as ``target_parameters`` (what Unsloth trains), instead of PEFT's mapping of the MLP names (Qwen3-MoE's
    gate_up at 2r: 55% more trainable parameters at the 30B-A3B shape). gpt-oss gets the same either way."""
    from transformers import AutoConfig

    from notebookkit.families import for_model_type

    family = for_model_type(AutoConfig.from_pretrained(folder).model_type)
    return dict(target_modules=ATTENTION_TARGETS, target_parameters=list(family.moe.lora_parameters))


def load_system(system: str, folder: str, device: str, dtype, quant: str, seq: int, batch: int,
                max_memory: str | None, expert_adapters: str = "peft"):
    """``system``'s model with LoRA r=16 on attention and the experts, ready to train (``expert_adapters``:
    ``"peft"``, the seven names as each system maps them, or ``"stacked"``, :func:`stacked_adapter_targets`;
    Unsloth always adapts the stacked weights at r)."""
    import torch

    targets = stacked_adapter_targets(folder) if expert_adapters == "stacked" else {}
    if system == "notebookkit":
        from notebookkit import FastLanguageModel

        model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=seq, dtype=dtype, load_in_4bit=quant == "nf4")
        return FastLanguageModel.get_peft_model(
            model, r=R, lora_alpha=ALPHA, lora_dropout=0.0, bias="none", use_gradient_checkpointing="auto",
            random_state=SEED, planning_batch_size=batch, max_memory=max_memory, **targets,
        )
    if system == "unsloth":
        from unsloth import FastLanguageModel as UnslothModel

        model, _ = UnslothModel.from_pretrained(model_name=folder, max_seq_length=seq, dtype=dtype,
                                                load_in_4bit=quant == "nf4")
        return UnslothModel.get_peft_model(model, r=R, lora_alpha=ALPHA, lora_dropout=0, bias="none",
                                           target_modules=TARGETS, use_gradient_checkpointing="unsloth",
                                           random_state=SEED)
    if system != "hf":
        raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from notebookkit.families import for_model_type

    family = for_model_type(AutoConfig.from_pretrained(folder).model_type)
    # gpt-oss's sinks are not expressible in SDPA: transformers refuses "sdpa" for it and runs eager
    kwargs = dict(dtype=dtype, attn_implementation="eager" if family.attention_sinks else "sdpa")
    if device == "cuda":
        kwargs["device_map"] = {"": 0}
    if quant == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    # prepare_model_for_kbit_training without its cast of every 16-bit parameter to fp32 (the experts here)
    for p in model.parameters():
        p.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    if not targets:
        targets = dict(target_modules=TARGETS)
        if not family.moe.peft_maps_mlp_targets:
            targets["target_parameters"] = list(family.moe.lora_parameters)
    torch.manual_seed(SEED)
    return get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                                            **targets))


def expert_weights(model) -> dict:
    """Bytes and storage formats of the frozen expert weights as loaded (biases and adapters left out):
    NF4 / bitsandbytes 4-bit codes are uint8 (``4-bit``), 16-bit experts show their dtype."""
    import itertools

    import torch

    total, formats = 0, set()
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if ".experts." not in name or "lora_" in name or name.endswith("bias") or t.requires_grad:
            continue
        total += t.numel() * t.element_size()
        formats.add("4-bit" if t.dtype == torch.uint8 else str(t.dtype).replace("torch.", ""))
    return dict(expert_gib=round(total / 2**30, 3), expert_format="+".join(sorted(formats)) or "none found")


def plan_counts(model) -> str | None:
    """notebookkit's per-layer activation plan, e.g. '4 keep' or '1 keep, 3 recompute'."""
    from notebookkit.memory.model_setup import recorded_activation_plan
    from notebookkit.models.patching.checkpointing import plan_counts as count_modes

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modes = recorded_activation_plan(base)
    if modes is None:
        return None
    if isinstance(modes, str):
        return "all keep" if modes == "none" else modes
    return count_modes(modes)


def predicted(model, batch: int, seq: int, shape: str | None) -> dict:
    """The memory model's peak (GiB) for the model as set up, and for the full-depth ``shape`` (recompute)."""
    out: dict = {"predicted_gib": None, "predicted_full_depth_gib": None}
    try:
        from notebookkit.memory import estimate_for_model, estimate_kwargs_from_model, estimate_training_memory

        out["predicted_gib"] = round(estimate_for_model(model, batch_size=batch, seq_len=seq).peak_allocated / 2**30, 3)
        if shape is not None:
            full = shape_config(shape, SHAPES[shape]["num_hidden_layers"])
            kwargs = estimate_kwargs_from_model(model)
            est = estimate_training_memory(full, **kwargs, batch_size=batch, seq_len=seq, activation_plan="recompute")
            out["predicted_full_depth_gib"] = round(est.peak_allocated / 2**30, 3)
    except Exception as exc:  # noqa: BLE001 - the prediction is informative, never fatal to a row
        print(f"(no memory prediction: {type(exc).__name__}: {exc})", file=sys.stderr)
    return out


def short(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def run_system(args) -> dict:
    """(child) Load one system, train ``warmup + steps`` steps, return its row."""
    import resource

    import torch

    from host_waits import HostWaits
    from learning_check import cycle_stream
    from train_step import INITIAL_SCALE, cap_gpu_memory, skipped_flags, skipped_steps, versions

    device = "cpu" if args.tiny else "cuda"
    if device == "cpu":
        dtype = torch.float32
    else:
        dtype = torch.float16 if args.t4 else torch.bfloat16
    row = dict(system=args.label or args.system, shape=args.shape, layers=args.layers, seq=args.seq, batch=args.batch,
               quant=args.quant, dtype=str(dtype).replace("torch.", ""), t4=args.t4, max_memory=args.max_memory,
               cap_gib=args.t4_cap_gib if args.t4 else None, tiny=args.tiny)
    if device == "cuda":
        row["gpu"] = torch.cuda.get_device_name(0)
        if args.t4:
            cap_gpu_memory(args.t4_cap_gib)
        torch.cuda.reset_peak_memory_stats()
    row["versions"] = versions(args.system)
    folder = model_folder(args.shape, args.layers, args.tiny)
    from notebookkit.memory.meters import HostMemorySampler

    with HostMemorySampler() as rss:
        t0 = time.time()
        try:
            model = load_system(args.system, folder, device, dtype, args.quant, args.seq, args.batch, args.max_memory,
                                args.expert_adapters)
        except Exception as exc:  # noqa: BLE001 - a system that refuses the setting is a row, not a crash
            import traceback

            traceback.print_exc()
            kind = "out of memory at load" if is_out_of_memory(exc) else "refused at load"
            return row | dict(status=f"{kind}: {short(exc)}", host_rss_peak_gib=round(rss.peak_rss / 2**30, 3),
                              host_anon_peak_gib=round(rss.peak_anon / 2**30, 3))
        row["load_s"] = round(time.time() - t0, 1)
        if device == "cuda":
            row["load_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        model.train()
        row |= expert_weights(model)
        row["plan"] = plan_counts(model) if args.system == "notebookkit" else None
        params = [p for p in model.parameters() if p.requires_grad]
        row["trainable"] = sum(p.numel() for p in params)
        optimizer = torch.optim.AdamW(params, lr=args.lr, **({"fused": True} if device == "cuda" else {}))
        scaler = torch.amp.GradScaler(device, init_scale=INITIAL_SCALE, enabled=args.t4)
        autocast = torch.autocast("cuda", dtype=torch.float16, enabled=args.t4 and device == "cuda")
        vocab = model.config.vocab_size
        batches = cycle_stream(args.warmup + args.steps, args.batch, args.seq, vocab, symbols=STREAM_SYMBOLS, seed=0,
                               device=device)
        scales: list[float] = []  # the loss scale after each step (T4 emulation)

        def step(ids):
            with autocast:
                loss = model(input_ids=ids, labels=ids).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if args.t4:
                scales.append(scaler.get_scale())
            return loss.detach()

        try:
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            losses = [step(ids) for ids in batches[: args.warmup]]
            step_s: list[float] = []
            if device == "cuda":
                torch.cuda.synchronize()
                marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
                start = time.time()
                marks[0].record()
                with HostWaits() as waits:  # each step's host time, waits, collections and the host's contention
                    for i, ids in enumerate(batches[args.warmup:]):
                        with waits.step():
                            losses.append(step(ids))
                        marks[i + 1].record()
                row["step_host"] = waits.steps
                torch.cuda.synchronize()
                elapsed = time.time() - start
                step_s = [a.elapsed_time(b) / 1000 for a, b in zip(marks, marks[1:])]
            else:
                start = time.time()
                for ids in batches[args.warmup:]:
                    t = time.perf_counter()
                    losses.append(step(ids))
                    step_s.append(time.perf_counter() - t)
                elapsed = time.time() - start
        except Exception as exc:  # noqa: BLE001 - keep what was measured
            import traceback

            traceback.print_exc()
            kind = "out of memory in training" if is_out_of_memory(exc) else "failed in training"
            return row | dict(status=f"{kind}: {short(exc)}", host_rss_peak_gib=round(rss.peak_rss / 2**30, 3),
                              host_anon_peak_gib=round(rss.peak_anon / 2**30, 3))
    if args.profile and device == "cuda":
        profile_one_step(args, row, lambda: step(batches[-1]))
    median = statistics.median(step_s)
    tokens = args.batch * args.seq
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**30
        row["reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux): the CPU check
    losses = [round(float(x), 5) for x in losses]
    row |= dict(
        status="ok", tok_s=round(tokens / median, 1), tok_s_mean=round(tokens * args.steps / elapsed, 1),
        step_ms=round(median * 1e3, 2), step_ms_all=[round(s * 1e3, 2) for s in step_s],
        peak_gib=round(peak, 3), host_rss_peak_gib=round(rss.peak_rss / 2**30, 3),
        host_anon_peak_gib=round(rss.peak_anon / 2**30, 3),
        losses=losses, loss_first=losses[0], loss_last=losses[-1], token_stream=f"cycle of {STREAM_SYMBOLS} ids",
    )
    if args.t4:
        row |= dict(scales=scales, skipped_steps=skipped_steps(scales),
                    first_step_finite=bool(scales) and not skipped_flags(scales)[0])
    if args.system == "notebookkit":
        row |= predicted(model, args.batch, args.seq, None if args.tiny else args.shape)
    return row


def profile_one_step(args, row: dict, step) -> None:
    """(child, ``--profile DIR``) One more step under ``torch.profiler``: where its GPU time goes, written as
    ``DIR/profile-<shape>-<system>[-t4].md`` by ``profile_step.render_report`` (kernel categories, top kernels, and
    the GPU's idle time split into waits for the host's launches and the rest: a host-bound step shows there)."""
    import torch

    from profile_step import busy_us, device_kernels, profile_steps, render_report, trace_facts

    prof, wall_ms = profile_steps([step])
    kernels, intervals = device_kernels(prof.events())
    try:
        gaps, _, api = trace_facts(prof)
    except Exception as exc:  # noqa: BLE001 - the gap split is extra information, never fatal
        print(f"(no idle-gap analysis: {exc})", file=sys.stderr)
        gaps, api = None, None
    name = f"profile-{args.shape}-{row['system']}{'-t4' if args.t4 else ''}{f'-{args.repeat}' if args.repeat else ''}.md"
    facts = [("GPU", f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"),
             ("model", f"{args.shape} shape, {args.layers} layers, {args.quant}, {row['dtype']}"),
             ("activation plan", str(row.get("plan")))]
    text = render_report(f"One MoE training step of {row['system']}: {args.seq} tokens x {args.batch}", facts,
                         wall_ms, busy_us(intervals) / 1e3, kernels, gaps=gaps, top=30, api=api)
    os.makedirs(args.profile, exist_ok=True)
    with open(os.path.join(args.profile, name), "w") as fh:
        fh.write(text)
    print(text)


# ------------------------------------------------------------------------------------------ parent

def resolve(system: str) -> tuple[str, list[str]]:
    """(child --system, extra child arguments) of a table's system name."""
    return ("notebookkit", []) if system == "notebookkit-capped" or system in SWITCHED else (system, [])


def child_command(system: str, shape: str, args, t4: bool = False, max_memory: str | None = None,
                  repeat: int = 0) -> list[str]:
    base, extra = resolve(system)
    cmd = [sys.executable, os.path.abspath(__file__), "--system", base, "--label", system, "--shape", shape,
           "--layers", str(args.layers), "--seq", str(args.seq), "--batch", str(args.batch), "--quant", args.quant,
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--lr", str(args.lr),
           "--t4-cap-gib", str(args.t4_cap_gib), "--expert-adapters", args.expert_adapters, "--repeat", str(repeat),
           *extra]
    if t4:
        cmd.append("--t4")
    if max_memory:
        cmd += ["--max-memory", max_memory]
    if getattr(args, "profile", None):
        cmd += ["--profile", os.path.abspath(args.profile)]
    return cmd + (["--tiny"] if args.tiny else [])


def parse_child(stdout: str, stderr: str, returncode: int) -> dict:
    """The row a child printed (``RESULT {json}``), or a failed row with the reason from its output."""
    results = [line[len("RESULT "):] for line in stdout.splitlines() if line.startswith("RESULT ")]
    if results:
        return json.loads(results[-1])
    text = stderr or stdout
    kind = "out of memory" if any(m in text for m in OOM_MARKERS) else f"failed (exit {returncode})"
    return {"status": f"{kind}: {failure_reason(text)}"}


def run_child(system: str, shape: str, table: str, args, timeout: float, t4: bool = False,
              max_memory: str | None = None, repeat: int = 0) -> dict:
    head = dict(table=table, system=system, shape=shape, layers=args.layers, t4=t4, repeat=repeat)
    need = NEEDS.get(resolve(system)[0])
    if need and importlib.util.find_spec(need) is None:
        return head | dict(status=f"not installed ({need})")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               **SWITCHED.get(system, {}))
    cmd = child_command(system, shape, args, t4, max_memory, repeat)
    start = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=max(1.0, timeout))
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout, stderr, code = _text(exc.stdout), _text(exc.stderr), None
    if args.log_dir:
        with open(os.path.join(args.log_dir, f"{table}-{system}{f'-{repeat}' if repeat else ''}.log"), "w") as fh:
            fh.write(shlex.join(cmd) + "\n\n" + stdout + "\n--- stderr ---\n" + stderr)
    wall = dict(table=table, system=system, wall_s=round(time.time() - start, 1))
    if code is None and "RESULT " not in stdout:
        return head | dict(status=f"timed out after {timeout:.0f} s: {failure_reason(stderr or stdout or '(no output)')}") | wall
    return head | parse_child(stdout, stderr, code if code is not None else -9) | wall


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def learning_verdict(row: dict, hf_row: dict | None) -> str:
    """"pass", "FAIL: <reasons>" or "–" for one ok row: the loss fell by at least ``MIN_LOSS_DROP``; against
    ``hf_row`` (HF+PEFT in the same table, when it ran) by at least half as much, and the last loss is within
    ``FINAL_LOSS_TOL`` of HF+PEFT's. NaN fails every check."""
    from learning_check import loss_drop

    losses = row.get("losses") or []
    if len(losses) < 2:
        return "– (fewer than 2 losses)"
    problems = []
    drop = loss_drop(losses)
    if not drop >= MIN_LOSS_DROP:
        problems.append(f"loss fell {drop:.2%} (< {MIN_LOSS_DROP:.0%})")
    if hf_row is not None and hf_row is not row and len(hf_row.get("losses") or []) >= 2:
        hf_drop = loss_drop(hf_row["losses"])
        if not drop >= 0.5 * hf_drop:
            problems.append(f"loss fell {drop:.2%}, hf {hf_drop:.2%}")
        gap = abs(losses[-1] - hf_row["losses"][-1]) / abs(hf_row["losses"][-1])
        if not gap <= FINAL_LOSS_TOL:
            problems.append(f"last loss {gap:.2%} from hf's (> {FINAL_LOSS_TOL:.0%})")
    return "pass" if not problems else "FAIL: " + "; ".join(problems)


def _num(value, fmt: str = ".2f") -> str:
    return "–" if value is None else format(value, fmt)


def step_host_lines(rows: list[dict]) -> list[str]:
    """Each timed step of the rows that recorded their host (``host_waits``): its time, then its host waits on the
    GPU, collections, the host's CPU time, involuntary context switches and the machine's steal time."""
    out = []
    for r in rows:
        if r.get("status") == "ok" and r.get("step_host"):
            run_no = f" (run {r['repeat'] + 1})" if r.get("repeat") else ""
            out.append(f"- {r['system']}{run_no}: " + "; ".join(
                f"{t:.1f} ms ({step_host_cell(h)})" for t, h in zip(r["step_ms_all"], r["step_host"])))
    return ["", "Per timed step (host waits on the GPU, collections, the host's CPU time, involuntary context "
                "switches, the machine's steal time, allocator counters):", *out] if out else []


def step_table(rows: list[dict]) -> list[str]:
    """One shape's step table: speed and peak, the ratios to Unsloth's and HF's rows of the same table (a system
    that ran more than once: its median process, :func:`process_rounds.median_rows`)."""
    rows = median_rows(rows, "step_ms")
    ok = {r["system"]: r for r in rows if r.get("status") == "ok"}
    uns, hf = ok.get("unsloth"), ok.get("hf")
    lines = ["| system | tok/s | step ms | × unsloth | × hf | peak GiB | peak × unsloth | predicted GiB | load peak GiB "
             "| experts | trainable | activation plan | loss first → last | learning check | status |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|---|---|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['system']} | – | – | – | – | – | – | – | – | – | – | – | – | – | {r.get('status')} |")
            continue
        x_uns = _num(r["tok_s"] / uns["tok_s"]) if uns else "–"
        x_hf = f"{r['tok_s'] / hf['tok_s']:.2f}†" if hf else "–"
        peak_uns = _num(r["peak_gib"] / uns["peak_gib"]) if uns else "–"
        experts = f"{r.get('expert_format', '?')} {_num(r.get('expert_gib'))} GiB"
        lines.append(
            f"| {r['system']} | {r['tok_s']:,.0f} | {r['step_ms']:.1f} | {x_uns} | {x_hf} | {r['peak_gib']:.2f} | {peak_uns} "
            f"| {_num(r.get('predicted_gib'))} | {_num(r.get('load_peak_gib'))} | {experts} | {r.get('trainable', 0):,} "
            f"| {r.get('plan') or '–'} | {r['loss_first']:.4f} → {r['loss_last']:.4f} | {learning_verdict(r, hf)} | ok |")
    return lines


def host_memory_cell(row: dict) -> str:
    """``resident (anonymous)`` peak host GiB of a row (rows written before session 30 have the first only)."""
    anon = row.get("host_anon_peak_gib")
    return _num(row.get("host_rss_peak_gib")) + (f" ({anon:.2f})" if anon is not None else "")


def t4_table(rows: list[dict]) -> list[str]:
    lines = ["| system | tok/s | step ms | peak GiB | predicted GiB | full depth predicted GiB | load peak GiB "
             "| host RSS peak GiB (anon) | skipped steps | first step at 65536 finite | activation plan | loss first → last "
             "| learning check | status |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") != "ok":
            rss = host_memory_cell(r)
            lines.append(f"| {r['system']} | – | – | – | – | – | – | {rss} | – | – | – | – | – | {r.get('status')} |")
            continue
        skipped = f"{r['skipped_steps']} of {len(r['scales'])}"
        lines.append(
            f"| {r['system']} | {r['tok_s']:,.0f} | {r['step_ms']:.1f} | {r['peak_gib']:.2f} | {_num(r.get('predicted_gib'))} "
            f"| {_num(r.get('predicted_full_depth_gib'))} | {_num(r.get('load_peak_gib'))} | {host_memory_cell(r)} "
            f"| {skipped} | {'yes' if r['first_step_finite'] else 'NO'} | {r.get('plan') or '–'} "
            f"| {r['loss_first']:.4f} → {r['loss_last']:.4f} | {learning_verdict(r, None)} | ok |")
    return lines


HF_NOTE = ("† `hf` = transformers + bitsandbytes NF4 + PEFT. bitsandbytes quantises `nn.Linear` only: its stacked "
           "experts stay 16-bit (the experts column), so its peak is not comparable with the NF4 rows. "
           "`prepare_model_for_kbit_training` is not called (it would cast those experts to fp32); its freeze, "
           "gradient checkpointing and input gradients are. gpt-oss runs Hugging Face's eager attention (sinks).")


def markdown(rows: list[dict], meta: dict) -> str:
    """The whole report: header, one step table per shape, the T4-emulation table."""
    ok = [r for r in rows if r.get("status") == "ok"]
    first = next((r for r in ok if r["system"].startswith("notebookkit")), ok[0] if ok else {})
    versions = dict(first.get("versions", {}))
    for r in ok:  # Unsloth's own versions from its row
        versions.update({k: v for k, v in r.get("versions", {}).items() if k.startswith("unsloth")})
    rpt = meta.get("repeats", 1)
    lines = [
        f"# Mixture-of-experts LoRA step, {meta.get('device', '?')}, {meta.get('date', dt.date.today())}", "",
        f"Command: `{meta.get('command', '?')}`", "",
        f"Versions: {', '.join(f'{k} {v}' for k, v in versions.items()) or '–'}.", "",
        f"Random-weight checkpoints of the public shapes with {meta.get('layers')} decoder layers (full widths), "
        f"{meta.get('quant')} base, {meta.get('seq')} tokens × {meta.get('batch')} row(s), LoRA r={R} alpha={ALPHA} on "
        f"q/k/v/o and the experts ({EXPERT_ADAPTERS_NOTE[meta.get('expert_adapters', 'peft')]}), "
        f"AdamW lr {meta.get('lr')}, {meta.get('warmup')} warm-up + {meta.get('steps')} timed steps, "
        f"one process per row{f', every system {rpt} times in rounds (the table: its median process)' if rpt > 1 else ''}. "
        "tok/s and step ms: the median timed step (CUDA events); ratios use it. Peak: "
        "`torch.cuda.max_memory_allocated` over the training steps (weights resident); load peak: over loading. "
        "Predicted: notebookkit's memory model (`estimate_for_model`, the planner's function) for the model as set "
        "up. `notebookkit-capped`: the planner's plan under `max_memory` = the `unsloth` row's peak "
        "(or `--cap-gib`). Learning check: the loss fell ≥ 1% and ≥ half of HF+PEFT's, last loss within 5% of "
        "HF+PEFT's (token stream: a fixed cycle of 32 ids).",
    ]
    if meta.get("tiny"):
        lines += ["", "**--tiny**: the embedded tiny models of the same families (not the shapes above) on the CPU in "
                      "fp32, no 4-bit, no memory cap: checks the script, measures nothing (peak = process max RSS)."]
    for table in dict.fromkeys(r["table"] for r in rows if r.get("table") != "t4"):
        trs = [r for r in rows if r["table"] == table]
        title = TINY[table] if meta.get("tiny") else f"{table} shape, {meta.get('layers')} layers"
        dtype = next((r["dtype"] for r in trs if r.get("dtype")), "?")
        lines += ["", f"## {title}: {meta.get('quant')} base, {dtype}, {meta.get('seq')} × {meta.get('batch')}", ""]
        lines += step_table(trs) + spread_lines(trs, "step_ms", "unsloth", "ms") + step_host_lines(trs)
    if any(r.get("table") != "t4" for r in rows):
        lines += ["", HF_NOTE]
    t4 = [r for r in rows if r.get("table") == "t4"]
    if t4:
        shape = TINY[t4[0]["shape"]] if meta.get("tiny") else f"{t4[0]['shape']} shape, {meta.get('layers')} layers"
        lines += ["", f"## T4 emulation: {shape}, {meta.get('quant')}, fp16 + GradScaler, {meta.get('seq')} × "
                      f"{meta.get('batch')}, cap {meta.get('t4_cap_gib')} GiB", "",
                  "fp16 weights and autocast, `torch.amp.GradScaler` from 65536, "
                  "`torch.cuda.set_per_process_memory_fraction` for the cap (notebookkit planned with "
                  "`max_memory` = the cap); skipped = steps whose gradients held inf/NaN (the scale halved); host RSS "
                  "sampled every 0.1 s, resident (anonymous: less the file-backed pages, such as the memory-mapped "
                  "checkpoint's, which the system can drop); full depth predicted: the memory model for the published layer count "
                  "(recompute).", ""] + t4_table(t4)
    return "\n".join(lines) + "\n"


def write(rows: list[dict], meta: dict, stem: str) -> str:
    table = markdown(rows, meta)
    with open(stem + ".json", "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    with open(stem + ".md", "w") as fh:
        fh.write(table)
    return table


def order_systems(systems: list[str]) -> list[str]:
    """``systems`` with ``notebookkit-capped`` after ``unsloth`` (it caps at Unsloth's measured peak)."""
    if "notebookkit-capped" in systems and "unsloth" in systems and \
            systems.index("notebookkit-capped") < systems.index("unsloth"):
        systems = [s for s in systems if s != "notebookkit-capped"]
        systems.insert(systems.index("unsloth") + 1, "notebookkit-capped")
    return systems


def run_order(shapes: list[str], systems: list[str], t4_systems: list[str], t4_shape: str,
              repeats: int = 1) -> list[tuple[str, str, bool]]:
    """(shape, system, T4 emulation?) in the order they run: each shape's step rows (``order_systems``) in
    ``repeats`` rounds (every system once a round, so a drift of the machine's speed over the run reaches every
    system alike), the T4 rows right after the step rows of ``t4_shape`` (so a run cut short by its budget loses
    the last shape's rows, not the T4 table), or last when that shape has no step rows."""
    plan: list[tuple[str, str, bool]] = []
    t4 = [(t4_shape, s, True) for s in t4_systems]
    for shape in shapes:
        plan += [(shape, s, False) for s, _ in rounds(order_systems(systems), repeats)]
        if shape == t4_shape:
            plan, t4 = plan + t4, []
    return plan + t4


def capped_memory(rows: list[dict], cap_gib: float | None) -> tuple[str | None, str]:
    """(``max_memory`` for the capped row, or None, and why): ``--cap-gib`` or the Unsloth row's peak."""
    if cap_gib:
        return f"{cap_gib:.3f}GiB", f"--cap-gib {cap_gib}"
    uns = next((r for r in rows if r["system"] == "unsloth" and r.get("status") == "ok"), None)
    if uns is None:
        return None, "skipped: no unsloth peak to cap at"
    return f"{uns['peak_gib']:.3f}GiB", "unsloth's peak"


def gpu_name() -> str:
    """The first GPU's name from ``nvidia-smi`` (the parent holds no CUDA context while the rows run), or "CPU"."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
        names = out.stdout.strip().splitlines()
        return names[0].strip() if out.returncode == 0 and names else "CPU"
    except (OSError, subprocess.TimeoutExpired):
        return "CPU"


def run_all(args) -> tuple[list[dict], dict, str]:
    device = "CPU" if args.tiny else gpu_name()
    # the library's A/B switches set for the run (NOTEBOOKKIT_MOE_DEVICE_BOUNDS, ...), which every child inherits
    switches = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                        if k.startswith("NOTEBOOKKIT_") and k != "NOTEBOOKKIT_BENCH_CKPT")
    command = (switches + " " if switches else "") + "python " + shlex.join(
        [os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:])
    meta = dict(device=device, date=str(dt.date.today()), command=command,
                layers=args.layers, seq=args.seq, batch=args.batch, quant=args.quant, lr=args.lr, warmup=args.warmup,
                steps=args.steps, t4_cap_gib=args.t4_cap_gib, tiny=args.tiny, expert_adapters=args.expert_adapters,
                repeats=args.repeats)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{meta['date']}-{device.replace(' ', '-')}-moe-step{'-tiny' if args.tiny else ''}"
                                  f"{('-' + args.tag) if args.tag else ''}")
    args.log_dir = stem + "-logs"
    os.makedirs(args.log_dir, exist_ok=True)
    deadline = time.time() + args.budget_s if args.budget_s else None
    started: set[str] = set()
    rows: list[dict] = []

    def remaining(system: str) -> float | None:
        grace = 0 if system in started else FIRST_ROW_GRACE_S.get(system, 0)
        started.add(system)
        return row_timeout(args.timeout + grace, deadline, time.time())

    def add(row: dict) -> None:
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("versions", "step_ms_all", "scales", "step_host")}),
              flush=True)
        write(rows, meta, stem)

    plan = run_order(args.shapes.split(","), args.systems.split(","), [] if args.no_t4 else args.t4_systems.split(","),
                     args.t4_shape, args.repeats)
    prepared: set[str] = set()
    runs: dict[tuple[str, str], int] = {}
    for shape, system, t4 in plan:
        table = "t4" if t4 else shape  # also in log file names: no spaces
        repeat = runs[table, system] = runs.get((table, system), -1) + 1
        if not args.tiny and shape not in prepared:  # build the checkpoint in a process of its own
            prepared.add(shape)
            cmd = [sys.executable, os.path.abspath(__file__), "--prepare", "--shape", shape, "--layers", str(args.layers)]
            t = time.time()
            try:
                left = None if deadline is None else max(1.0, deadline - t)
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
                print(f"prepared {shape} in {time.time() - t:.0f} s" if proc.returncode == 0
                      else f"preparing {shape} failed: {failure_reason(proc.stderr)}", flush=True)
            except subprocess.TimeoutExpired:
                print(f"preparing {shape} ran past the session budget", flush=True)
        max_memory = None
        if t4:
            max_memory = f"{args.t4_cap_gib}GiB" if system == "notebookkit" else None
        elif system == "notebookkit-capped":
            max_memory, why = capped_memory([r for r in rows if r["table"] == table], args.cap_gib)
            if max_memory is None:
                add(dict(table=table, system=system, shape=shape, layers=args.layers, t4=t4, repeat=repeat, status=why))
                continue
        timeout = remaining(system)
        if timeout is None:
            add(dict(table=table, system=system, shape=shape, layers=args.layers, t4=t4, repeat=repeat,
                     status=f"skipped: the session budget of {args.budget_s} s ran out"))
            continue
        add(run_child(system, shape, table, args, timeout, t4=t4, max_memory=max_memory, repeat=repeat))
    return rows, meta, stem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", default=None, help="(child) run one system in this process")
    ap.add_argument("--label", default=None, help="(child) the row's name in the table")
    ap.add_argument("--shape", default="gpt-oss-20b", choices=sorted(SHAPES), help="(child, --prepare) the shape")
    ap.add_argument("--shapes", default="gpt-oss-20b,qwen3-30b-a3b", help="step tables, in this order")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the random checkpoints (widths as published)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--quant", default="nf4", choices=["nf4", "none"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--cap-gib", type=float, default=None, help="notebookkit-capped: this cap instead of Unsloth's peak")
    ap.add_argument("--t4", action="store_true", help="(child) T4 emulation: fp16, GradScaler, memory cap")
    ap.add_argument("--no-t4", action="store_true", help="leave out the T4-emulation table")
    ap.add_argument("--t4-shape", default="gpt-oss-20b", choices=sorted(SHAPES))
    ap.add_argument("--t4-systems", default=",".join(T4_SYSTEMS))
    ap.add_argument("--t4-cap-gib", type=float, default=15.0)
    ap.add_argument("--max-memory", default=None, help="(child) notebookkit's max_memory")
    ap.add_argument("--expert-adapters", default="peft", choices=["peft", "stacked"],
                    help="the experts' LoRA in the notebookkit and hf rows: PEFT's mapping of the MLP names (Qwen3-MoE's "
                         "gate_up at 2r) or the stacked weights at r, as Unsloth trains them")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per row (Unsloth's first row gets 120 more)")
    ap.add_argument("--budget-s", type=int, default=0, help="whole run: rows that would start after it are skipped")
    ap.add_argument("--tiny", action="store_true", help="embedded tiny models on the CPU, fp32 (checks the script)")
    ap.add_argument("--prepare", action="store_true", help="only build the --shape checkpoint")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--profile", default=None,
                    help="profile one more step of every row, a report each in this folder (profile_one_step)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="step tables: run every system's row this many times, a process each, in rounds")
    ap.add_argument("--repeat", type=int, default=0, help="(child) which of the --repeats this row is")
    args = ap.parse_args()
    if args.tiny:
        args.quant = "none"
        if "--seq" not in sys.argv:
            args.seq = 64
        if "--lr" not in sys.argv:
            args.lr = 5e-3  # a few steps on a tiny model: the learning check needs a visible fall
    if args.prepare:
        print("prepared", build_checkpoint(args.shape, args.layers))
        return
    if args.system is not None:
        print("RESULT " + json.dumps(run_system(args)), flush=True)
        sys.stderr.flush()
        os._exit(0)  # the row is out: no teardown of a large model (or a library's threads) can hang the run
    rows, meta, stem = run_all(args)
    print(f"wrote {stem}.json and .md")
    print(write(rows, meta, stem))


if __name__ == "__main__":
    main()
