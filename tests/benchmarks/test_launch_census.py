"""``benchmarks/launch_census.py``'s counting rule on a made-up step: one launch a Triton kernel (not the
interpreter's own tensor work inside it), one an aten op that launches a kernel, none for views and allocations."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))

import launch_census  # noqa: E402

from notebookkit.kernels.runtime import interpreter_on, use_triton  # noqa: E402
from notebookkit.kernels.scale_in_place import scale_in_place  # noqa: E402


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
def test_a_step_counts_kernels_and_ops_not_views():
    x = torch.randn(8, 16)
    groups = torch.randn(3, 16, 4)
    offsets = torch.tensor([2, 5, 8], dtype=torch.int32)

    def step():
        y = x.view(16, 8).t().t().view(8, 16) * 2.0  # views: none; the product: one
        buffer = torch.empty(4)  # an allocation: none
        scale_in_place(y, torch.tensor(0.5))  # a Triton launch (the fp32 factor needs no cast)
        z = torch.nn.functional.grouped_mm(y, groups, offs=offsets) if hasattr(torch.nn.functional, "grouped_mm") \
            else torch._grouped_mm(y, groups, offs=offsets)  # one
        return y.sum() + z.sum() + buffer.numel()

    with use_triton(True):
        result, launches = launch_census.count_launches(step)
    assert torch.isfinite(result)
    assert launches.triton == {"_scale_in_place_kernel": 1}
    assert launches.aten == {"mul": 1, "_grouped_mm": 1, "sum": 2, "add": 2}
    assert launches.total == sum(launches.aten.values()) + 1
