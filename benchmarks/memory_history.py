"""What is allocated at a window's peak: the caching allocator's history, replayed.

``torch.cuda.memory._record_memory_history`` logs every allocation and free of PyTorch's CUDA allocator with the
Python stack that made it, and ``torch.cuda.memory._snapshot()["device_traces"]`` hands the log back (PyTorch's
own memory viewer reads the same log). Replaying it gives the allocated bytes over the window:

    allocated(t) = baseline + sum(size of the window's blocks allocated and not yet freed at t)
                            - sum(size of the blocks from before the window freed by t)

where ``baseline`` is ``torch.cuda.memory_allocated()`` when the recording began. A block counts until its
``free_completed`` entry (a block freed while a stream still uses it is handed back only then, and the allocator's
counters fall then too). At the highest point the blocks alive are grouped by where they were allocated: the
innermost frame outside PyTorch's own modules. Blocks from before the window carry no stack; they are one line,
the baseline still alive at the peak.

:class:`Recording` runs the window; :func:`peak_report` writes the markdown. On a machine without CUDA a recording
holds nothing and its report says so.
"""

from __future__ import annotations

from collections import defaultdict

MAX_ENTRIES = 1_000_000  # the allocator keeps the last this many entries; a training half makes tens of thousands
# Frames from these are PyTorch's machinery, not the code that asked for the memory (torch.optim is kept).
_MACHINERY = ("/torch/nn/modules/", "/torch/autograd/", "/torch/utils/", "/torch/_tensor", "/torch/functional",
              "/torch/cuda/", "/torch/_ops", "/torch/_dynamo/", "/torch/amp/", "/torch/_C", "/torch/overrides")


def peak_of(trace: list[dict], baseline: int = 0) -> tuple[int, int, list[dict]]:
    """``(peak bytes, baseline bytes alive at the peak, the window's blocks alive at the peak)`` of one device's
    trace, replayed from ``baseline`` (module docstring). The peak is the first time the total reaches its max."""
    total, best, best_at = baseline, baseline, -1
    live: dict[int, int] = {}  # addr -> size of the window's blocks alive
    for i, entry in enumerate(trace):
        action, addr, size = entry["action"], entry.get("addr"), entry.get("size", 0)
        if action == "alloc":
            live[addr] = size
            total += size
            if total > best:
                best, best_at = total, i
        elif action == "free_completed":
            total -= live.pop(addr, size)  # a block from before the window: it leaves the baseline
    blocks: dict[int, dict] = {}
    before = baseline
    for entry in trace[:best_at + 1]:
        if entry["action"] == "alloc":
            blocks[entry["addr"]] = entry
        elif entry["action"] == "free_completed":
            if blocks.pop(entry["addr"], None) is None:
                before -= entry.get("size", 0)
    return best, before, list(blocks.values())


def origin(frames: list[dict]) -> str:
    """``path:line (function)`` of the innermost frame outside PyTorch's machinery (``frames`` innermost first, as
    the allocator records them); ``"(no Python stack)"`` for a block allocated from C++ alone."""
    for frame in frames:
        name = frame.get("filename", "")
        if not name or name.startswith("<") or "/torch/" in name and any(m in name for m in _MACHINERY):
            continue
        short = name.split("site-packages/")[-1]
        for root in ("/benchmarks/", "/notebookkit/"):
            if root in short and "site-packages" not in name:
                short = root.strip("/") + "/" + short.split(root, 1)[1]
        return f"{short}:{frame.get('line', 0)} ({frame.get('name', '?')})"
    return "(no Python stack)"


def peak_report(title: str, facts: list[tuple[str, str]], trace: list[dict] | None, baseline: int,
                counter_peak: int | None = None, top: int = 20) -> str:
    """The markdown report of a window: its replayed peak beside the allocator's own peak counter, the baseline
    alive then, and the ``top`` origins of the blocks alive at the peak by bytes."""
    gib, mib = 2**30, 2**20
    lines = [f"# {title}", ""] + [f"- {k}: {v}" for k, v in facts]
    if trace is None:
        return "\n".join(lines + ["- no CUDA here: no allocator history", ""])
    peak, before, blocks = peak_of(trace, baseline)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for block in blocks:
        group = groups[origin(block.get("frames", []))]
        group[0] += block["size"]
        group[1] += 1
    lines += [f"- allocated at the window's start: {baseline / gib:.3f} GiB; its peak, replayed: {peak / gib:.3f} GiB"
              + (f" (the allocator's peak counter: {counter_peak / gib:.3f} GiB)" if counter_peak is not None else ""),
              f"- at the peak: {before / gib:.3f} GiB allocated before the window, "
              f"{(peak - before) / gib:.3f} GiB in {len(blocks)} blocks of the window", "",
              "| allocated at | MiB alive at the peak | blocks |", "|---|---:|---:|"]
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    for where, (size, count) in ranked[:top]:
        lines.append(f"| `{where}` | {size / mib:.1f} | {count} |")
    rest = ranked[top:]
    if rest:
        lines.append(f"| {len(rest)} more places | {sum(s for _, (s, _) in rest) / mib:.1f} | "
                     f"{sum(c for _, (_, c) in rest)} |")
    return "\n".join(lines + [""])


class Recording:
    """The allocator's history over a window (``start`` ... ``stop``), with the bytes allocated at its start and
    the allocator's peak counter over it; nothing on a machine without CUDA (``trace`` stays None)."""

    def __init__(self) -> None:
        self.trace: list[dict] | None = None
        self.baseline = 0
        self.counter_peak: int | None = None

    def start(self) -> None:
        import torch

        if not torch.cuda.is_available():
            return
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.baseline = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=MAX_ENTRIES)  # C++ stacks cost more

    def stop(self) -> None:
        import torch

        if not torch.cuda.is_available():
            return
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.trace = snapshot["device_traces"][torch.cuda.current_device()]
        self.counter_peak = torch.cuda.max_memory_allocated()

    def report(self, title: str, facts: list[tuple[str, str]]) -> str:
        return peak_report(title, facts, self.trace, self.baseline, self.counter_peak)
