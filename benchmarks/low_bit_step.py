"""Train (and decode) on a 2-bit, ternary or NF4 base: one row per process, under a VRAM cap.

The rows of issue #33's tables:

* the 70B row: ``--shape llama-3.1-70b --format 2bit --cap-gib 24 --seq 2048 --steps 10``. The base is
  built directly in the packed format on the GPU (:func:`notebookkit.models.low_bit.random_model.random_low_bit_model`,
  ``--source random``): 140 GB of bf16 fits neither the GPU machine's disk nor its GPU. The LoRA rank
  and the per-layer activation plan are what :func:`notebookkit.memory.rank_fit.largest_lora_rank` fits
  to the cap (``--rank`` / ``--checkpointing`` override them), the input embedding in host memory when
  the fit says so;
* the 8B rows: ``--shape llama-3.1-8b --format 2bit|nf4 --source checkpoint``: the random bf16
  checkpoint of ``train_step.py`` loaded through ``from_pretrained(load_in_2bit=True / load_in_4bit=True)``
  (the 2-bit projections are quantised on load, on the GPU), the same rank and plan for both;
  ``--decode-tokens`` adds a batch-1 greedy decode through ``for_inference``.

Every row trains on ``learning_check``'s learnable token stream and prints ``RESULT {json}``: tokens/s
(mean and median step), the measured peak against the memory model's prediction, every step's loss.
On a CPU (``--shape llama-tiny``) it runs the same code without a cap: the CPU test of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import (SHAPES, TARGETS, build_checkpoint, cap_gpu_memory, plan_counts, predicted_peak, token_batches,  # noqa: E402
                        training_step, versions)

FLAGS = {"2bit": "load_in_2bit", "ternary": "load_in_ternary", "nf4": "load_in_4bit"}


def model_config(shape: str):
    from transformers import AutoConfig

    spec = dict(SHAPES[shape])
    return AutoConfig.for_model(spec.pop("model_type"), bos_token_id=1, eos_token_id=2, pad_token_id=0, **spec)


def fit_rank(config, fmt: str, cap_gib: float | None, seq: int, batch: int, max_rank: int = 256):
    """The memory model's answer for this row (:class:`~notebookkit.memory.rank_fit.RankFit`): the largest
    rank up to ``max_rank`` that fits the cap, its plan and where the input embedding lives."""
    from notebookkit.memory.rank_fit import largest_lora_rank

    budget = f"{cap_gib}GiB" if cap_gib else "140GiB"
    return largest_lora_rank(config, budget, seq_len=seq, batch_size=batch, max_rank=max_rank,
                             **{FLAGS[fmt]: True})


def build_model(args, config, device: str, offload_embedding: bool):
    """The base model with notebookkit's fused path (random packed weights, or a checkpoint loaded)."""
    from notebookkit import FastLanguageModel

    if args.source == "random":
        from notebookkit.models.low_bit.random_model import random_low_bit_model
        from notebookkit.models.loading.offload_embedding import offload_input_embedding

        model = random_low_bit_model(config, args.format, device=device, dtype=args.dtype, std=0.02)
        banner = FastLanguageModel.patch(model)
        if offload_embedding and device == "cuda":
            offload_input_embedding(model, banner)
        model.max_seq_length = args.seq
        return model
    folder = build_checkpoint(args.shape)
    model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=args.seq, dtype=args.dtype,
                                                 offload_embedding=offload_embedding, **{FLAGS[args.format]: True})
    return model


