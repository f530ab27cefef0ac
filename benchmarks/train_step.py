"""Time LoRA / QLoRA training steps of one system on one model shape, in this process.

One configuration per process, so that one system's allocator state, patches or compiled
graphs cannot leak into another's numbers. `benchmarks/run.py` starts one process per row.

Systems (``--system``):

* ``hf``        transformers + PEFT with gradient checkpointing, as most notebooks run it
                (``prepare_model_for_kbit_training`` for 4-bit).
* ``compile``   the same, with ``torch.compile`` on each decoder layer.
* ``liger``     ``hf`` plus Liger-Kernel's patches (needs its wheel).
* ``unsloth``   Unsloth's FastLanguageModel with its offloaded checkpointing (needs its wheels).
* ``notebookkit`` our FastLanguageModel, ``use_gradient_checkpointing`` from ``--checkpointing``
                (default ``"auto"``: the memory planner decides).

Every system trains on the same learnable token stream (``learning_check.cycle_stream``: rows
walking a fixed cycle of 32 token ids; the runs of record up to session 9 used uniformly random
tokens): the kernels' work
does not depend on token values, so the timing is that of random tokens, but the loss now falls
several percent within the run, so a system whose adapters do not update shows it.

Prints one line ``RESULT {json}`` with tokens/s over the timed steps, peak allocated and reserved
VRAM, every step's loss, and the LoRA matrices' summary (``--save-lora-b`` also writes the final
``lora_B`` matrices, i.e. the adapters' update, for ``run.py`` to compare with HF+PEFT's).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

if "--system" in sys.argv and sys.argv[sys.argv.index("--system") + 1] == "unsloth":
    import unsloth  # noqa: F401  (Unsloth must be imported before transformers)

import torch
from gpu_monitor import GpuSampler  # this folder is on sys.path: run as a script, or by run.py / profile_step.py
from host_waits import HostWaits
from learning_check import cycle_stream, lora_snapshot

SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
    ),
    "llama-3.1-70b": dict(  # only built in a packed low-bit format (low_bit_step.py): 140 GB in bf16
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True,
    ),
    "gemma-2-2b": dict(
        model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=8192, tie_word_embeddings=True,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
        sliding_window=4096,
    ),
}
# Not a benchmark row: a small Llama for checking the scripts on a CPU (fp8_quality.py --tiny). Weights
# of std 0.1, not 0.02: with the frozen, tied embedding the largest logit a LoRA can reach is about
# |embedding row| * sqrt(hidden) = std * hidden, 2.6 at std 0.02 (the loss could not fall below ~5.7).
SHAPES["llama-tiny"] = dict(
    model_type="llama", vocab_size=4096, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=2048,
    tie_word_embeddings=True, initializer_range=0.1,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STREAM_SYMBOLS = 32  # token ids in the learnable cycle (learning_check.cycle_stream)


def checkpoint_dir(shape: str, layers: int | None = None) -> str:
    root = os.environ.get("NOTEBOOKKIT_BENCH_CKPT", os.path.expanduser("~/.cache/notebookkit/bench"))
    return os.path.join(root, shape if layers is None else f"{shape}-{layers}-layers")


def build_checkpoint(shape: str, layers: int | None = None) -> str:
    """Save a random-weight bf16 checkpoint of ``shape`` (once) with a byte-level tokenizer;
    ``layers`` keeps only that many decoder layers (same widths)."""
    from transformers import AutoConfig

    folder = checkpoint_dir(shape, layers)
    if os.path.exists(os.path.join(folder, "done")):
        return folder
    spec = dict(SHAPES[shape])
    model_type = spec.pop("model_type")
    if layers is not None:
        spec["num_hidden_layers"] = layers
    config = AutoConfig.for_model(model_type, bos_token_id=1, eos_token_id=2, pad_token_id=0, **spec)
    return save_random_checkpoint(config, folder)


def save_random_checkpoint(config, folder: str) -> str:
    """Save a random-weight bf16 model of ``config`` (seed 0, built on the GPU when there is one) and a byte-level
    tokenizer into ``folder``, then mark it done; returns ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(folder)
    open(os.path.join(folder, "done"), "w").close()
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return folder


