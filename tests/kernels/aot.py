"""Ahead-of-time compile of every Triton kernel in ``notebookkit.kernels`` for given CUDA targets.

Each kernel module registers what to compile in a module-level ``AOT_SPECS`` list of tuples
``(kernel, signature, constexprs[, options])``:

* ``signature``: the runtime (non-constexpr) arguments, name -> Triton type string
  (``"*fp16"``, ``"*bf16"``, ``"*fp32"``, ``"i32"``, ``"i64"``, ``"fp32"``, ...);
* ``constexprs``: name -> value for every ``tl.constexpr`` parameter;
* ``options`` (optional): ``num_warps``, ``num_stages``, and ``targets`` (a list of compute
  capabilities, to restrict a spec, e.g. a bf16 ``tl.dot`` that sm_75 cannot run).

``@triton.jit`` device functions called from registered kernels are found by name; a jitted function
that is neither registered nor called from one fails the test (list deliberate exceptions in
``AOT_HELPERS``).

Compiling needs ``triton.jit`` to return a real ``JITFunction``, which it does not under
``TRITON_INTERPRET=1`` (the kernel tests' setting), so the test runs this file as a script in a
subprocess without that variable: ``python tests/kernels/aot.py --targets 75,90`` prints one JSON
line per (spec, target).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil
import sys
import time
import traceback

KERNEL_PACKAGE = "notebookkit.kernels"
SKIP_MODULES = {"runtime", "testing"}


def kernel_modules() -> list[str]:
    pkg = importlib.import_module(KERNEL_PACKAGE)
    return sorted(
        f"{KERNEL_PACKAGE}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__) if m.name not in SKIP_MODULES
    )


def _jit_name(fn) -> str:
    inner = getattr(fn, "fn", fn)
    return getattr(inner, "__name__", repr(fn))


def _normalise(spec) -> tuple:
    if isinstance(spec, dict):
        return spec["kernel"], spec["signature"], spec.get("constexprs", {}), spec.get("options", {})
    if len(spec) == 3:
        return (*spec, {})
    return tuple(spec)


def import_errors() -> dict[str, str]:
    """Kernel modules that fail to import -> the error (their kernels cannot be collected)."""
    errors = {}
    for modname in kernel_modules():
        try:
            importlib.import_module(modname)
        except Exception as exc:
            errors[modname] = f"{type(exc).__name__}: {exc}"
    return errors


def _modules():
    for modname in kernel_modules():
        try:
            yield modname, importlib.import_module(modname)
        except Exception:
            continue  # reported by import_errors()


def collect_specs() -> list[tuple[str, object, dict, dict, dict]]:
    """``[(spec_id, kernel, signature, constexprs, options)]`` over all kernel modules, in a stable order."""
    out = []
    for modname, mod in _modules():
        for i, spec in enumerate(getattr(mod, "AOT_SPECS", [])):
            kernel, signature, constexprs, options = _normalise(spec)
            const = ",".join(f"{k}={v}" for k, v in constexprs.items())
            types = sorted({v for v in signature.values() if v.startswith("*")})
            spec_id = f"{modname.rsplit('.', 1)[1]}.{_jit_name(kernel)}#{i}[{'/'.join(types)}|{const}]"
            out.append((spec_id, kernel, signature, constexprs, options))
    return out


def _source(fn) -> str:
    try:
        return inspect.getsource(getattr(fn, "fn", fn))
    except (OSError, TypeError):
        return ""


def uncovered_kernels() -> dict[str, list[str]]:
    """Module -> ``@triton.jit`` functions defined there that no AOT spec compiles.

    A function is covered when a spec names it, when ``AOT_HELPERS`` lists it, or when it is called
    (by name) from a covered function of the same module, i.e. it is a device function compiled
    into a registered kernel.
    """
    missing = {}
    for modname, mod in _modules():
        jitted = {
            name: obj for name, obj in vars(mod).items()
            if type(obj).__name__ in ("JITFunction", "InterpretedFunction")
            and getattr(getattr(obj, "fn", None), "__module__", modname) == modname
        }
        covered = {_jit_name(_normalise(s)[0]) for s in getattr(mod, "AOT_SPECS", [])}
        covered |= set(getattr(mod, "AOT_HELPERS", []))
        grew = True
        while grew:
            grew = False
            sources = "\n".join(_source(jitted[n]) for n in covered if n in jitted)
            for name in set(jitted) - covered:
                if f"{name}(" in sources:
                    covered.add(name)
                    grew = True
        gaps = sorted(set(jitted) - covered)
        if gaps:
            missing[modname] = gaps
    return missing


def _ast_source(kernel, signature: dict, constexprs: dict):
    """Build an ``ASTSource`` in the format of the installed Triton (3.2+ and 3.0/3.1 differ)."""
    from triton.compiler import ASTSource

    params = inspect.signature(ASTSource.__init__).parameters
    if "constexprs" in params:  # triton >= 3.2: named signature including the constexprs
        full = {}
        for name in kernel.arg_names:
            if name in constexprs:
                full[name] = "constexpr"
            elif name in signature:
                full[name] = signature[name]
            else:
                raise KeyError(f"AOT spec for {kernel.__name__} gives no type for argument {name!r}")
        return ASTSource(kernel, full, constexprs)
    # triton 3.0/3.1: positional signature of runtime arguments, constants by position
    sig = {i: signature[n] for i, n in enumerate(kernel.arg_names) if n not in constexprs}
    consts = {kernel.arg_names.index(n): v for n, v in constexprs.items()}
    return ASTSource(kernel, sig, consts)


def compile_all(targets: list[int]) -> int:
    import triton
    from triton.backends.compiler import GPUTarget

    failures = 0
    for spec_id, kernel, signature, constexprs, options in collect_specs():
        options = dict(options)
        only = options.pop("targets", None)
        for cc in targets:
            record = {"id": spec_id, "cc": cc}
            if only is not None and cc not in only:
                record.update(ok=True, skipped=True)
                print(json.dumps(record), flush=True)
                continue
            t0 = time.perf_counter()
            try:
                src = _ast_source(kernel, signature, constexprs)
                compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options or None)
                asm = compiled.asm
                record.update(ok=True, ptx_chars=len(asm.get("ptx", "")), cubin_bytes=len(asm.get("cubin", b"")))
            except Exception as exc:  # report and keep going: one bad kernel must not hide the others
                failures += 1
                record.update(ok=False, error=f"{type(exc).__name__}: {exc}"[-2000:], tb=traceback.format_exc()[-3000:])
            record["seconds"] = round(time.perf_counter() - t0, 3)
            print(json.dumps(record), flush=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="75,90", help="comma-separated CUDA compute capabilities")
    args = parser.parse_args(argv)
    compile_all([int(t) for t in args.targets.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
