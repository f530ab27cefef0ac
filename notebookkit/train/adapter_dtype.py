"""Keep LoRA adapters in fp32 when a trainer runs fp16 mixed precision (the T4's only choice).

fp16 training uses ``torch.amp.GradScaler``: the loss is multiplied by a scale ``S`` (65536 at
first), gradients come out scaled, and before the optimizer step they are divided by ``S`` and
checked for inf/NaN. PyTorch's unscale refuses 16-bit gradients ("Attempting to unscale FP16
gradients") and has no bf16 kernel at all, so the trainable parameters must be fp32: the master
weights of mixed precision.

TRL 1.16's ``SFTTrainer`` (and the trainers that share its setup) casts the trainable parameters of
every *quantised* model to bf16 at construction, whatever the precision flags say (the QLoRA paper's
recommendation, written for bf16 cards). With ``fp16=True`` the first optimizer step then fails
inside ``GradScaler.unscale_`` with ``"_amp_foreach_non_finite_check_and_unscale_cuda" not
implemented for 'BFloat16'``. notebookkit's trainers call :func:`keep_fp32_adapters_under_fp16`
after TRL's constructor: under ``fp16=True`` every trainable 16-bit parameter goes back to fp32 (its
values are those TRL rounded to bf16, a relative change of at most 2^-9; the optimizer has not
been built yet, so it sees the fp32 tensors). bf16 training keeps TRL's choice.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["keep_fp32_adapters_under_fp16"]


def keep_fp32_adapters_under_fp16(trainer: Any) -> int:
    """Cast the trainable 16-bit parameters of ``trainer.model`` to fp32 when ``trainer.args.fp16``
    is set; returns how many were cast (0 when fp16 is off or they already are fp32)."""
    if not getattr(trainer.args, "fp16", False):
        return 0
    cast = 0
    for param in trainer.model.parameters():
        if param.requires_grad and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.float()
            cast += 1
    return cast