def decode_tok_s(model, tokens: int, device: str) -> dict:
    """Batch-1 greedy decode through ``for_inference``: tokens/s of a second run (the first captures graphs)."""
    from notebookkit import FastLanguageModel

    FastLanguageModel.for_inference(model)
    prompt = torch.arange(3, 19, device=device).unsqueeze(0)
    out = {}
    for run in ("first", "timed"):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.time()
        ids = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=False)
        if device == "cuda":
            torch.cuda.synchronize()
        out[f"{run}_s"] = round(time.time() - start, 3)
    out["new_tokens"] = int(ids.shape[1] - prompt.shape[1])
    out["tok_s"] = round(out["new_tokens"] / out["timed_s"], 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-70b", choices=sorted(SHAPES))
    ap.add_argument("--format", default="2bit", choices=sorted(FLAGS))
    ap.add_argument("--source", default="random", choices=["random", "checkpoint"])
    ap.add_argument("--cap-gib", type=float, default=None, help="VRAM cap (set_per_process_memory_fraction)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10, help="steps trained; the first two are not timed")
    ap.add_argument("--rank", type=int, default=None, help="LoRA rank (default: the largest the memory model fits)")
    ap.add_argument("--checkpointing", default=None, help="True/offload/auto... (default: the fitted plan)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--decode-tokens", type=int, default=0)
    ap.add_argument("--matvec-config", default=None,
                    help="BLOCK_N,blocks a step,warps for the decode matvec of 2-bit and ternary bases (the sweep's pick; "
                         "default: the library's low_bit_matvec.CONFIG)")
    args = ap.parse_args()
    if args.format == "nf4" and args.source != "checkpoint":
        ap.error("--format nf4 needs --source checkpoint (NF4 is quantised from 16-bit weights on load)")
    if args.matvec_config:  # swapped for this run, as benchmarks/low_bit_matvec.py does; nothing is written back
        from notebookkit.kernels import low_bit_matvec

        low_bit_matvec.CONFIG = tuple(int(v) for v in args.matvec_config.split(","))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = torch.bfloat16 if device == "cuda" else torch.float32

    config = model_config(args.shape)
    fit = fit_rank(config, args.format, args.cap_gib, args.seq, args.batch, args.rank or 256)
    if not fit.fits and args.rank is None:
        print(f"RESULT {json.dumps(dict(shape=args.shape, format=args.format, fits=False, why=str(fit)))}")
        return
    rank = args.rank or fit.rank
    offload_embedding = fit.offload_embedding if fit.fits else False
    print(fit, flush=True)

    t0 = time.time()
    model = build_model(args, config, device, offload_embedding)
    build_s = time.time() - t0
    print(f"base built or loaded in {build_s:.1f} s", flush=True)  # progress lines: a row cut by a timeout says where
    if device == "cuda":
        torch.cuda.empty_cache()
        if args.cap_gib:
            cap_gpu_memory(args.cap_gib)
        torch.cuda.reset_peak_memory_stats()
    base_gib = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else None

    from notebookkit import FastLanguageModel

    plan = args.checkpointing
    if plan is None:
        plan = list(fit.plan.modes) if fit.fits and device == "cuda" else False
    elif plan.lower() in ("true", "false"):
        plan = plan.lower() == "true"
    model = FastLanguageModel.get_peft_model(model, r=rank, lora_alpha=rank, lora_dropout=0.0, bias="none",
                                             target_modules=TARGETS, use_gradient_checkpointing=False,
                                             random_state=3407, show_banner=False)
    if plan is not False:
        FastLanguageModel.for_training(model, plan)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, fused=device == "cuda")
    batches = token_batches(args.shape, args.batch, args.seq, args.steps, device=device)
    step = training_step(model, optimizer)
    warm = min(2, args.steps - 1)
    losses = []
    for ids in batches[:warm]:
        losses.append(step(ids).item())
        print(f"warm-up step {len(losses)}: loss {losses[-1]:.4f}, {time.time() - t0:.1f} s since the start", flush=True)
    marks = []
    if device == "cuda":
        torch.cuda.synchronize()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps - warm + 1)]
        marks[0].record()
    start = time.time()
    for i, ids in enumerate(batches[warm:]):
        losses.append(step(ids))
        if marks:
            marks[i + 1].record()
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.time() - start
    step_s = [round(a.elapsed_time(b) / 1000, 4) for a, b in zip(marks, marks[1:])] or [elapsed / (args.steps - warm)]
    losses = [round(float(x), 4) for x in losses]
    tokens = args.batch * args.seq
    result = dict(
        shape=args.shape, format=args.format, source=args.source, cap_gib=args.cap_gib, seq=args.seq,
        batch=args.batch, rank=rank, fitted_rank=fit.rank, offload_embedding=offload_embedding,
        plan=plan_counts(model) if plan is not False else "all keep", build_s=round(build_s, 1),
        tok_s=round(tokens * (args.steps - warm) / elapsed, 1),
        tok_s_median=round(tokens / sorted(step_s)[len(step_s) // 2], 1), step_s=step_s,
        base_gib=round(base_gib, 3) if base_gib is not None else None,
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3) if device == "cuda" else None,
        reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 3) if device == "cuda" else None,
        predicted_gib=predicted_peak(args.shape, args.format, args.seq, args.batch, model),
        fit=str(fit), trainable=sum(p.numel() for p in params),
        loss_first=losses[0], loss_last=losses[-1], losses=losses, lr=args.lr,
        gpu=torch.cuda.get_device_name(0) if device == "cuda" else "cpu", versions=versions("notebookkit"),
    )
    if args.decode_tokens:
        result["decode"] = decode_tok_s(model, args.decode_tokens, device)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