def token_batches(shape: str, batch: int, seq: int, n: int, device: str = "cuda") -> list[torch.Tensor]:
    """The ``n`` batches every system trains on: the learnable cycle stream of ``learning_check``."""
    return cycle_stream(n, batch, seq, SHAPES[shape]["vocab_size"], symbols=STREAM_SYMBOLS, seed=0, device=device)


def load_peers(system: str, folder: str, quant: str, dtype: torch.dtype = torch.bfloat16):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if system == "liger":
        from liger_kernel.transformers import AutoLigerKernelForCausalLM  # noqa: F401
        from liger_kernel.transformers import _apply_liger_kernel

        cfg = json.load(open(os.path.join(folder, "config.json")))
        _apply_liger_kernel(cfg["model_type"])
    kwargs = dict(dtype=dtype, device_map={"": 0}, attn_implementation="sdpa")
    if quant == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    if quant == "nf4":
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    torch.manual_seed(3407)  # the LoRA A initialisation notebookkit gives with random_state=3407 (same seed, then PEFT)
    model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, bias="none", target_modules=TARGETS, task_type="CAUSAL_LM")
    )
    if system == "compile":
        for layer in model.base_model.model.model.layers:
            layer.compile()
    return model


def load_unsloth(folder: str, quant: str, seq: int, dtype: torch.dtype = torch.bfloat16):
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(
        model_name=folder, max_seq_length=seq, dtype=dtype, load_in_4bit=(quant == "nf4")
    )
    return FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=16, lora_dropout=0, bias="none", target_modules=TARGETS,
        use_gradient_checkpointing="unsloth", random_state=3407,
    )


def load_notebookkit(folder: str, quant: str, seq: int, batch: int, checkpointing: str, max_memory: str | None = None,
                     fp8: bool = False, offload_embedding: bool = False, park_fraction: str | None = None,
                     dtype: torch.dtype = torch.bfloat16, spread: bool = False):
    from notebookkit import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(
        folder, max_seq_length=seq, dtype=dtype, load_in_4bit=(quant == "nf4"),
        offload_embedding=offload_embedding,
    )
    gc_mode: object = {"true": True, "false": False}.get(checkpointing, checkpointing)
    model = FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=16, lora_dropout=0.0, bias="none", target_modules=TARGETS,
        use_gradient_checkpointing=gc_mode, random_state=3407, planning_batch_size=batch, max_memory=max_memory,
        fp8_base_matmul=fp8,
    )
    if spread:
        spread_offloaded_layers(model, batch, seq, max_memory)
    if park_fraction is not None:
        park_offloaded_layers(model, park_fraction, batch, seq)
    return model


def spread_offloaded_layers(model, batch: int, seq: int, max_memory: str | None) -> None:
    """Plan again as ``"auto"`` did, with the planner's ``layout="spread"`` (its offloaded layers among the kept
    ones, the share of them parked that the host link carries so: ``notebookkit.memory.planner``)."""
    from notebookkit.models.patching.checkpointing import apply_checkpointing, auto_plan

    modes, why, _ = auto_plan(model.get_base_model(), seq, batch, max_memory, padded=batch > 1, layout="spread")
    apply_checkpointing(model, modes)
    print(f"spread: {plan_counts(model)} ({why})", flush=True)


