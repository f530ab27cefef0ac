"""benchmarks/step_flops.py: the matmul work of a step by plan, against the matmuls the fused path runs.

A tiny Llama trains one step on the CPU (the kernels' PyTorch references, the same GEMMs as on the GPU) under a
dispatch mode that adds ``2 m k n`` for every ``mm`` and ``addmm_`` (the attention runs in SDPA and is left out:
the model's attention term is the standard count). Each activation mode's projections, recompute included, must
be what ``step_work`` says to the FLOP."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import step_flops  # noqa: E402


class MatmulFlops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "mm":
            a, b = args[0], args[1]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        elif name in ("addmm_", "addmm"):
            a, b = args[1], args[2]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("checkpointing,mode", [(False, "keep"), (True, "recompute"), ("offload_mlp", "offload_mlp")])
def test_step_work_is_the_matmuls_the_fused_path_runs(checkpointing, mode):
    from notebookkit import FastLanguageModel
    from notebookkit.memory.shapes import model_shape

    model, _ = FastLanguageModel.from_pretrained("notebookkit/tiny-llama", dtype=torch.float32, show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=checkpointing,
                                             show_banner=False).train()
    batch, seq = 2, 24
    ids = torch.randint(5, 500, (batch, seq), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()  # warm: adapter casts and groups are built once
    counter = MatmulFlops()
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    shape = model_shape(model.config)
    work = step_flops.step_work(shape, batch_size=batch, seq_len=seq, plan=(mode,) * shape.num_layers, r=8)
    assert counter.flops == work.projections + work.lm_head
    if mode != "keep":  # the recompute is there, and it skips the down projection (and gate/up when parked)
        whole = step_flops.step_work(shape, batch_size=batch, seq_len=seq, plan=(mode,) * shape.num_layers, r=8,
                                     recompute_whole=True)
        assert 0 < work.recompute < whole.recompute


def test_the_ceilings_of_issue_34s_rows():
    """Spread among kept layers, the T4 emulation's plan parks every offloaded layer: less work than the same
    layers offloaded first; the bf16 row at Unsloth's peak sits near 1.2x, whatever the efficiency."""
    text = step_flops.table()
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()[2:]}
    ceiling = {k: float(v.split(" | ")[4].rstrip("x")) for k, v in rows.items()}
    front, spread = ceiling["8B NF4 4096x1 T4 emulation, auto (front)"], \
        ceiling["8B NF4 4096x1 T4 emulation, layout='spread'"]
    assert 1.25 < front < spread < 1.45
    assert 1.15 < ceiling["8B NF4 4096x2 bf16, at <= Unsloth's peak"] < 1.25
    assert step_flops.plan_of(("spread", 16, 0, 16), 32).count("offload_mlp") == 16
