"""Where a training step spends its GPU time: a per-kernel breakdown from ``torch.profiler``.

Loads one system exactly as ``benchmarks/train_step.py`` does, runs four warm-up steps (timed one by
one), then profiles one step (forward with labels, backward, fused AdamW step, ``zero_grad``), or with
``--steps K`` K steps back to back as a training loop runs them, with CUDA activity only (no
shapes, no stacks). It writes
``<out>/profile-<shape>-<quant>-<seq>x<batch>-<system>[-tag].md`` (and the raw per-kernel totals as
``.json``) with:

* the step's wall time (profiled, and each warm-up step without the profiler),
* total GPU time (sum of kernel and copy durations), GPU busy time (the union of those intervals,
  so copies that overlap compute on a side stream count once) and the idle share ``1 - busy / wall``,
* the GPU busy time of a profiled step against the median unprofiled step: the profiler slows the host
  (so the idle share of a host-heavy step is partly its own) but hardly the kernels, so a share near
  100% says the unprofiled step is GPU-bound (session 32: the T4-emulation step, 26.5% idle under the
  profiler, was 98% busy without it),
* the idle gaps split into those where the GPU waited for the host (the work that ended the gap
  was launched only after the GPU had run dry: launch overhead, Python, host syncs) and the rest,
  from the launch records of the trace (:func:`idle_gaps`),
* a table of kernel categories (GEMM, attention, each Triton kernel family, bitsandbytes,
  memcpy per direction, optimizer, elementwise / reduction, ...) with ms and % of GPU time,
* the 25 kernels with the most total time, with their launch counts.

    python benchmarks/profile_step.py --system notebookkit --shape llama-3.1-8b --quant nf4 \\
        --seq 4096 --batch 2 [--checkpointing auto|offload|offload_mlp|true|false] [--max-memory 8GiB] --out DIR

``--dtype float16 --memory-cap-gib 15`` profiles the T4 emulation of ``train_step.py`` (fp16 autocast and a
GradScaler under a 15 GiB allocator cap, which "auto" plans for).

``--checkpointing`` and ``--max-memory`` (the budget the "auto" planner plans for; the allocator
itself is not capped) apply to ``notebookkit``; the peers use their own gradient checkpointing as
in ``train_step.py``. ``--trace`` also saves a Chrome trace (large).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Callable, Iterable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

SYSTEMS = ["hf", "compile", "liger", "unsloth", "notebookkit"]

# --------------------------------------------------------------------------- categories (pure)


def _has(*needles: str) -> Callable[[str], bool]:
    lowered = tuple(n.lower() for n in needles)
    return lambda name: any(n in name.lower() for n in lowered)


def _looks_like_triton(name: str) -> bool:
    """Triton kernels are named after their Python function: no C++ scope, template or signature."""
    return not any(mark in name for mark in ("::", "<", "(", " "))


def _triton(*needles: str) -> Callable[[str], bool]:
    match = _has(*needles)
    return lambda name: _looks_like_triton(name) and match(name)


_BITSANDBYTES = re.compile(r"^k(Dequantize|Quantize|gemm_4bit|Optimizer|Percentile|Histogram|spm|dequant)")
_SYNC_EVENTS = ("Context Sync", "Stream Sync", "Event Sync", "Stream Wait Event", "Device Synchronize")

# (category, test) in priority order: the first test that matches names the category.
CATEGORY_RULES: list[tuple[str, Callable[[str], bool]]] = [
    ("memcpy HtoD", lambda n: n.startswith("Memcpy HtoD")),
    ("memcpy DtoH", lambda n: n.startswith("Memcpy DtoH")),
    ("memcpy DtoD", lambda n: n.startswith("Memcpy DtoD")),
    ("memcpy other", lambda n: n.startswith("Memcpy")),
    ("memset", lambda n: n.startswith("Memset")),
    ("bitsandbytes", lambda n: bool(_BITSANDBYTES.match(n)) or "bitsandbytes" in n.lower()),
    ("optimizer (AdamW)", _has("multi_tensor_apply", "fusedadam", "fused_adam", "adamw")),
    ("attention", _has("flash", "fmha", "efficient_attention", "sdpa", "attention", "attn")),
    ("triton rms_norm", _triton("rms_norm", "rmsnorm", "rms_layernorm")),
    ("triton rope", _triton("rope", "rotary")),
    ("triton swiglu", _triton("swiglu", "_fg_kernel", "dwf_dw_dfg")),
    ("triton geglu", _triton("geglu", "_exact_forward", "_exact_backward", "_approx_forward", "_approx_backward")),
    ("triton nf4 dequant", _triton("nf4", "dequant")),
    ("triton cross_entropy", _triton("cross_entropy", "crossentropy", "_flce")),
    ("triton lora", _triton("lora")),
    ("inductor (torch.compile)", lambda n: n.startswith(("triton_poi", "triton_red", "triton_per", "triton_tem"))),
    ("GEMM", _has("gemm", "gemv", "cutlass", "cublas", "nvjet", "xmma", "wgmma", "ampere_", "sm80_", "sm90_",
                  "sm100_", "turing_", "volta_", "splitkreduce", "matmul")),
    ("torch log_softmax / nll", _has("softmax", "nll_loss", "cross_entropy")),
    ("elementwise / reduction", _has("elementwise", "reduce", "index", "scatter", "gather", "catarray", "fill",
                                     "copy", "embedding", "norm", "foreach", "where", "sort", "distribution",
                                     "at::native")),
    ("other Triton-style name", _looks_like_triton),
]


def categorize(kernel_name: str) -> str:
    """The category of a GPU kernel or copy, by its name (``"other"`` when no rule matches).

    Never raises: a name it cannot handle is ``"other"``.
    """
    if not isinstance(kernel_name, str) or not kernel_name.strip():
        return "other"
    try:
        name = kernel_name.strip()
        if name.startswith("void "):
            name = name[len("void "):]
        for category, test in CATEGORY_RULES:
            if test(name):
                return category
    except Exception:  # noqa: BLE001 - a report must not die on an odd name
        pass
    return "other"


# --------------------------------------------------------------------------- tables (pure)


def aggregate(kernels: Iterable[tuple[str, float, int]]) -> list[tuple[str, float, int]]:
    """Merge rows of the same name: ``(name, total_us, count)`` sorted by total time, longest first."""
    totals: dict[str, list[float]] = {}
    for name, total_us, count in kernels:
        entry = totals.setdefault(str(name), [0.0, 0])
        entry[0] += float(total_us)
        entry[1] += int(count)
    return sorted(((n, t, int(c)) for n, (t, c) in totals.items()), key=lambda r: -r[1])


def category_table(kernels: Iterable[tuple[str, float, int]]) -> list[dict]:
    """Per category: ``ms``, ``share`` of all GPU time (0..1), launch ``count``, largest first."""
    per_category: dict[str, list[float]] = {}
    for name, total_us, count in kernels:
        entry = per_category.setdefault(categorize(name), [0.0, 0])
        entry[0] += float(total_us)
        entry[1] += int(count)
    grand = sum(t for t, _ in per_category.values()) or 1.0
    rows = [dict(category=c, ms=t / 1e3, share=t / grand, count=int(n)) for c, (t, n) in per_category.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (overlapping streams count once)."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


# Chrome-trace categories of what runs on the GPU, and of the host-side CUDA API calls that queue it.
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def trace_device_and_launches(trace_events: Iterable[dict]) -> tuple[list[tuple[float, float, int]], dict[int, float]]:
    """From a Chrome trace's ``traceEvents``: ``(start_us, end_us, correlation)`` of every kernel, copy and
    memset, and ``{correlation: start_us}`` of the host API call (``cudaLaunchKernel``, ``cudaMemcpyAsync``, ...)
    that queued each of them."""
    device, launches = [], {}
    for e in trace_events:
        if e.get("ph") != "X":
            continue
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") in _DEVICE_CATS:
            start = float(e["ts"])
            device.append((start, start + float(e.get("dur", 0.0)), int(corr) if corr is not None else -1))
        elif e.get("cat") in _LAUNCH_CATS and corr is not None:
            launches[int(corr)] = float(e["ts"])
    return device, launches


def idle_gaps(device: Iterable[tuple[float, float, int]], launches: dict[int, float],
              min_gap_us: float = 5.0, launch_latency_us: float = 10.0) -> dict:
    """Split the GPU's idle time into gaps where it waited for the host and the rest.

    The busy time is the union of all device intervals (all streams). Each idle gap of at least
    ``min_gap_us`` ends when some work starts; if that work was queued by the host only after the
    gap began (its launch call started later than ``gap start - launch_latency_us``), the GPU had
    nothing queued and waited for the host ("host" gap). Otherwise the work was queued in time and
    waited on something else (a cross-stream event, a copy): an "other" gap. Work whose launch is
    unknown counts as "other". Returns ms totals and counts.
    """
    events = sorted(device)
    host_us = other_us = 0.0
    host_n = other_n = 0
    busy_end = None
    for start, end, corr in events:
        if busy_end is not None and start - busy_end >= min_gap_us:
            gap = start - busy_end
            launched = launches.get(corr)
            if launched is not None and launched > busy_end - launch_latency_us:
                host_us += gap
                host_n += 1
            else:
                other_us += gap
                other_n += 1
        busy_end = end if busy_end is None else max(busy_end, end)
    return dict(host_wait_ms=host_us / 1e3, host_gaps=host_n, other_idle_ms=other_us / 1e3, other_gaps=other_n)


def _cell(name: str, width: int = 110) -> str:
    short = name if len(name) <= width else name[: width - 1] + "…"
    return "`" + short.replace("`", "'").replace("|", "\\|") + "`"


def render_report(title: str, facts: Sequence[tuple[str, str]], wall_ms: float, busy_ms: float,
                  kernels: Iterable[tuple[str, float, int]], top: int = 25, gaps: dict | None = None,
                  steps: int = 1, unprofiled_ms: float | None = None, compute_busy_ms: float | None = None,
                  api: list[dict] | None = None) -> str:
    """The markdown report from a list of ``(kernel name, total_us, count)`` (``gaps``: :func:`idle_gaps`;
    ``api``: :func:`host_api_calls`, its eight largest listed).

    ``unprofiled_ms``: the median step without the profiler. The profiler slows the host (it records every
    launch) but hardly the GPU's kernels, so the GPU busy time of a profiled step against an unprofiled
    step says whether the unprofiled step is GPU-bound: near 100%, the idle share of the profiled steps is
    mostly the profiler's own host overhead, and launching less would not make the step faster.
    ``compute_busy_ms``: the union of the kernels and memsets alone (:func:`compute_intervals`); the busy time
    beyond it is time when only copies ran."""
    merged = aggregate(kernels)
    gpu_ms = sum(t for _, t, _ in merged) / 1e3
    idle = max(0.0, wall_ms - busy_ms)
    lines = [f"# {title}", ""]
    lines += [f"- {key}: {value}" for key, value in facts]
    lines += [
        f"- wall time of the profiled step(s): {wall_ms:.1f} ms",
        f"- GPU time (sum of kernel and copy durations): {gpu_ms:.1f} ms",
        f"- GPU busy (union over streams): {busy_ms:.1f} ms; idle: {idle:.1f} ms = "
        f"{(idle / wall_ms if wall_ms else 0):.1%} of the wall time",
    ]
    if compute_busy_ms is not None:
        lines.append(
            f"- compute busy (kernels and memsets, copies left out): {compute_busy_ms:.1f} ms; only copies ran for "
            f"{max(0.0, busy_ms - compute_busy_ms):.1f} ms of the busy time (the compute waited on the host link, or "
            "had nothing queued)"
        )
    if gaps is not None:
        lines.append(
            f"- idle gaps of 5 µs or more: {gaps['host_wait_ms']:.1f} ms in {gaps['host_gaps']} gaps waiting for the "
            f"host (the next work was queued only after the GPU ran dry), {gaps['other_idle_ms']:.1f} ms in "
            f"{gaps['other_gaps']} gaps with work queued (stream or event waits)"
        )
    if unprofiled_ms:
        busy_step = busy_ms / steps
        lines.append(
            f"- GPU busy per profiled step against the median step without the profiler: {busy_step:.1f} of "
            f"{unprofiled_ms:.1f} ms = {busy_step / unprofiled_ms:.0%} (near 100%: the unprofiled step is GPU-bound, "
            "and the idle time above is mostly the profiler's own host overhead)"
        )
    if api:
        total = sum(r["ms"] for r in api)
        lines += ["", f"Host time inside CUDA's API: {total:.1f} ms of the {wall_ms:.1f} ms wall time (the rest of a "
                      "host-bound step is Python and PyTorch's dispatch):", "",
                  "| API call | calls | ms | longest ms |", "|---|---:|---:|---:|"]
        lines += [f"| {_cell(r['name'], 60)} | {r['calls']} | {r['ms']:.2f} | {r['max_ms']:.2f} |" for r in api[:8]]
    lines += [
        "",
        "| category | ms | % of GPU time | launches |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {r['category']} | {r['ms']:.2f} | {r['share']:.1%} | {r['count']} |" for r in category_table(merged)]
    lines += ["", f"Top {top} kernels by total time:", "",
              "| # | kernel | category | ms | launches | % of GPU time |", "|---:|---|---|---:|---:|---:|"]
    for i, (name, total_us, count) in enumerate(merged[:top], 1):
        share = total_us / 1e3 / gpu_ms if gpu_ms else 0.0
        lines.append(f"| {i} | {_cell(name)} | {categorize(name)} | {total_us / 1e3:.2f} | {count} | {share:.1%} |")
    return "\n".join(lines) + "\n"


def report_name(shape: str, quant: str, seq: int, batch: int, system: str, tag: str = "") -> str:
    """``profile-<shape>-<quant>-<seq>x<batch>-<system>[-tag].md``"""
    return f"profile-{shape}-{quant}-{seq}x{batch}-{system}{('-' + tag) if tag else ''}.md"


# --------------------------------------------------------------------------- profiler events


def _is_device_event(evt) -> bool:
    device = getattr(evt, "device_type", None)
    kind = getattr(device, "name", str(device))
    if not str(kind).upper().endswith("CUDA") or getattr(evt, "is_user_annotation", False):
        return False
    return not str(getattr(evt, "name", "")).startswith(_SYNC_EVENTS)


def _interval(evt) -> tuple[float, float] | None:
    span = getattr(evt, "time_range", None)
    if span is not None:
        return float(span.start), float(span.end)
    return None


def compute_intervals(events) -> list[tuple[float, float]]:
    """The intervals of the device kernels and memsets, copies left out: their union is the time the GPU
    computed, and the busy time beyond it the time only copies ran (the compute waiting on the host link, or
    nothing queued but copies)."""
    spans = (_interval(evt) for evt in events
             if _is_device_event(evt) and not str(getattr(evt, "name", "")).startswith("Memcpy"))
    return [span for span in spans if span is not None]


def device_kernels(events) -> tuple[list[tuple[str, float, int]], list[tuple[float, float]]]:
    """From profiler events: ``(name, total_us, count)`` per device kernel / copy, and their intervals."""
    rows: list[tuple[str, float, int]] = []
    intervals: list[tuple[float, float]] = []
    for evt in events:
        if not _is_device_event(evt):
            continue
        span = _interval(evt)
        if span is not None:
            duration = span[1] - span[0]
            intervals.append(span)
        else:
            duration = float(getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0) or 0)
        rows.append((str(evt.name), duration, 1))
    return aggregate(rows), intervals


# --------------------------------------------------------------------------- GPU run


def load_system(args):
    """Load ``args.system`` the way ``benchmarks/train_step.py`` does; returns (model, plan note)."""
    import torch
    import train_step

    folder = train_step.build_checkpoint(args.shape)
    if args.memory_cap_gib:
        train_step.cap_gpu_memory(args.memory_cap_gib)
    dtype = getattr(torch, args.dtype)
    if args.system == "unsloth":
        return train_step.load_unsloth(folder, args.quant, args.seq, dtype), "unsloth offloaded checkpointing"
    if args.system != "notebookkit":
        return train_step.load_peers(args.system, folder, args.quant, dtype), "HF gradient checkpointing (all layers)"
    model = train_step.load_notebookkit(folder, args.quant, args.seq, args.batch, args.checkpointing, fp8=args.fp8,
                                        dtype=dtype, spread=args.spread)
    if args.max_memory:
        import inspect

        from notebookkit.models.patching.checkpointing import apply_checkpointing

        if "max_memory" not in inspect.signature(apply_checkpointing).parameters:
            raise SystemExit("--max-memory needs apply_checkpointing(..., max_memory=...), which this notebookkit lacks.")
        mode = {"true": True, "false": False}.get(args.checkpointing, args.checkpointing)
        apply_checkpointing(model, mode, None, batch_size=args.batch, seq_len=args.seq, max_memory=args.max_memory)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    plan = getattr(base, "_notebookkit_checkpointing", "?")
    if isinstance(plan, (list, tuple)):
        plan = train_step.plan_counts(model)
    return model, f"notebookkit --checkpointing {args.checkpointing}: {plan}"


def profile_steps(steps: Sequence[Callable[[], None]], with_cpu: bool = False):
    """Run ``steps`` back to back under the profiler (CUDA activity, plus CPU ops if asked), with no
    synchronisation between them, as a training loop runs; returns (profiler, wall ms of all)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if with_cpu else [ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with profile(activities=activities, record_shapes=False, with_stack=False,
                 profile_memory=False) as prof:
        started = time.perf_counter()
        for step in steps:
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - started) * 1e3
    return prof, wall_ms