def park_offloaded_layers(model, fraction: str, batch: int, seq: int) -> None:
    """Park a share of the offloaded layers (``"offload_mlp"``: their MLPs' gate/up outputs in host memory), spread
    as the planner spreads them, whatever the plan parked before: ``fraction`` a number, or ``"card"`` for the
    planner's own share on this GPU (``notebookkit.memory.planner.parked_mlp_fraction``)."""
    from notebookkit.memory.cards import detect_card
    from notebookkit.memory.estimate import estimate_kwargs_from_model
    from notebookkit.memory.model_setup import recorded_activation_plan
    from notebookkit.memory.planner import park_offloaded_mlps, parked_mlp_fraction
    from notebookkit.memory.shapes import model_shape
    from notebookkit.models.patching.checkpointing import apply_checkpointing

    base = model.get_base_model()
    modes = recorded_activation_plan(base)
    if fraction == "card":
        kw = dict(estimate_kwargs_from_model(model), batch_size=batch, seq_len=seq)
        share = parked_mlp_fraction(model_shape(model.config), kw, detect_card())[0]
    else:
        share = float(fraction)
    unparked = tuple("offload" if m == "offload_mlp" else m for m in modes)
    apply_checkpointing(model, list(park_offloaded_mlps(unparked, share)))
    print(f"parked {share:.2f} of the offloaded layers: {plan_counts(model)}", flush=True)


def predicted_peak(shape: str, quant: str, seq: int, batch: int, model) -> float | None:
    """Our memory model's prediction (GiB) for this row, or None when it cannot say."""
    try:
        from notebookkit.memory.estimate import estimate_kwargs_from_model, estimate_training_memory

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        plan = getattr(base, "_notebookkit_checkpointing", "recompute")  # per-layer modes the model runs
        plan = "keep" if plan == "none" else plan
        estimate = estimate_training_memory(
            model.config, **estimate_kwargs_from_model(model), batch_size=batch, seq_len=seq, activation_plan=plan
        )
        return round(estimate.peak_allocated / 2**30, 2)
    except Exception as exc:  # the prediction is informative, never fatal to a benchmark row
        print(f"(no memory prediction: {exc})", file=sys.stderr)
        return None


def versions(system: str) -> dict[str, str]:
    """Versions of the packages this row ran with."""
    from importlib.metadata import PackageNotFoundError, version

    names = ["torch", "triton", "transformers", "peft", "bitsandbytes"]
    names += {"liger": ["liger-kernel"], "unsloth": ["unsloth", "unsloth_zoo"]}.get(system, [])
    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def plan_counts(model) -> str:
    """'32 keep' / '2 recompute, 30 offload': the per-layer activation plan the model runs."""
    from notebookkit.memory.model_setup import recorded_activation_plan
    from notebookkit.models.patching.checkpointing import plan_counts as count_modes

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modes = recorded_activation_plan(base) or "none"
    if modes == "none":
        return "all keep"
    return modes if isinstance(modes, str) else count_modes(modes)


