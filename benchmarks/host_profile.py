"""Where the host's time goes in notebookkit training steps, and which calls make it wait for the GPU.

A GPU step is host-bound when the GPU runs dry between kernels because Python has not launched the
next one yet (``profile_step.py`` counts those gaps). This script loads a system as
``train_step.py`` does, runs two warm-up steps, then writes to ``<out>/host-profile-<...>.txt``:

* every synchronising call of one step, with its stack (``torch.cuda.set_sync_debug_mode``): each one
  drains the GPU queue, so the host can run ahead by at most one step,
* a ``cProfile`` of three steps, sorted by own time and by cumulative time (launch overhead of
  Triton, casts, GEMM calls, the fused path's own Python),
* three steps without the profiler: when the host had queued them against when the GPU finished
  them. Far apart, the GPU sets the pace. Close together says nothing on its own when a step waits
  for the GPU inside it: an fp16 step does (``scaler.step`` reads the overflow flag on the host), and
  so does a step whose host pacing waits for offload copies. Then ``profile_step.py`` tells: the GPU
  busy time of a profiled step against the unprofiled step (session 32: the T4-emulation step,
  which is both, was 98% busy: GPU-bound).

    python benchmarks/host_profile.py --shape llama-3.2-1b --quant bf16 --seq 2048 --batch 8 \\
        --checkpointing offload --fp8 --out DIR
    python benchmarks/host_profile.py --shape llama-3.1-8b --quant nf4 --seq 4096 --batch 1 \\
        --checkpointing auto --dtype float16 --memory-cap-gib 15 --out DIR      # the T4 emulation
    python benchmarks/host_profile.py --shape qwen3-30b-a3b --quant nf4 --seq 2048 --batch 1 --out DIR

A mixture-of-experts shape of ``moe_step.py`` (``qwen3-30b-a3b``, ``gpt-oss-20b``) loads as that script's
``notebookkit`` row does: ``--layers`` decoder layers at full width, the ``"auto"`` plan, ``--expert-adapters``.

Needs CUDA. cProfile slows Python down, so its times are larger than in a plain step; compare them
with each other, not with the GPU's.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--quant", default="bf16", choices=["nf4", "bf16"])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--checkpointing", default="offload", choices=["auto", "offload", "offload_mlp", "true", "false"])
    ap.add_argument("--fp8", action="store_true", help="FP8 forward for the frozen base GEMMs")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                    help="float16 trains under autocast and a GradScaler (a T4's precision), as train_step.py")
    ap.add_argument("--memory-cap-gib", type=float, default=None, help="cap the allocator (15 with float16: a T4)")
    ap.add_argument("--layers", type=int, default=4, help="a mixture-of-experts shape's decoder layers (moe_step.py)")
    ap.add_argument("--expert-adapters", default="peft", choices=["peft", "stacked"], help="as moe_step.py's")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()

    import torch
    import moe_step
    import train_step
    from learning_check import cycle_stream

    if args.memory_cap_gib:
        train_step.cap_gpu_memory(args.memory_cap_gib)
    dtype = getattr(torch, args.dtype)
    if args.shape in moe_step.SHAPES:
        folder = moe_step.build_checkpoint(args.shape, args.layers)
        model = moe_step.load_system("notebookkit", folder, "cuda", dtype, args.quant, args.seq, args.batch, None,
                                     args.expert_adapters)
        args.checkpointing = f"auto-{args.layers}-layers-{args.expert_adapters}"  # what the header and file name say
        vocab = moe_step.SHAPES[args.shape]["vocab_size"]
        batches = cycle_stream(8, args.batch, args.seq, vocab, symbols=moe_step.STREAM_SYMBOLS, seed=0, device="cuda")
    else:
        folder = train_step.build_checkpoint(args.shape)
        model = train_step.load_notebookkit(folder, args.quant, args.seq, args.batch, args.checkpointing, None, args.fp8,
                                            dtype=dtype)
        batches = train_step.token_batches(args.shape, args.batch, args.seq, 8)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4, fused=True)
    fp16 = args.dtype == "float16"
    scaler = torch.amp.GradScaler("cuda", init_scale=train_step.INITIAL_SCALE) if fp16 else None
    step = train_step.training_step(model, optimizer, scaler)

    for ids in batches[:2]:
        step(ids)
    torch.cuda.synchronize()
    lines: list[str] = [f"# host profile: notebookkit {args.shape} {args.quant} {args.seq}x{args.batch} "
                        f"checkpointing={args.checkpointing} ({train_step.plan_counts(model)}) fp8={args.fp8} "
                        f"dtype={args.dtype} cap={args.memory_cap_gib} GiB, {torch.cuda.get_device_name(0)}"]

    stacks: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=14)[:-2])[-600:]
        stacks[stack] = stacks.get(stack, 0) + 1

    with warnings.catch_warnings():  # restores the filters and showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        step(batches[2])
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    lines.append(f"== {sum(stacks.values())} synchronising calls in one step, {len(stacks)} distinct stacks")
    for stack, count in sorted(stacks.items(), key=lambda kv: -kv[1]):
        lines.append(f"--- x{count}\n{stack}")

    profiler = cProfile.Profile()
    start = time.time()
    profiler.enable()
    for ids in batches[3:6]:
        step(ids)
    profiler.disable()
    host = time.time() - start
    torch.cuda.synchronize()
    lines.append(f"== 3 steps under cProfile: host done at {host * 1e3:.1f} ms, GPU done at {(time.time() - start) * 1e3:.1f} ms")
    for key in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(45)
        lines.append(text.getvalue())

    torch.cuda.synchronize()
    start = time.time()
    for ids in batches[5:8]:
        step(ids)
    host = time.time() - start
    torch.cuda.synchronize()
    lines.append(f"== 3 steps without profiler: host done at {host * 1e3:.1f} ms, GPU done at {(time.time() - start) * 1e3:.1f} ms"
                 + (" (each fp16 step reads the overflow flag on the host, so the two meet whoever sets the pace: "
                    "profile_step.py's busy share tells)" if fp16 else ""))

    os.makedirs(args.out, exist_ok=True)
    name = (f"host-profile-{args.shape}-{args.quant}-{args.seq}x{args.batch}-{args.checkpointing}{'-fp8' if args.fp8 else ''}"
            f"{'-fp16' if fp16 else ''}{f'-{args.memory_cap_gib:g}GiB' if args.memory_cap_gib else ''}.txt")
    with open(os.path.join(args.out, name), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(line for line in lines if line.startswith("==")))


if __name__ == "__main__":
    main()
