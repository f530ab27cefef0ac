"""A training step on the fused path reads no tensor value on the host from notebookkit's code.

On CUDA every such read (``bool(t)``, ``t.item()``, ``t.tolist()``, ...) waits for the GPU to drain
its queue, so the host can no longer run ahead and the GPU idles while the next kernels are
launched. This CPU test records the reads made directly from ``notebookkit/`` during a forward with
labels (fused linear cross-entropy), backward and optimizer step, with gradient checkpointing, and
expects none. Hugging Face's own reads (its packed-sequence check) are outside notebookkit.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import notebookkit
from notebookkit.models import patch_model
from notebookkit.models.patching.checkpointing import apply_checkpointing

from .helpers import random_model
from .test_patch_parity import _lora

_PACKAGE = os.path.dirname(os.path.abspath(notebookkit.__file__))
_READS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_training_step_reads_no_tensor_on_the_host(family, monkeypatch):
    model = random_model(family)
    patch_model(model)
    model = _lora(model)
    model.train()
    apply_checkpointing(model, "recompute")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # first step: lazy set-up may inspect tensors once
    reads = []
    for name in _READS:
        real = getattr(torch.Tensor, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(_PACKAGE) and not caller.endswith("testing.py"):
                reads.append(f"{_name} from {os.path.relpath(caller, _PACKAGE)}:{sys._getframe(1).f_lineno}")
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    step()
    assert reads == []
