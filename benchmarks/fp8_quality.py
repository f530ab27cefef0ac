"""FP8 forward quality: the 16-bit and the FP8-forward LoRA paths trained on one learnable stream.

    python benchmarks/fp8_quality.py --out benchmarks/results/fp8-quality        # GPU: Llama-3.2-1B shape, bf16
    python benchmarks/fp8_quality.py --nf4 --out benchmarks/results/fp8-quality  # the same on an NF4 base
    python benchmarks/fp8_quality.py --tiny --device cpu --out /tmp/fp8-quality  # CPU: checks this script

Both runs start from the same random-weight checkpoint, the same LoRA initialisation
(``random_state=3407``) and see the same batches (``learning_check.cycle_stream``: rows walking a
fixed cycle of ``--symbols`` token ids), with the same AdamW; the only difference is
``get_peft_model(fp8_base_matmul=True)``, which runs the frozen base GEMMs of the forward pass and of
the checkpointing recompute in FP8 e4m3. On a CPU the FP8 product is emulated in fp32 (the same
quantised numbers, no speed-up; ``notebookkit.kernels.fp8_matmul.fp8_supported``), so ``--tiny
--device cpu`` runs every line of this script; the numbers that matter come from the GPU.

The 16-bit run trains until its loss (mean of the last ``window`` steps) is at most half the first
step's, then for half as many steps again (at most ``--max-steps``); the FP8 run, and a second 16-bit
run with another LoRA seed (the spread of curves that should not matter, for reference), train for
the same number of steps.

Verdict (exit status 1 when a check fails, 2 when the 16-bit run did not learn enough to compare):

* the 16-bit and the FP8 loss both fall by at least half (last ``window`` steps against the first);
* the FP8 curve tracks the 16-bit one: ``|l_fp8 - l_16| <= MAX_GAP`` (5%) of the first loss at every
  step, ``<= MEAN_GAP`` (2%) on average. The FP8 forward's products are about 3.5% off per element
  (``tests/kernels/test_fp8_matmul.py``); one step's loss was within 1% of 16-bit on every family
  (``tests/models/test_fp8_forward.py``). An FP8 run whose adapters never update stays at the first
  loss, 50% or more away;
* it reaches half the first loss at most ``max(3, 10%)`` steps after the 16-bit run;
* the first step's ``lora_B`` gradients (``lora_A``'s are zero while ``B`` is) have cosine >= 0.95
  with the 16-bit ones (0.994 over all LoRA gradients on a tiny model).

Writes ``<out>/fp8-quality[-<tag>].json`` (settings, versions, every loss, metrics, verdict),
``.png`` (both curves and their gap) and ``.md`` (a table of the curves at a few steps, the
metrics, the verdict).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402

from learning_check import cycle_stream, update_difference  # noqa: E402

MAX_GAP = 0.05  # of the first loss, at any step
MEAN_GAP = 0.02  # of the first loss, averaged over the run
MIN_FALL = 0.5  # both curves fall by at least half
MIN_GRAD_COSINE = 0.95  # first step's lora_B gradients, FP8 against 16-bit


@dataclass
class Settings:
    """One comparison: the model, the stream and the optimisation (defaults: the GPU run)."""

    shape: str = "llama-3.2-1b"
    layers: int | None = None  # None: the shape's own depth
    nf4: bool = False
    device: str = "cuda"
    batch: int = 2
    seq: int = 1024
    # 16 ids: learning which ids occur is enough to halve the loss. With frozen embeddings of std 0.02
    # (a tied 2048-wide LM head) the largest logit margin a LoRA can give the S ids together is about
    # 40 / sqrt(S) nats: 10 for S = 16 (loss near ln 16 + 0.4 = 3.2 of 12.2), 5 for S = 64 (about 7.2).
    symbols: int = 16
    lr: float = 2e-4
    max_steps: int = 600
    window: int = 10
    checkpointing: str = "true"  # "true" (recompute: the FP8 recompute path runs too), "false", "offload"
    seed: int = 3407
    reseed: bool = True
    extra: dict = field(default_factory=dict)


TINY = dict(shape="llama-tiny", device="cpu", batch=2, seq=64, symbols=8, lr=3e-3, max_steps=120, window=3,
            checkpointing="false")


@dataclass
class PathRun:
    """One training run: every step's loss and the first step's lora_B gradients."""

    name: str
    losses: list[float]
    first_grads: dict
    seconds: float


def make_optimizer(params: list[torch.nn.Parameter], lr: float, device: str) -> torch.optim.Optimizer:
    """AdamW as in the benchmarks (fused on CUDA)."""
    return torch.optim.AdamW(params, lr=lr, fused=device.startswith("cuda"))


def load_path(folder: str, s: Settings, fp8: bool, seed: int):
    """The LoRA model of one path (notebookkit's fast path; FP8 forward on or off)."""
    from notebookkit import FastLanguageModel

    dtype = torch.bfloat16 if s.device.startswith("cuda") else torch.float32
    model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=s.seq, dtype=dtype, load_in_4bit=s.nf4,
                                                 show_banner=False)
    gc_mode: object = {"true": True, "false": False}.get(s.checkpointing, s.checkpointing)
    return FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
                                            use_gradient_checkpointing=gc_mode, random_state=seed,
                                            fp8_base_matmul=fp8, show_banner=False)


