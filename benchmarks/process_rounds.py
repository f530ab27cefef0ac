"""Rows that ran several times, a process each (``--repeats``): the table's row of a system, and the spread.

A host-bound step's time swings between processes on one machine, more than between the steps of one process
(session 41: notebookkit's Qwen3-30B-A3B step 36.8-63.2 ms over seven processes on one H200, Unsloth's 47.4-52.5
over four). So a benchmark runs its systems in rounds (every system once a round, one after the other: a drift of
the machine's speed over the run reaches every system alike), shows each system's median process, and lists every
process's time and the round-by-round ratio to a peer under the table. Rows are dicts with ``system``, ``status``
(``"ok"`` for a measured row), ``repeat`` (the round, from 0) and a time under the caller's ``key``. Plain Python.
"""

from __future__ import annotations

import statistics

__all__ = ["rounds", "median_rows", "paired_ratios", "spread_lines", "row_timeout"]


def rounds(systems: list[str], repeats: int) -> list[tuple[str, int]]:
    """``(system, round)`` in the order they run: every system once a round, ``repeats`` rounds."""
    return [(system, i) for i in range(repeats) for system in systems]


def row_timeout(timeout: float, deadline: float | None, now: float, floor: float = 30.0) -> float | None:
    """Seconds the next row's process may run: ``timeout``, cut to what is left of the run's budget (``deadline``, a
    ``time.time()``; None: no budget); None when less than ``floor`` seconds are left, and the row is written as
    skipped: a run that would outlast a device call's limit still brings its table back."""
    if deadline is None:
        return timeout
    left = deadline - now
    return None if left < floor else min(timeout, left)


def median_rows(rows: list[dict], key: str) -> list[dict]:
    """One row a system: of its ok rows the median process by ``key`` (the lower middle one of an even count: one
    process's own figures, never a blend), with every process's ``key`` in run order under ``key + "_runs"``; rows
    not ok are kept as they are, in place."""
    runs: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("status") == "ok":
            runs.setdefault(r["system"], []).append(r)
    out, placed = [], set()
    for r in rows:
        if r.get("status") != "ok":
            out.append(r)
        elif r["system"] not in placed:
            placed.add(r["system"])
            done = sorted(runs[r["system"]], key=lambda x: x[key])
            out.append(dict(done[(len(done) - 1) // 2], **{key + "_runs": [x[key] for x in runs[r["system"]]]}))
    return out


def paired_ratios(rows: list[dict], system: str, peer: str, key: str) -> list[float]:
    """``peer``'s time over ``system``'s (its speed relative to ``peer``), round by round, in run order; a round
    where either did not measure is left out."""
    times = {(r["system"], r.get("repeat", 0)): r[key] for r in rows if r.get("status") == "ok"}
    return [times[peer, i] / times[system, i] for s, i in sorted(times, key=lambda k: k[1])
            if s == system and (peer, i) in times]


def spread_lines(rows: list[dict], key: str, peer: str, unit: str, fmt: str = ".1f") -> list[str]:
    """Under a table whose systems ran more than once: each process's time (``key``, in ``unit``), and each other
    system's round-by-round ratio to ``peer`` with its median; nothing when every system ran once."""
    collapsed = [r for r in median_rows(rows, key) if r.get("status") == "ok"]
    if not any(len(r[key + "_runs"]) > 1 for r in collapsed):
        return []
    lines = ["", f"Each process's median step ({unit}), in run order: " + "; ".join(
        f"{r['system']} {', '.join(format(t, fmt) for t in r[key + '_runs'])}" for r in collapsed) + "."]
    for r in collapsed:
        ratios = paired_ratios(rows, r["system"], peer, key) if r["system"] != peer else []
        if ratios:
            lines.append(f"{r['system']} × {peer}, round by round: {', '.join(f'{x:.2f}' for x in ratios)} "
                         f"(median {statistics.median(ratios):.2f}).")
    return lines