def host_link_rates(trace_events: Iterable[dict], min_bytes: int = 1 << 20) -> dict[str, dict]:
    """Per copy direction (``"DtoH"``, ``"HtoD"``), from a Chrome trace's copies of at least ``min_bytes``: how many,
    GB moved, ms, and each copy's rate in GB/s (10th percentile, median, 90th). A host link that slows down now and
    then shows as a wide spread; offloaded checkpointing's copies run on a side stream, so the step waits on them
    only where the link falls behind the compute."""
    rates: dict[str, list[tuple[float, float]]] = {}
    for e in trace_events:
        name, args = str(e.get("name", "")), e.get("args") or {}
        if e.get("ph") != "X" or e.get("cat") != "gpu_memcpy" or int(args.get("bytes", 0)) < min_bytes:
            continue
        direction = next((d for d in ("DtoH", "HtoD") if d in name), None)
        if direction is not None and float(e.get("dur", 0.0)) > 0:
            rates.setdefault(direction, []).append((float(args["bytes"]), float(e["dur"])))
    out = {}
    for direction, copies in sorted(rates.items()):
        per_copy = sorted(b / (d * 1e3) for b, d in copies)  # bytes / µs / 1e3 = GB/s
        pick = lambda q: per_copy[min(len(per_copy) - 1, int(q * len(per_copy)))]  # noqa: E731
        out[direction] = dict(copies=len(copies), gb=sum(b for b, _ in copies) / 1e9,
                              ms=sum(d for _, d in copies) / 1e3, p10=pick(0.1), median=pick(0.5), p90=pick(0.9))
    return out


