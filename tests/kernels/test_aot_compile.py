"""T4 readiness without a T4: every Triton kernel compiles ahead of time for sm_75 and sm_90.

Kernel modules register their kernels in ``AOT_SPECS`` (see ``tests/kernels/aot.py``). The compile
runs once, in one subprocess without ``TRITON_INTERPRET`` (under the interpreter ``triton.jit``
returns an ``InterpretedFunction`` that cannot be compiled), with a fresh Triton cache, so nothing
is reused across runs. Each (spec, target) pair is its own test case.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TARGETS = (75, 90)
_AOT_PATH = Path(__file__).with_name("aot.py")
_REPO = Path(__file__).resolve().parents[2]


def _load_aot():
    spec = importlib.util.spec_from_file_location("notebookkit_tests_aot", _AOT_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


aot = _load_aot()
SPEC_IDS = [spec[0] for spec in aot.collect_specs()]
# (spec, target) cases: a spec that names its targets (FP8 kernels: sm_89+ only) is compiled for those.
CASES = [
    (spec_id, cc)
    for spec_id, _kernel, _sig, _consts, options in aot.collect_specs()
    for cc in TARGETS
    if cc in (options or {}).get("targets", TARGETS)
]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[tuple[str, int], dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default; set only to silence triton 3.9's notice
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(_AOT_PATH), "--targets", ",".join(map(str, TARGETS))],
        cwd=_REPO, env=env, capture_output=True, text=True, timeout=1800,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[(record["id"], record["cc"])] = record
    if proc.returncode != 0 and not results:
        pytest.fail(f"AOT compile subprocess failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    results["__stderr__"] = proc.stderr
    return results


def test_kernel_modules_import():
    errors = aot.import_errors()
    assert not errors, f"kernel modules that fail to import (their kernels were not compiled): {errors}"


def test_every_kernel_is_registered():
    missing = aot.uncovered_kernels()
    assert not missing, (
        "these @triton.jit functions have no AOT_SPECS entry (add (kernel, signature, constexprs, options) "
        f"to the module's AOT_SPECS, or list device-only helpers in AOT_HELPERS): {missing}"
    )


def test_specs_found():
    assert SPEC_IDS, "no AOT_SPECS found in notebookkit.kernels"
    assert len(set(SPEC_IDS)) == len(SPEC_IDS)
    assert {cc for _, cc in CASES} == set(TARGETS)  # every target has kernels to compile


@pytest.mark.parametrize("spec_id,cc", CASES, ids=[f"{s}-sm{cc}" for s, cc in CASES])
def test_compiles_for_cuda_target(compiled, spec_id: str, cc: int):
    record = compiled.get((spec_id, cc))
    assert record is not None, f"no result for {spec_id} on sm_{cc}; stderr:\n{compiled['__stderr__'][-3000:]}"
    assert not record.get("skipped"), f"{spec_id} was not compiled for sm_{cc}"
    assert record["ok"], f"{spec_id} failed to compile for sm_{cc}: {record['error']}\n{record.get('tb', '')}"
    assert record["ptx_chars"] > 0 and record["cubin_bytes"] > 0
