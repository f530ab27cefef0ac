"""Instruction census of a Triton kernel's hot loop, from its PTX, on any machine (no GPU: compile only).

    python benchmarks/ptx_census.py nf4_matvec 0          # the module's AOT_SPECS[0], for sm_90
    python benchmarks/ptx_census.py nf4_matvec 0 --cc 75 --set HAS_LORA=True
    python benchmarks/ptx_census.py nf4_matvec 12 --sass     # the SASS of the cubin (nvdisasm), not the PTX

A decode matvec is fast when each weight byte costs few instructions: an H200 SM issues 4 warp instructions a
clock (128 thread instructions) and must take in about 16 bytes a clock to read at the copy bandwidth
(4.2 TB/s over 132 SMs at 1.98 GHz), so a loop that spends ``i`` thread instructions per weight byte tops out near
``128 / (16 i)`` of the copy bandwidth from instruction issue alone, before any memory latency. This script
compiles one of a kernel module's ``AOT_SPECS`` (with the 16-byte pointer alignment and divisibility the JIT
infers at run time, so that loads vectorise as they do on the GPU), finds the innermost loop of the PTX (the
block a backward branch returns to), and counts its instructions by opcode, inline-asm blocks expanded into their
instructions. ``--bytes-per-thread`` turns the count into instructions per weight byte (the matvec's tile bytes
over its threads, printed for ``nf4_matvec``). PTX is not SASS: ``ptxas`` schedules and sometimes fuses (and drops most
``mov``), so ``--sass`` counts the loop of the cubin instead (Triton's own ``ptxas``, disassembled by the
``nvdisasm`` its NVIDIA backend ships). Either is a census for comparing designs, not a cycle count.
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


SASS_LABEL = re.compile(r"^\.(L_x_\d+):")
SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
SASS_BRANCH = re.compile(r"\bBRA\b[^`]*`?\(?\.(L_x_\d+)")


def sass_hot_loop(listing: str) -> list[str]:
    """The SASS instructions (``nvdisasm -c`` text) of the first loop: from the label a backward ``BRA`` jumps to,
    to that branch."""
    labels, instructions = {}, []
    for line in listing.splitlines():
        label = SASS_LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        found = SASS_INSTRUCTION.search(line)
        if found:
            instructions.append(found.group(1))
    for i, text in enumerate(instructions):
        branch = SASS_BRANCH.search(text)
        if branch and labels.get(branch.group(1), i + 1) <= i:
            return instructions[labels[branch.group(1)]:i + 1]
    raise SystemExit("no loop in this kernel's SASS (a backward branch): nothing to count")


def sass_opcodes(loop: list[str]) -> collections.Counter:
    """Opcode (without its modifiers and predicate) -> count over ``loop``."""
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for text in loop)


def disassemble(cubin: bytes) -> str:
    """``nvdisasm -c`` of a cubin, with the nvdisasm that ships with Triton's NVIDIA backend."""
    import os
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as fh:
            fh.write(cubin)
        return subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout


def compile_ptx(module: str, index: int, cc: int, overrides: dict) -> tuple[str, dict, dict]:
    """(PTX, constexprs, options) of ``notebookkit.kernels.<module>.AOT_SPECS[index]`` for ``sm_<cc>``."""
    asm, constexprs, options = compile_spec(module, index, cc, overrides)
    return asm["ptx"], constexprs, options


def compile_spec(module: str, index: int, cc: int, overrides: dict) -> tuple[dict, dict, dict]:
    """(Triton's ``asm`` dict: ``ptx``, ``cubin``, ..., constexprs, options) of ``AOT_SPECS[index]`` for ``sm_<cc>``."""
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
    return compiled.asm, constexprs, options


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
    ap.add_argument("--sass", action="store_true",
                    help="count the SASS of the cubin (ptxas' schedule, what the SM issues) instead of the PTX")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.set:
        name, value = item.split("=", 1)
        overrides[name] = ast.literal_eval(value)
    asm, constexprs, options = compile_spec(args.module, args.index, args.cc, overrides)
    counts = sass_opcodes(sass_hot_loop(disassemble(asm["cubin"]))) if args.sass else opcodes(hot_loop(asm["ptx"]))
    total = sum(counts.values())
    print(f"{args.module} AOT_SPECS[{args.index}] sm_{args.cc}: {total} {'SASS' if args.sass else 'PTX'} instructions "
          "in the loop")
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