def training_step(model, optimizer, scaler=None):
    """The step every benchmark times: forward with labels, backward, optimizer step, ``zero_grad``.

    The returned function takes the token ids and returns the loss as a device tensor (reading it on
    the host would wait for the GPU). With ``scaler`` (a ``torch.amp.GradScaler``: fp16, a T4's precision)
    the step is what ``Trainer(fp16=True)`` runs: the forward under fp16 autocast, the scaled loss's
    backward, ``scaler.step`` (which skips a step whose gradients overflowed: it reads the overflow flag on
    the host, so an fp16 step waits for the GPU once, in every system alike) and ``scaler.update``; the scale
    after each step goes to ``step.scales`` (a fall marks a skipped step).
    """

    def step(ids: torch.Tensor) -> torch.Tensor:
        if scaler is None:
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            optimizer.step()
        else:
            with torch.autocast(ids.device.type, dtype=torch.float16):
                out = model(input_ids=ids, labels=ids)
            scaler.scale(out.loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step.scales.append(scaler.get_scale())  # a host read, as scaler.step's own overflow check is
        optimizer.zero_grad(set_to_none=True)
        return out.loss.detach()

    step.scales = []
    return step


def cap_gpu_memory(gib: float) -> None:
    """Cap PyTorch's caching allocator at ``gib`` GiB of this card (``set_per_process_memory_fraction``): a smaller
    card emulated (15 GiB: a T4), which notebookkit's planner reads as its budget."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))


def skipped_flags(scales: list) -> list[bool]:
    """Per step, whether the loss scaler skipped it: ``scales`` are the scales after each step (from
    ``INITIAL_SCALE``), and an overflow halves the scale (``GradScaler``'s backoff)."""
    values = [float(x) for x in scales]
    return [after < before for before, after in zip([INITIAL_SCALE] + values, values)]


def skipped_steps(scales: list) -> int:
    """Steps the loss scaler skipped (:func:`skipped_flags`)."""
    return sum(skipped_flags(scales))


INITIAL_SCALE = 65536.0  # torch.amp.GradScaler's default init_scale


def host_anon_peak_gib(host) -> float:
    """The run's peak anonymous host memory so far (``meters.process_memory``: what a T4 session cannot page out;
    memory-mapped checkpoint pages count in the resident peak only)."""
    host.sample()
    return round(host.peak_anon / 2**30, 3)


def host_rss_peak_gib() -> float:
    """This process's peak resident host memory (a T4 session has about 12.7 GB of it)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)  # KiB -> GiB (Linux)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", required=True, choices=["hf", "compile", "liger", "unsloth", "notebookkit"])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--quant", default="nf4", choices=["nf4", "bf16"])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--checkpointing", default="auto")
    ap.add_argument("--max-memory", default=None, help='notebookkit: VRAM cap for the "auto" plan, e.g. 10GiB')
    ap.add_argument("--memory-cap-gib", type=float, default=None,
                    help="enforce a VRAM cap (max-context search; 15 with --dtype float16 emulates a T4)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                    help="compute dtype; float16 (a T4's) trains under autocast and a GradScaler, as Trainer(fp16=True)")
    ap.add_argument("--fp8", action="store_true", help="notebookkit: FP8 forward for the frozen base GEMMs")
    ap.add_argument("--offload-embedding", action="store_true",
                    help="notebookkit: the input embedding table in pinned host memory (untied models)")
    ap.add_argument("--park-fraction", default=None,
                    help='notebookkit: this share of the offloaded layers parks its MLP outputs ("offload_mlp"); '
                         '"card": the planner\'s share for this GPU')
    ap.add_argument("--spread", action="store_true",
                    help='notebookkit: plan "auto" with the planner\'s layout="spread" (offloaded layers among kept ones)')
    ap.add_argument("--expandable-segments", action="store_true",
                    help="the caching allocator grows segments in place (PyTorch's expandable_segments; Unsloth sets it"
                         " on import), so reserved memory stays near the allocated peak")
    ap.add_argument("--no-gc", action="store_true",
                    help="Python's cyclic garbage collector off during the timed steps (gc.freeze after the"
                         " warm-up, then gc.disable): does a collection's pause idle the GPU?")
    ap.add_argument("--prepare", action="store_true", help="only build the checkpoint")
    ap.add_argument("--save-lora-b", default=None, help="write the final lora_B matrices (the update) to this .pt file")
    args = ap.parse_args()
    from notebookkit.memory.meters import HostMemorySampler

    host = HostMemorySampler().__enter__()  # host RAM over the whole run (a T4 session has about 12.7 GB)

    folder = build_checkpoint(args.shape)
    if args.prepare:
        print("prepared", folder)
        return
    if args.expandable_segments:  # before the first CUDA allocation: later segments only would expand
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    if args.memory_cap_gib:
        cap_gpu_memory(args.memory_cap_gib)

    torch.cuda.reset_peak_memory_stats()
    dtype = getattr(torch, args.dtype)
    t0 = time.time()
    if args.system == "unsloth":
        model = load_unsloth(folder, args.quant, args.seq, dtype)
    elif args.system == "notebookkit":
        model = load_notebookkit(folder, args.quant, args.seq, args.batch, args.checkpointing, args.max_memory, args.fp8,
                                 args.offload_embedding, args.park_fraction, dtype, args.spread)
    else:
        model = load_peers(args.system, folder, args.quant, dtype)
    load_s = time.time() - t0
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4, fused=True)
    # a fingerprint of the LoRA A initialisation: rows with equal sums started from the same adapters
    lora_a_init_sum = sum(float(p.detach().double().sum()) for n, p in model.named_parameters() if "lora_A" in n)
    batches = token_batches(args.shape, args.batch, args.seq, args.warmup + args.steps)

    scaler = torch.amp.GradScaler("cuda", init_scale=INITIAL_SCALE) if args.dtype == "float16" else None
    step = training_step(model, optimizer, scaler)
    losses = [step(ids).item() for ids in batches[: args.warmup]]
    torch.cuda.synchronize()
    # CUDA events between timed steps (no host sync inside the window): per-step times, whose median
    # shows a one-off stall (a JIT compile, a first cuBLAS call) that the mean over the window hides.
    # host_enqueue_s: when the CPU had queued every timed step; far below the window, the CPU ran
    # ahead of the GPU; close to it, the GPU waited for the host (launch overhead or host syncs).
    # step_host: each timed step's host time, its host waits on the GPU and its garbage collections (host_waits).
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    if args.no_gc:
        gc.collect()
        gc.freeze()
        gc.disable()
    with GpuSampler.for_device(0) as sampler, HostWaits() as waits:
        start = time.time()
        marks[0].record()
        for i, ids in enumerate(batches[args.warmup :]):
            with waits.step():
                losses.append(step(ids))
            marks[i + 1].record()
        host_enqueue_s = time.time() - start
        torch.cuda.synchronize()
        elapsed = time.time() - start
    if args.no_gc:
        gc.enable()
    step_s = [round(a.elapsed_time(b) / 1000, 4) for a, b in zip(marks, marks[1:])]
    tokens = args.batch * args.seq * args.steps
    losses = [round(float(x), 5) for x in losses]
    lora_b = lora_snapshot(model, ("lora_B",))
    if args.save_lora_b:
        torch.save(lora_b, args.save_lora_b)
    result = dict(
        system=args.system, shape=args.shape, quant=args.quant, seq=args.seq, batch=args.batch, dtype=args.dtype,
        skipped_steps=skipped_steps(step.scales) if scaler is not None else None, host_rss_peak_gib=host_rss_peak_gib(),
        host_anon_peak_gib=host_anon_peak_gib(host),
        checkpointing=args.checkpointing if args.system == "notebookkit" else None,
        plan=plan_counts(model) if args.system == "notebookkit" else None,
        max_memory=args.max_memory, memory_cap_gib=args.memory_cap_gib,
        tok_s=round(tokens / elapsed, 1), s_step=round(elapsed / args.steps, 4), step_s=step_s,
        host_enqueue_s=round(host_enqueue_s, 4), gpu_clocks=sampler.summary(), step_host=waits.steps, no_gc=args.no_gc,
        tok_s_median=round(args.batch * args.seq / sorted(step_s)[len(step_s) // 2], 1),
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
        reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 3),
        predicted_gib=predicted_peak(args.shape, args.quant, args.seq, args.batch, model) if args.system == "notebookkit" else None,
        trainable=sum(p.numel() for p in params), load_s=round(load_s, 1),
        loss_first=losses[0], loss_last=losses[-1], losses=losses, token_stream=f"cycle of {STREAM_SYMBOLS} ids",
        lora_b_norm=round(sum(float(t.double().norm() ** 2) for t in lora_b.values()) ** 0.5, 6),
        lora_a_init_sum=round(lora_a_init_sum, 6),
        gpu=torch.cuda.get_device_name(0), torch=torch.__version__, versions=versions(args.system),
    )
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