def steps_to_half(losses: list[float], window: int) -> int | None:
    """First step after which the mean of the last ``window`` losses is at most half the first loss."""
    for t in range(window, len(losses) + 1):
        if sum(losses[t - window:t]) / window <= 0.5 * losses[0]:
            return t
    return None


def train_path(folder: str, s: Settings, batches: list[torch.Tensor], fp8: bool, seed: int,
               steps: int | None) -> PathRun:
    """Train one path; ``steps=None``: until the loss halves, then half as many steps again (at most
    ``s.max_steps``)."""
    model = load_path(folder, s, fp8, seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, s.lr, s.device)
    losses: list[float] = []
    first_grads: dict = {}
    stop = steps or s.max_steps
    name = ("FP8 forward" if fp8 else "16-bit") + ("" if seed == s.seed else f" (LoRA seed {seed})")
    started = time.time()
    t = 0
    while t < stop:
        if t % 25 == 0 and t:
            print(f"[{name}] step {t}: loss {losses[-1]:.4f} ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
        ids = batches[t % len(batches)]
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        if t == 0:
            first_grads = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()
                           if "lora_B" in n and p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
        t += 1
        if steps is None and stop == s.max_steps:
            half = steps_to_half(losses, s.window)
            if half is not None:
                stop = min(s.max_steps, half + max(half // 2, s.window))
    run = PathRun(name, losses, first_grads, round(time.time() - started, 1))
    del model, optimizer
    if s.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return run


def compare_curves(l16: list[float], l8: list[float], window: int) -> dict:
    """Gaps between two loss curves of the same length, in fractions of the 16-bit run's first loss."""
    if len(l16) != len(l8) or len(l16) < 2 * window:
        raise ValueError(f"need two curves of the same length >= {2 * window}; got {len(l16)} and {len(l8)}.")
    first = l16[0]
    gaps = [abs(a - b) / first if math.isfinite(a) and math.isfinite(b) else math.inf for a, b in zip(l8, l16)]
    fall = lambda ls: 1.0 - (sum(ls[-window:]) / window) / ls[0]  # noqa: E731
    return dict(
        steps=len(l16), first_loss_16=l16[0], first_loss_fp8=l8[0],
        last_loss_16=sum(l16[-window:]) / window, last_loss_fp8=sum(l8[-window:]) / window,
        fall_16=fall(l16), fall_fp8=fall(l8),
        max_gap=max(gaps), mean_gap=sum(gaps) / len(gaps), worst_step=gaps.index(max(gaps)),
        half_at_16=steps_to_half(l16, window), half_at_fp8=steps_to_half(l8, window),
    )


def verdict(m: dict) -> list[str]:
    """The failed checks (empty: FP8 tracks 16-bit). NaN fails every comparison."""
    problems = []
    if not m["fall_16"] >= MIN_FALL:
        problems.append(f"16-bit loss fell {m['fall_16']:.1%} (< {MIN_FALL:.0%}): nothing learned to compare; "
                        "raise --max-steps or --lr")
    if not m["fall_fp8"] >= MIN_FALL:
        problems.append(f"FP8 loss fell {m['fall_fp8']:.1%} (< {MIN_FALL:.0%})")
    if not m["max_gap"] <= MAX_GAP:
        problems.append(f"largest gap {m['max_gap']:.2%} of the first loss at step {m['worst_step']} (> {MAX_GAP:.0%})")
    if not m["mean_gap"] <= MEAN_GAP:
        problems.append(f"mean gap {m['mean_gap']:.2%} of the first loss (> {MEAN_GAP:.0%})")
    h16, h8 = m["half_at_16"], m["half_at_fp8"]
    if h16 is not None and (h8 is None or h8 - h16 > max(3, 0.1 * h16)):
        problems.append(f"FP8 reached half the first loss at step {h8}, 16-bit at {h16}")
    if not m.get("grad_cosine", math.nan) >= MIN_GRAD_COSINE:
        problems.append(f"first-step lora_B gradient cosine {m.get('grad_cosine', math.nan):.4f} (< {MIN_GRAD_COSINE})")
    return problems


def run(s: Settings) -> dict:
    """Build the checkpoint, train the paths, compare; the result dict written to the JSON."""
    import train_step

    folder = train_step.build_checkpoint(s.shape, s.layers)
    vocab = train_step.SHAPES[s.shape]["vocab_size"]
    batches = cycle_stream(64, s.batch, s.seq, vocab, symbols=s.symbols, seed=0, device=s.device)
    r16 = train_path(folder, s, batches, fp8=False, seed=s.seed, steps=None)
    steps = len(r16.losses)
    r8 = train_path(folder, s, batches, fp8=True, seed=s.seed, steps=steps)
    runs = [r16, r8]
    metrics = compare_curves(r16.losses, r8.losses, s.window)
    grads = update_difference(r8.first_grads, r16.first_grads)
    metrics |= dict(grad_cosine=grads["cosine"], grad_rel_err=grads["rel_err"])
    if s.reseed:
        again = train_path(folder, s, batches, fp8=False, seed=s.seed + 1, steps=steps)
        runs.append(again)
        reseeded = compare_curves(r16.losses, again.losses, s.window)
        metrics |= dict(reseed_max_gap=reseeded["max_gap"], reseed_mean_gap=reseeded["mean_gap"])
    problems = verdict(metrics)
    return dict(settings=asdict(s), environment=environment(s.device), metrics=metrics,
                runs=[dict(name=r.name, seconds=r.seconds, losses=[round(x, 5) for x in r.losses]) for r in runs],
                tolerances=dict(max_gap=MAX_GAP, mean_gap=MEAN_GAP, min_fall=MIN_FALL, min_grad_cosine=MIN_GRAD_COSINE),
                verdict="pass" if not problems else "FAIL", problems=problems)


def environment(device: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    env = dict(device=torch.cuda.get_device_name(0) if device.startswith("cuda") else f"CPU, {platform.machine()}",
               python=platform.python_version())
    for name in ("torch", "triton", "transformers", "peft", "bitsandbytes"):
        try:
            env[name] = version(name)
        except PackageNotFoundError:
            pass
    return env


def markdown(result: dict) -> str:
    s, m = result["settings"], result["metrics"]
    runs = {r["name"]: r["losses"] for r in result["runs"]}
    l16, l8 = runs["16-bit"], runs["FP8 forward"]
    again = next((v for k, v in runs.items() if "seed" in k), None)
    n = len(l16)
    layers = "" if s["layers"] is None else f" ({s['layers']} layers)"
    marks = sorted({0, 1, 2, 5, *range(0, n, max(1, n // 10)), n - 1} & set(range(n)))
    head = "| step | 16-bit | FP8 forward | gap (% of first loss) |" + (" 16-bit, other LoRA seed |" if again else "")
    lines = [
        f"# FP8 forward against 16-bit: loss curves on a learnable stream ({result['environment']['device']})",
        "",
        f"{s['shape']}{layers}, "
        f"{'NF4' if s['nf4'] else '16-bit'} base, LoRA r=16 on all seven projections, checkpointing "
        f"{s['checkpointing']}, batch {s['batch']} x {s['seq']} tokens, a cycle of {s['symbols']} token ids, "
        f"AdamW lr {s['lr']}, {n} steps. Versions: "
        + ", ".join(f"{k} {v}" for k, v in result["environment"].items() if k not in ("device",)) + ".",
        "",
        head,
        "|---|---|---|---|" + ("---|" if again else ""),
    ]
    for t in marks:
        row = f"| {t} | {l16[t]:.4f} | {l8[t]:.4f} | {abs(l8[t] - l16[t]) / l16[0]:.2%} |"
        lines.append(row + (f" {again[t]:.4f} |" if again else ""))
    tol = result["tolerances"]
    half16, half8 = m["half_at_16"], m["half_at_fp8"]
    lines += [
        "",
        "| measure | value | required |",
        "|---|---|---|",
        f"| loss fall, 16-bit (last {s['window']} steps vs first) | {m['fall_16']:.1%} | ≥ {tol['min_fall']:.0%} |",
        f"| loss fall, FP8 | {m['fall_fp8']:.1%} | ≥ {tol['min_fall']:.0%} |",
        f"| largest gap, % of first loss | {m['max_gap']:.2%} (step {m['worst_step']}) | ≤ {tol['max_gap']:.0%} |",
        f"| mean gap, % of first loss | {m['mean_gap']:.2%} | ≤ {tol['mean_gap']:.0%} |",
        f"| steps to half the first loss, 16-bit / FP8 | {half16} / {half8} | FP8 ≤ 16-bit + max(3, 10%) |",
        f"| first-step lora_B gradients, cosine (rel. err.) | {m['grad_cosine']:.4f} ({m['grad_rel_err']:.3f}) "
        f"| ≥ {tol['min_grad_cosine']} |",
    ]
    if "reseed_mean_gap" in m:
        lines.append(f"| for reference: 16-bit vs 16-bit with another LoRA seed, largest / mean gap | "
                     f"{m['reseed_max_gap']:.2%} / {m['reseed_mean_gap']:.2%} | – |")
    lines += ["", f"**Verdict: {result['verdict']}**" + ("" if not result["problems"] else ": " + "; ".join(result["problems"]))]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[3, 1])
    runs = {r["name"]: r["losses"] for r in result["runs"]}
    first = runs["16-bit"][0]
    styles = {"16-bit": dict(color="tab:blue"), "FP8 forward": dict(color="tab:orange", linestyle="--")}
    for name, losses in runs.items():
        ax1.plot(losses, label=name, linewidth=1.2, **styles.get(name, dict(color="tab:gray", linestyle=":")))
    ax1.axhline(0.5 * first, color="k", linewidth=0.6, linestyle=":", label="half the first loss")
    ax1.set_ylabel("training loss")
    ax1.legend()
    ax1.set_title(f"FP8 forward vs 16-bit, {result['settings']['shape']} ({result['environment']['device']}): "
                  f"{result['verdict']}", fontsize=10)
    gap = [100 * (b - a) / first for a, b in zip(runs["16-bit"], runs["FP8 forward"])]
    ax2.plot(gap, color="tab:red", linewidth=1.0)
    for bound in (MAX_GAP, -MAX_GAP):
        ax2.axhline(100 * bound, color="k", linewidth=0.6, linestyle=":")
    ax2.set_ylabel("FP8 − 16-bit\n(% of first loss)")
    ax2.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result: dict, out: str, tag: str = "") -> str:
    """Write the JSON, PNG and markdown; returns the stem."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, "fp8-quality" + (f"-{tag}" if tag else ""))
    with open(stem + ".json", "w") as fh:
        json.dump(result, fh, indent=1)
    with open(stem + ".md", "w") as fh:
        fh.write(markdown(result))
    plot(result, stem + ".png")
    return stem


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for fp8-quality[-tag].json / .png / .md")
    ap.add_argument("--tag", default="")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer Llama of width 128 (checks the script on a CPU)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--shape", default=None, help="a shape of benchmarks/train_step.py (default llama-3.2-1b)")
    ap.add_argument("--layers", type=int, default=None, help="keep only this many decoder layers")
    ap.add_argument("--nf4", action="store_true", help="NF4 base weights (QLoRA): the NF4 -> FP8 kernel path")
    for name in ("batch", "seq", "symbols", "max_steps", "window"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--checkpointing", default=None, choices=["true", "false", "offload"])
    ap.add_argument("--no-reseed", dest="reseed", action="store_false", help="skip the second 16-bit run")
    args = ap.parse_args(argv)
    values = dict(TINY) if args.tiny else {}
    values["device"] = args.device or values.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    for name in ("shape", "layers", "batch", "seq", "symbols", "max_steps", "window", "lr", "checkpointing"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    settings = Settings(nf4=args.nf4, reseed=args.reseed, **values)
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA GPU here: run with --tiny --device cpu to check the script on a CPU.", file=sys.stderr)
        return 2
    result = run(settings)
    stem = write(result, args.out, args.tag)
    print(markdown(result))
    print(f"wrote {stem}.json, .png, .md")
    if result["metrics"]["fall_16"] < MIN_FALL:
        return 2
    return 0 if result["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
