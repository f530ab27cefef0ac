"""On the GPU: the memory model's cuBLAS workspace term is what PyTorch's allocator adds for a stream's first
matmul (``benchmarks/cublas_workspace.py``, in a fresh process: a worker of the suite has its workspaces already)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_the_modelled_workspace_is_the_allocators():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cublas_workspace.py")], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 0 and "matches" in run.stdout, run.stdout + run.stderr
