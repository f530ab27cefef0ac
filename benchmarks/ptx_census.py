"""Instruction census of a Triton kernel's hot loop, from its PTX, on any machine (no GPU: compile only).

    python benchmarks/ptx_census.py nf4_matvec 0          # the module's AOT_SPECS[0], for sm_90
    python benchmarks/ptx_census.py nf4_matvec 0 --cc 75 --set HAS_LORA=True

A decode matvec is fast when each weight byte costs few instructions: an H200 SM issues 4 warp instructions a
clock (128 thread instructions) and must take in about 16 bytes a clock to read at the copy bandwidth
(4.2 TB/s over 132 SMs at 1.98 GHz), so a loop that spends ``i`` thread instructions per weight byte tops out near
``128 / (16 i)`` of the copy bandwidth from instruction issue alone, before any memory latency. This script
compiles one of a kernel module's ``AOT_SPECS`` (with the 16-byte pointer alignment and divisibility the JIT
infers at run time, so that loads vectorise as they do on the GPU), finds the innermost loop of the PTX (the
block a backward branch returns to), and counts its instructions by opcode, inline-asm blocks expanded into their
instructions. ``--bytes-per-thread`` turns the count into instructions per weight byte (the matvec's tile bytes
over its threads, printed for ``nf4_matvec``). PTX is not SASS: ``ptxas`` schedules and sometimes fuses, so take
the numbers as a census for comparing designs, not a cycle count.
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib
import inspect
import re
import sys

LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
BRANCH = re.compile(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);")


def hot_loop(ptx: str) -> list[str]:
    """The instructions of the innermost loop: from the label a backward branch jumps to, to that branch (the
    first such loop when there are several)."""
    lines = ptx.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        found = LABEL.match(line.strip())
        if found:
            labels[found.group(1)] = i
    for i, line in enumerate(lines):
        found = BRANCH.search(line)
        if found and labels.get(found.group(1), i + 1) < i:
            return [line.strip() for line in lines[labels[found.group(1)] + 1:i + 1]]
    raise SystemExit("no loop in this kernel's PTX (a backward branch): nothing to count")


def opcodes(loop: list[str]) -> collections.Counter:
    """Opcode -> count over ``loop``; an inline-asm block ``{ ...; ...; }`` counts its instructions."""
    counts: collections.Counter = collections.Counter()
    for line in loop:
        if not line or line.startswith(("//", ".", "$")):
            continue
        parts = [p.strip() for p in line.strip("{} ").split(";")] if line.startswith("{") else [line.rstrip(";")]
        for part in parts:
            tokens = part.split()
            if tokens and tokens[0].startswith("@"):
                tokens = tokens[1:]
            if tokens and not tokens[0].startswith((".", "//")):
                counts[tokens[0]] += 1
    return counts


def compile_ptx(module: str, index: int, cc: int, overrides: dict) -> tuple[str, dict, dict]:
    """(PTX, constexprs, options) of ``notebookkit.kernels.<module>.AOT_SPECS[index]`` for ``sm_<cc>``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod = importlib.import_module(f"notebookkit.kernels.{module}")
    kernel, signature, constexprs, *rest = mod.AOT_SPECS[index]
    options = dict(rest[0]) if rest else {}
    options.pop("targets", None)
    constexprs = {**constexprs, **overrides}
    full = {n: "constexpr" if n in constexprs else signature[n] for n in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
               if full[n].startswith("*") or (full[n] in ("i32", "i64") and not n.startswith(("M", "rank")))}
    if "attrs" not in inspect.signature(ASTSource.__init__).parameters:
        raise SystemExit("this Triton's ASTSource takes no attributes: run on triton >= 3.2")
    src = ASTSource(kernel, full, constexprs, aligned)
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options or None)
    return compiled.asm["ptx"], constexprs, options


def nf4_matvec_bytes_per_thread(constexprs: dict, options: dict) -> float:
    """Weight bytes one thread reads per loop step of ``nf4_matvec``: the tile over the program's threads."""
    tile = constexprs["BLOCK_N"] * constexprs["STEP_BLOCKS"] * constexprs["BLOCKSIZE"] // 2
    return tile / (32 * options.get("num_warps", 4))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("module", help="a module of notebookkit.kernels with AOT_SPECS")
    ap.add_argument("index", type=int, help="which of its AOT_SPECS")
    ap.add_argument("--cc", type=int, default=90, help="compute capability (90: H100/H200, 75: T4)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a constexpr")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.set:
        name, value = item.split("=", 1)
        overrides[name] = ast.literal_eval(value)
    ptx, constexprs, options = compile_ptx(args.module, args.index, args.cc, overrides)
    counts = opcodes(hot_loop(ptx))
    total = sum(counts.values())
    print(f"{args.module} AOT_SPECS[{args.index}] sm_{args.cc}: {total} instructions in the loop")
    for name, n in counts.most_common(20):
        print(f"  {n:5d}  {name}")
    if args.module == "nf4_matvec" and "BLOCK_M" not in constexprs:  # the row kernel (M = 1)
        per_thread = nf4_matvec_bytes_per_thread(constexprs, options)
        per_byte = total / per_thread
        print(f"{per_thread:g} weight bytes per thread a step: {per_byte:.1f} instructions per weight byte; "
              f"issue alone caps the loop near {min(1.0, 128 / (16 * per_byte)):.0%} of the copy bandwidth")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))
    sys.exit(main())