def host_api_calls(trace_events: Iterable[dict]) -> list[dict]:
    """The host's time inside CUDA's API, by call (``cudaLaunchKernel``, ``cuLaunchKernelEx`` for Triton's launches,
    ``cudaMemcpyAsync``, ``cudaStreamSynchronize``, ...), most time first: ``name``, ``calls``, ``ms`` and the
    longest call's ``max_ms``. A launch costs the host a few µs; a copy to the host or a synchronisation lasts
    until the GPU gets there, so a long one is the host waiting for the GPU, and a host-bound step with little
    time here spends it in Python and PyTorch's dispatch."""
    calls: dict[str, list[float]] = {}
    for e in trace_events:
        if e.get("ph") == "X" and e.get("cat") in _LAUNCH_CATS:
            calls.setdefault(str(e.get("name", "?")), []).append(float(e.get("dur", 0.0)))
    rows = [dict(name=name, calls=len(d), ms=sum(d) / 1e3, max_ms=max(d) / 1e3) for name, d in calls.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def trace_kernels(trace_events: Iterable[dict]) -> list[tuple[str, float, int]]:
    """``(name, total_us, count)`` of every device kernel, copy and memset of a Chrome trace (:func:`aggregate`d)."""
    return aggregate((str(e.get("name", "?")), float(e.get("dur", 0.0)), 1) for e in trace_events
                     if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATS)


def trace_report(title: str, facts: Sequence[tuple[str, str]], trace_events: list[dict], wall_ms: float,
                 top: int = 20) -> str:
    """:func:`render_report` of a Chrome trace's events alone (a window of a profile: the GPU's busy time, its
    idle gaps split into waits for the host and the rest, the host's time in CUDA's API, the kernels)."""
    device, _ = trace_device_and_launches(trace_events)
    return render_report(title, facts, wall_ms, busy_us((lo, hi) for lo, hi, _ in device) / 1e3,
                         trace_kernels(trace_events), top=top, gaps=trace_gaps(trace_events),
                         api=host_api_calls(trace_events))


def trace_gaps(trace_events: list[dict]) -> dict | None:
    """:func:`idle_gaps` of a Chrome trace's events (None without device work or launch records)."""
    device, launches = trace_device_and_launches(trace_events)
    return idle_gaps(device, launches) if device and launches else None


def trace_events(prof, keep_as: str | None = None) -> list[dict]:
    """The ``traceEvents`` of a finished profile's Chrome trace, exported once: to ``keep_as`` when the caller
    wants to keep the file, else to a temporary one."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = keep_as or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            return json.load(fh).get("traceEvents", [])


def trace_facts(prof, keep_as: str | None = None) -> tuple[dict | None, dict[str, dict], list[dict]]:
    """:func:`idle_gaps` (None without launch records), :func:`host_link_rates` and :func:`host_api_calls` of a
    finished profile, read from its Chrome trace, exported once: to ``keep_as`` when the caller wants to keep it,
    else to a temporary file (:func:`trace_events`)."""
    events = trace_events(prof, keep_as)
    return trace_gaps(events), host_link_rates(events), host_api_calls(events)


def run(args) -> str:
    """Load, warm up, profile ``--steps`` steps, write the report; returns its path."""
    if args.system == "unsloth":
        import unsloth  # noqa: F401  (before transformers)
    import torch
    import train_step

    model, plan_note = load_system(args)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4, fused=True)
    batches = train_step.token_batches(args.shape, args.batch, args.seq, args.warmup + args.steps)
    scaler = torch.amp.GradScaler("cuda", init_scale=train_step.INITIAL_SCALE) if args.dtype == "float16" else None
    step = train_step.training_step(model, optimizer, scaler)

    warm_ms = []
    for ids in batches[: args.warmup]:
        torch.cuda.synchronize()
        started = time.perf_counter()
        step(ids)
        torch.cuda.synchronize()
        warm_ms.append((time.perf_counter() - started) * 1e3)
    # the first warm-up step compiles and allocates: the median of the others when there are any
    settled = sorted(warm_ms[1:] or warm_ms)
    unprofiled_ms = settled[len(settled) // 2]
    torch.cuda.reset_peak_memory_stats()
    prof, wall_ms = profile_steps([lambda ids=ids: step(ids) for ids in batches[args.warmup :]], args.with_cpu)
    kernels, intervals = device_kernels(prof.events())
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, report_name(args.shape, args.quant, args.seq, args.batch, args.system, args.tag))
    try:
        gaps, link, api = trace_facts(prof, keep_as=path[: -len(".md")] + ".trace.json" if args.trace else None)
    except Exception as exc:  # noqa: BLE001 - the gap split is extra information, never fatal
        print(f"(no idle-gap analysis: {exc})", file=sys.stderr)
        gaps, link, api = None, {}, None
    if not kernels:
        print("WARNING: the profiler recorded no GPU kernels; try again with --with-cpu.", file=sys.stderr)
    facts = [
        ("GPU", f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"),
        ("activation plan", plan_note),
        ("max_memory given to the planner", args.max_memory or "–"),
        ("dtype", f"{args.dtype}" + (" (autocast + GradScaler)" if scaler else "")
         + (f", allocator capped at {args.memory_cap_gib} GiB" if args.memory_cap_gib else "")),
        ("peak allocated in the profiled step", f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"),
        ("warm-up steps without the profiler", ", ".join(f"{ms:.1f}" for ms in warm_ms) + " ms"),
        ("profiled steps", f"{args.steps}, back to back (no synchronisation between them)"),
        ("tokens / s (profiled steps)", f"{args.steps * args.batch * args.seq / (wall_ms / 1e3):,.0f}"),
        *[(f"host link {d}, copies of 1 MiB or more", f"{r['copies']} copies, {r['gb']:.2f} GB in {r['ms']:.1f} ms; "
           f"GB/s a copy: {r['p10']:.1f} (10th percentile), {r['median']:.1f} (median), {r['p90']:.1f} (90th)")
          for d, r in link.items()],
    ]
    what = "One training step" if args.steps == 1 else f"{args.steps} training steps"
    title = f"{what} of {args.system}: {args.shape} {args.quant}, {args.seq} tokens × {args.batch}"
    text = render_report(title, facts, wall_ms, busy_us(intervals) / 1e3, kernels, gaps=gaps, steps=args.steps,
                         unprofiled_ms=unprofiled_ms if args.warmup > 1 else None,
                         compute_busy_ms=busy_us(compute_intervals(prof.events())) / 1e3, api=api)
    with open(path, "w") as fh:
        fh.write(text)
    with open(path[: -len(".md")] + ".json", "w") as fh:
        json.dump(dict(facts=dict(facts), wall_ms=wall_ms, steps=args.steps, gaps=gaps, kernels=kernels), fh, indent=1)
    print(text)
    return path


def default_tag(args) -> str:
    parts = []
    if args.system == "notebookkit" and args.checkpointing != "auto":
        parts.append(f"gc-{args.checkpointing}")
    if args.max_memory:
        parts.append(f"cap-{args.max_memory}")
    if getattr(args, "dtype", "bfloat16") == "float16":
        parts.append("fp16" + (f"-{args.memory_cap_gib:g}GiB" if args.memory_cap_gib else ""))
    if args.system == "notebookkit" and getattr(args, "fp8", False):
        parts.append("fp8")
    if args.system == "notebookkit" and getattr(args, "spread", False):
        parts.append("spread")
    if getattr(args, "steps", 1) > 1:
        parts.append(f"{args.steps}steps")
    return "-".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", required=True, choices=SYSTEMS)
    ap.add_argument("--shape", default="llama-3.1-8b", help="a shape of benchmarks/train_step.py")
    ap.add_argument("--quant", default="nf4", choices=["nf4", "bf16"])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=4,
                    help="unprofiled steps before the profiled ones (the median of all but the first is the "
                         "unprofiled step the report compares the GPU busy time with)")
    ap.add_argument("--steps", type=int, default=1,
                    help="steps profiled back to back (>1 shows the steady state: the host may queue ahead)")
    ap.add_argument("--checkpointing", default="auto", choices=["auto", "offload", "offload_mlp", "true", "false"],
                    help="notebookkit only: use_gradient_checkpointing")
    ap.add_argument("--max-memory", default=None, help='notebookkit only: budget for the "auto" plan, e.g. 8GiB')
    ap.add_argument("--fp8", action="store_true", help="notebookkit only: FP8 forward for the frozen base GEMMs")
    ap.add_argument("--spread", action="store_true",
                    help='notebookkit only: plan "auto" with the planner\'s layout="spread"')
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                    help="float16 trains under autocast and a GradScaler (a T4's precision), as train_step.py")
    ap.add_argument("--memory-cap-gib", type=float, default=None, help="cap the allocator (15 with float16: a T4)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default=None, help="file-name suffix (default: from --checkpointing / --max-memory)")
    ap.add_argument("--trace", action="store_true", help="also save a Chrome trace next to the report")
    ap.add_argument("--with-cpu", action="store_true", help="also record CPU ops (heavier; the kernel table is the same)")
    args = ap.parse_args()
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1.")
    if args.warmup < 1:
        raise SystemExit("--warmup must be at least 1: the first step compiles kernels and creates optimizer state.")
    if args.tag is None:
        args.tag = default_tag(args)
    print("wrote", run(args))


if __name__ == "__main__":
    main()
