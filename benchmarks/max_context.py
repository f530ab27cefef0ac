"""Longest sequence (batch 1) that trains under a VRAM cap, for each system.

For every system and every cap (GiB) this finds the longest input, a multiple of ``--step``
tokens, for which one full LoRA / QLoRA training step completes: forward with labels, backward,
fused AdamW step, ``zero_grad``. The cap is enforced with
``torch.cuda.set_per_process_memory_fraction(cap GiB / card memory)``, so a big card behaves like a
16 GiB or 24 GiB one as far as PyTorch's caching allocator is concerned (the CUDA context, library
handles and pinned host memory are outside that cap).

    python benchmarks/max_context.py --out benchmarks/results --systems hf,liger,unsloth,notebookkit \\
        --caps 16,24 --shape llama-3.1-8b --quant nf4 [--step 1024] [--max-seq 131072] [--time-budget 150]

The search per (system, cap): grow geometrically from ``--start`` (or the previous cap's answer)
until a step runs out of memory, then bisect between the last length that fitted and the first
that did not, down to ``--step`` tokens. When even the start does not fit it halves instead.
``notebookkit`` re-plans its activation memory (keep / recompute / offload per layer) for each
probed length under the cap, as ``use_gradient_checkpointing="auto"`` would for that run.

The parent runs the search; each probe (one training step at one length under one cap) runs in a
child process that holds the loaded model (Unsloth must be imported before transformers, and one
system's patches or allocator state must not touch another's numbers). A child answers probes
while they fit and exits after the first that runs out of memory: an OOM can leave the caching
allocator fragmented or a library's buffers half built, so that a later, shorter step fails in
that process where it would fit in a fresh one. The next probe starts a new child (the model is
loaded again), so no probe ever runs in a process that has run out of memory. The parent writes
``<out>/<date>-<gpu>-max-context.json`` and ``.md`` and prints the table last. To talk to one
child by hand: ``python benchmarks/max_context.py --child --system notebookkit``, then type
``{"cap": 16, "seq": 8192}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

SYSTEMS = ["hf", "liger", "unsloth", "notebookkit"]
OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


# --------------------------------------------------------------------------- the search (pure)


@dataclass
class SearchOutcome:
    """Result of :func:`search_longest`: the longest length that fitted (0 if none), every probe
    as ``(length, fitted)`` in the order run, and why the search stopped."""

    longest: int
    probes: list[tuple[int, bool]] = field(default_factory=list)
    reason: str = "ok"


def _round_down(length: int, step: int) -> int:
    return (length // step) * step


def search_longest(
    try_len: Callable[[int], bool],
    start: int,
    step: int,
    max_seq: int,
    growth: float = 2.0,
    out_of_time: Callable[[], bool] = lambda: False,
) -> SearchOutcome:
    """Longest multiple of ``step`` (at most ``max_seq``) for which ``try_len(length)`` is True.

    ``try_len`` is assumed monotone (if a length fits, every shorter one does). From ``start``
    (rounded down to a multiple of ``step``) the length grows by ``growth`` while it fits; when
    even ``start`` does not fit it halves until one fits (giving up, with 0, below ``step``).
    Then it bisects between the longest fit and the shortest failure to ``step`` granularity.
    ``out_of_time()`` is asked before each probe; when it says True the best length so far is
    returned with reason ``"time budget reached"``. Other reasons: ``"ok"``, ``"reached --max-seq"``,
    ``"nothing fits"``.
    """
    if step <= 0:
        raise ValueError(f"--step must be a positive number of tokens, got {step}.")
    ceiling = _round_down(max_seq, step)
    if ceiling < step:
        raise ValueError(f"--max-seq {max_seq} is shorter than --step {step}; raise --max-seq or lower --step.")
    outcome = SearchOutcome(longest=0)

    def probe(length: int) -> bool:
        fitted = bool(try_len(length))
        outcome.probes.append((length, fitted))
        return fitted

    def stop(reason: str) -> SearchOutcome:
        outcome.longest, outcome.reason = good, reason
        return outcome

    good, bad = 0, None
    length = min(max(_round_down(start, step), step), ceiling)
    while True:  # bracket the answer: good fits, bad does not
        if out_of_time():
            return stop("time budget reached")
        if probe(length):
            good = length
            if length >= ceiling:
                return stop("reached --max-seq")
            if bad is not None:
                break
            length = min(ceiling, max(length + step, _round_down(int(length * growth), step)))
        else:
            bad = length
            if good:
                break
            if length <= step:
                return stop("nothing fits")
            length = max(step, _round_down(length // 2, step))
    while bad - good > step:  # bisect
        if out_of_time():
            return stop("time budget reached")
        middle = _round_down((good + bad) // 2, step)
        if probe(middle):
            good = middle
        else:
            bad = middle
    return stop("ok")


def is_out_of_memory(exc: BaseException) -> bool:
    """True for CUDA allocation failures (PyTorch's OOM error or a library's failed allocation)."""
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in OOM_MARKERS)


# --------------------------------------------------------------------------- report (pure)


def markdown_table(rows: list[dict]) -> str:
    """The results table: system | cap GiB | longest seq | predicted | tokens/s there | peak GiB | probes |
    processes | status."""
    lines = ["| system | cap GiB | longest seq | predicted (planner) | tokens/s there | peak GiB | probes | processes "
             "| status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        longest = r.get("max_seq")
        shown = f"{longest:,}" if longest else (f"≥ {r['at_least']:,} (cut short)" if r.get("at_least") else "–")
        predicted = r.get("predicted_seq")
        tok_s = r.get("tok_s")
        peak = r.get("peak_gib")
        lines.append(
            f"| {r.get('system', '?')} | {r.get('cap_gib', '?')} | "
            f"{shown} | {f'{predicted:,}' if predicted else '–'} | "
            f"{f'{tok_s:,.0f}' if tok_s else '–'} | "
            f"{f'{peak:.2f}' if peak else '–'} | {r['probes'] if r.get('probes') is not None else '–'} | "
            f"{r.get('processes') or '–'} | {str(r.get('status', '?')).replace('|', '/')} |"
        )
    return "\n".join(lines)


def markdown_report(rows: list[dict], settings: dict) -> str:
    """Table plus the notes a reader needs to interpret it."""
    known = next((r for r in rows if r.get("gpu")), {})
    notes = [
        f"# Longest trainable sequence under a VRAM cap ({settings.get('shape')}, {settings.get('quant')}, batch 1)",
        "",
        markdown_table(rows),
        "",
        f"- GPU: {known.get('gpu', '?')}, torch {known.get('torch', '?')}; lengths are multiples of "
        f"{settings.get('step')} tokens, at most {settings.get('max_seq')}; LoRA r=16 on all seven projections.",
        "- A length counts when one full step fits: forward with labels, backward, fused AdamW step, zero_grad.",
        "- The cap is `torch.cuda.set_per_process_memory_fraction(cap / card memory)`: it limits PyTorch's "
        "caching allocator only. The CUDA context (about 0.5 GiB), library workspaces allocated outside "
        "PyTorch and pinned host memory (offloaded activations) are not counted, so on a real card of that "
        "size leave room for the context.",
        "- tokens/s and peak GiB are from a step at the longest length (a confirmation step when it ran). "
        "probes counts the search's steps, not the warm-up step or the confirmation step.",
        "- No probe runs in a process that has run out of memory: a child process answers probes until one "
        "does not fit, then exits, and the next probe loads the model in a fresh one. processes = the child "
        "processes a cap's search used (one more after each OOM).",
        "- notebookkit re-plans its per-layer activation plan (keep / recompute / offload) for each probed "
        "length under the cap; the plan at the longest length is in the status column.",
    ]
    return "\n".join(notes) + "\n"


def parse_caps(text: str) -> list[float]:
    """``"16,24"`` -> ``[16.0, 24.0]`` in increasing order."""
    try:
        caps = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--caps takes GiB numbers separated by commas, e.g. 16,24; got {text!r}.") from None
    if not caps or min(caps) <= 0:
        raise SystemExit(f"--caps needs at least one positive number of GiB; got {text!r}.")
    return caps


def _cap_label(cap: float) -> float | int:
    return int(cap) if float(cap).is_integer() else cap


# --------------------------------------------------------------------------- child: one system, probes on request


def _load(system: str, folder: str, quant: str, max_seq: int):
    import train_step

    if system == "unsloth":
        return train_step.load_unsloth(folder, quant, max_seq)
    if system == "notebookkit":
        return train_step.load_notebookkit(folder, quant, max_seq, 1, "auto")
    return train_step.load_peers(system, folder, quant)


def _plan_summary(model) -> Optional[str]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    plan = getattr(base, "_notebookkit_checkpointing", None)
    if isinstance(plan, (list, tuple)):
        return ", ".join(f"{plan.count(k)} {k}" for k in ("keep", "recompute", "offload") if plan.count(k))
    return plan if isinstance(plan, str) else None


def _replanner(model, cap: float) -> Callable[[int], None]:
    """For notebookkit: re-plan the activation memory for a length under ``cap`` GiB.

    When the planner predicts that even offloading every layer does not fit (``DoesNotFitError``),
    the leanest plan (every layer offloaded) is applied anyway and the step itself decides: the
    planner keeps a safety margin, and the search measures what really trains.
    """
    import inspect

    from notebookkit.memory.planner import DoesNotFitError
    from notebookkit.models.patching.checkpointing import apply_checkpointing

    capped = "max_memory" in inspect.signature(apply_checkpointing).parameters
    if not capped:
        print("WARNING: apply_checkpointing has no max_memory keyword; the planner sees the whole card.",
              file=sys.stderr, flush=True)
    extra = {"max_memory": f"{_cap_label(cap)}GiB"} if capped else {}

    def replan(length: int) -> None:
        try:
            apply_checkpointing(model, "auto", None, batch_size=1, seq_len=length, **extra)
        except DoesNotFitError:
            apply_checkpointing(model, "offload", None)

    return replan


def predicted_longest(model, cap: float, step: int, max_seq: int) -> Optional[int]:
    """notebookkit's own prediction (``notebookkit.memory.longest_sequence``) for a card of ``cap`` GiB.

    The planner counts the CUDA context and keeps an 8% margin, so it predicts less than the
    allocator-only cap lets the search find."""
    try:
        from notebookkit.memory import longest_sequence

        return longest_sequence(model, f"{_cap_label(cap)}GiB", step=step, max_seq=max_seq).seq_len
    except Exception as exc:  # noqa: BLE001 - informative only
        print(f"(no prediction: {type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        return None


def _one_step(model, optimizer, ids) -> None:
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _release(optimizer) -> None:
    import torch

    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


class Prober:
    """Runs one training step at a given length; returns the PROBE record (fits, time, peak memory)."""

    def __init__(self, model, optimizer, vocab: int, replan: Optional[Callable[[int], None]]):
        self.model, self.optimizer, self.vocab, self.replan = model, optimizer, vocab, replan

    def __call__(self, length: int) -> dict:
        record: dict = dict(seq=length, fits=False)
        started = time.perf_counter()
        try:
            record |= self._timed_step(length)
            record["fits"] = True
        except Exception as exc:  # noqa: BLE001 - only OOM is a "does not fit"; the rest stops the search
            if not is_out_of_memory(exc):
                raise
            print(f"  OOM at {length}: {str(exc).splitlines()[0][:160]}", file=sys.stderr, flush=True)
        _release(self.optimizer)
        return record | dict(s=round(time.perf_counter() - started, 2))

    def _timed_step(self, length: int) -> dict:
        import torch

        if self.replan is not None:
            self.replan(length)
        ids = torch.randint(3, self.vocab, (1, length), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        started = time.perf_counter()
        _one_step(self.model, self.optimizer, ids)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        return dict(
            s_step=round(seconds, 3), tok_s=round(length / seconds, 1),
            peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
            reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 3),
            plan=_plan_summary(self.model) if self.replan is not None else None,
            predicted_gib=_predicted_peak(self.model, length) if self.replan is not None else None,
        )


def _predicted_peak(model, length: int) -> Optional[float]:
    """The memory model's peak (allocator bytes, CUDA context left out) for the plan just applied, in GiB."""
    try:
        from notebookkit.memory.estimate import estimate_for_model

        return round(estimate_for_model(model, batch_size=1, seq_len=length).peak_allocated / 2**30, 3)
    except Exception as exc:  # noqa: BLE001 - informative only
        print(f"(no predicted peak: {type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        return None


def child_main(args) -> None:
    """Load ``args.system`` once, run a warm-up step, print ``READY {json}``; then answer requests
    read from stdin, one JSON object a line: ``{"cap": GiB, "seq": tokens}`` trains one step under
    that cap and prints ``PROBE {json}``; ``{"predict": GiB}`` prints ``PREDICTED {json}``
    (notebookkit's planner). After a step that ran out of memory the process exits: an OOM can
    leave the allocator fragmented or a library's buffers half built, so no later probe may run in it.
    """
    if args.system == "unsloth":
        import unsloth  # noqa: F401  (before transformers, which train_step imports)
    import torch
    import train_step

    folder = train_step.build_checkpoint(args.shape)
    load_started = time.time()
    model = _load(args.system, folder, args.quant, args.max_seq)
    load_s = round(time.time() - load_started, 1)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4, fused=True)
    vocab = train_step.SHAPES[args.shape]["vocab_size"]
    prober = Prober(model, optimizer, vocab, None)
    print("warm-up step (compiles kernels, creates optimizer state):", file=sys.stderr, flush=True)
    if not prober(args.step)["fits"]:
        raise SystemExit(f"the warm-up step of {args.step} tokens ran out of memory without a cap")
    print("READY " + json.dumps(dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, load_s=load_s,
                                     pid=os.getpid())), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "predict" in request:
            seq = predicted_longest(model, request["predict"], args.step, args.max_seq)
            print("PREDICTED " + json.dumps(dict(cap=request["predict"], seq=seq)), flush=True)
            continue
        cap = request["cap"]
        train_step.cap_gpu_memory(cap)
        _release(optimizer)
        prober.replan = _replanner(model, cap) if args.system == "notebookkit" else None
        record = prober(int(request["seq"]))
        print("PROBE " + json.dumps(record | dict(cap=cap, pid=os.getpid())), flush=True)
        if not record["fits"]:
            print("out of memory: this process ends; the next probe starts a fresh one", file=sys.stderr, flush=True)
            return


# --------------------------------------------------------------------------- parent: the searches


class ChildFailed(RuntimeError):
    """A probe process ended without answering (a crash, or silent past its timeout)."""


class ProbeProcesses:
    """The parent's side of the probes of one system: each probe is sent to a child process running
    :func:`child_main`; a child that answered "out of memory" has exited, and the next probe starts
    a fresh one (the model is loaded again). Counts the processes started and the seconds spent in
    probes (model loading and warm-up excluded)."""

    def __init__(self, system: str, args, log_path: str):
        self.system, self.args, self.log_path = system, args, log_path
        self.proc: Optional[subprocess.Popen] = None
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.started = 0
        self.probe_seconds = 0.0
        self.ready: dict = {}
        self.timeout = args.timeout or 600

    def _start(self) -> None:
        from run import FIRST_ROW_GRACE_S  # Unsloth's first import compiles: not probe time

        log = open(self.log_path, "a")
        log.write(f"--- process {self.started + 1} of {self.system}\n")
        log.flush()
        self.proc = subprocess.Popen(child_command(self.system, self.args), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
        log.close()
        self.lines = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()
        grace = FIRST_ROW_GRACE_S.get(self.system, 0) if self.started == 0 else 0
        self.started += 1
        self.ready = self._expect("READY ", self.timeout + grace)

    def _read(self, proc: subprocess.Popen, lines: "queue.Queue[Optional[str]]") -> None:
        with open(self.log_path, "a") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                lines.put(line.rstrip("\n"))
        lines.put(None)  # end of output

    def _expect(self, prefix: str, timeout: float) -> dict:
        deadline = time.time() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                self.close()
                raise ChildFailed(f"timed out after {timeout:.0f}s") from None
            if line is None:
                self.proc.wait()
                code, self.proc = self.proc.returncode, None
                raise ChildFailed(f"the process ended (exit code {code}) before {prefix.strip()}: "
                                  f"{_last_error(self.log_path)}")
            if line.startswith(prefix):
                return json.loads(line[len(prefix):])

    def _send(self, request: dict, prefix: str) -> dict:
        if self.proc is None:
            self._start()
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._expect(prefix, self.timeout)

    def probe(self, cap: float, seq: int) -> dict:
        """One training step of ``seq`` tokens under ``cap`` GiB: the child's PROBE record."""
        if self.proc is None:
            self._start()  # loading and warm-up are not probe time
        started = time.time()
        try:
            record = self._send(dict(cap=cap, seq=seq), "PROBE ")
        finally:
            self.probe_seconds += time.time() - started
        print(f"[{self.system}] PROBE {json.dumps(record)}", flush=True)
        if not record["fits"]:
            self._retire()
        return record

    def _retire(self) -> None:
        """After an out-of-memory answer: end that child (it exits by itself; this makes sure), so
        that the next probe runs in a fresh process."""
        self.close()

    def predict(self, cap: float) -> Optional[int]:
        return self._send(dict(predict=cap), "PREDICTED ").get("seq")

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _last_error(log_path: str) -> str:
    """The last non-empty line of a child's log (its error message, usually)."""
    try:
        with open(log_path) as fh:
            lines = [ln.strip() for ln in fh if ln.strip() and not ln.startswith("--- process")]
    except OSError:
        return "no output"
    return lines[-1][-200:] if lines else "no output"


def search_one_cap(probes: ProbeProcesses, cap: float, start: int, args, seconds: float) -> dict:
    """Search the longest length under ``cap`` with ``probes`` and confirm it with one more step; the row."""
    row: dict = dict(cap_gib=_cap_label(cap), start=start, budget_s=round(seconds))
    records: dict[int, dict] = {}
    started_processes, spent_before = probes.started, probes.probe_seconds

    def try_len(length: int) -> bool:
        records[length] = probes.probe(cap, length)
        return records[length]["fits"]

    started = time.time()
    try:
        outcome = search_longest(try_len, start, args.step, args.max_seq, args.growth,
                                 lambda: probes.probe_seconds - spent_before > seconds)
        status = {
            "reached --max-seq": f"fits at --max-seq {args.max_seq}",
            "nothing fits": f"nothing fits (not even {args.step} tokens)",
            "time budget reached": "time budget reached (longest so far)",
        }.get(outcome.reason, outcome.reason)
        if outcome.longest and args.confirm and not try_len(outcome.longest):
            status += "; OOM when re-run at that length (in a fresh process)"
        row |= dict(max_seq=outcome.longest, probes=len(outcome.probes), probe_log=outcome.probes)
        stats = records.get(outcome.longest, {})
        row |= {k: stats[k] for k in ("s_step", "tok_s", "peak_gib", "reserved_gib", "plan") if k in stats}
        if row.get("plan"):
            status += f" (plan: {row['plan']})"
    except ChildFailed as exc:
        fitted = [n for n, r in records.items() if r["fits"]]
        row |= dict(probes=len(records), probe_log=[(n, r["fits"]) for n, r in records.items()])
        if fitted:
            row["at_least"] = max(fitted)  # the search stopped inside this cap
        status = f"{'timed out' if 'timed out' in str(exc) else 'failed'}: {exc} (see {os.path.basename(probes.log_path)})"
    return row | dict(status=status, processes=probes.started - started_processes, search_s=round(time.time() - started, 1))


def gpu_name() -> str:
    """The card's name for file names, from nvidia-smi (so the parent holds no CUDA context)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        name = out.stdout.strip().splitlines()[0].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        return "gpu"
    return name.replace(" ", "-") or "gpu"


def child_command(system: str, args) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--child", "--system", system, "--shape", args.shape,
            "--quant", args.quant, "--step", str(args.step), "--max-seq", str(args.max_seq)]


def rows_for_system(system: str, args, out_dir: str) -> list[dict]:
    """One row per cap, searched in increasing order (each cap starts from the previous answer)."""
    caps = parse_caps(args.caps)
    if not _available(system):
        return [dict(system=system, cap_gib=_cap_label(cap), status="not installed") for cap in caps]
    log_path = os.path.join(out_dir, f"max-context-{system}.log")
    open(log_path, "w").close()
    probes = ProbeProcesses(system, args, log_path)
    rows: list[dict] = []
    start = args.start
    try:
        for i, cap in enumerate(caps):
            if rows and not probes.ready:  # the model never loaded: the other caps would fail the same way
                rows.append(dict(system=system, cap_gib=_cap_label(cap), status=rows[-1]["status"]))
                continue
            share = max(0.0, args.time_budget - probes.probe_seconds) / (len(caps) - i)
            row = dict(system=system, shape=args.shape, quant=args.quant) | search_one_cap(probes, cap, start, args, share)
            if system == "notebookkit" and "max_seq" in row:
                try:
                    row["predicted_seq"] = probes.predict(cap)
                except ChildFailed as exc:
                    print(f"(no prediction: {exc})", file=sys.stderr, flush=True)
            rows.append(row | {k: probes.ready[k] for k in ("gpu", "torch", "load_s") if k in probes.ready})
            print("RESULT " + json.dumps(rows[-1]), flush=True)
            start = max(args.start, row.get("max_seq") or 0)
    finally:
        probes.close()
    return rows


def _available(system: str) -> bool:
    from run import available

    return available(system)


def parent_main(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{dt.date.today()}-{gpu_name()}{('-' + args.tag) if args.tag else ''}-max-context")
    settings = dict(shape=args.shape, quant=args.quant, caps=args.caps, step=args.step, max_seq=args.max_seq,
                    start=args.start, growth=args.growth, time_budget_s=args.time_budget)
    rows: list[dict] = []
    for system in [s.strip() for s in args.systems.split(",") if s.strip()]:
        rows += rows_for_system(system, args, args.out)
        with open(stem + ".json", "w") as fh:
            json.dump(dict(settings=settings, rows=rows), fh, indent=1)
        with open(stem + ".md", "w") as fh:
            fh.write(markdown_report(rows, settings))
    print(markdown_table(rows))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for the .json / .md / logs")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {','.join(SYSTEMS)}")
    ap.add_argument("--caps", default="16,24", help="VRAM caps in GiB, comma-separated")
    ap.add_argument("--shape", default="llama-3.1-8b", help="a shape of benchmarks/train_step.py")
    ap.add_argument("--quant", default="nf4", choices=["nf4", "bf16"])
    ap.add_argument("--step", type=int, default=1024, help="granularity of the answer, in tokens")
    ap.add_argument("--max-seq", type=int, default=131072, help="longest length tried (also the models' max_seq_length)")
    ap.add_argument("--start", type=int, default=4096, help="first length tried at the smallest cap")
    ap.add_argument("--growth", type=float, default=2.0, help="factor between lengths while they still fit")
    ap.add_argument("--time-budget", type=float, default=150.0,
                    help="seconds of probing per system, all caps together (model loading and the reloads "
                         "after an OOM excluded); each cap gets an equal share of what is left, and one probe "
                         "may overrun it")
    ap.add_argument("--no-confirm", dest="confirm", action="store_false",
                    help="skip the extra step at the answer (it times a warm step and checks the fit repeats)")
    ap.add_argument("--timeout", type=int, default=0,
                    help="kill a child process that stays silent this many seconds while loading (plus Unsloth's "
                         "first-import grace) or in one probe (default 600)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--child", action="store_true",
                    help="be a probe process for one --system: read {\"cap\": GiB, \"seq\": tokens} lines on stdin")
    ap.add_argument("--system", choices=SYSTEMS, help="with --child: the system to load")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    if args.growth <= 1.0:
        raise SystemExit(f"--growth must be above 1, got {args.growth}.")
    if args.child:
        if not args.system:
            raise SystemExit("--child needs --system (one of " + ", ".join(SYSTEMS) + ").")
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
