"""The memory model reads what models/ set up on a model (``notebookkit.memory.model_setup``): its
activation plan, the FP8 forward and the fused LM head, through every change models/ makes."""

from __future__ import annotations

from notebookkit.memory.estimate import activation_plan_of, estimate_kwargs_from_model
from notebookkit.models import patch_model, unpatch_model
from notebookkit.models.patching.checkpointing import apply_checkpointing
from notebookkit.models.patching.lora_fast_path import set_fp8_base_matmul

from .helpers import random_model
from .test_patch_parity import _lora


def test_the_estimate_follows_what_the_model_runs():
    model = random_model("llama")
    assert estimate_kwargs_from_model(model)["fused_loss"] is False  # stock head: full logits
    assert activation_plan_of(model) == "keep"
    patch_model(model)
    model = _lora(model)
    assert "fused_loss" not in estimate_kwargs_from_model(model)  # the fused head: the default
    apply_checkpointing(model, ["offload", "keep"])
    assert activation_plan_of(model) == ["recompute", "keep"]  # offload needs CUDA: recompute on CPU
    apply_checkpointing(model, False)
    assert activation_plan_of(model) == "keep"
    assert "fp8_forward" not in estimate_kwargs_from_model(model)
    set_fp8_base_matmul(model, True)
    assert estimate_kwargs_from_model(model)["fp8_forward"] is True
    set_fp8_base_matmul(model, False)
    assert "fp8_forward" not in estimate_kwargs_from_model(model)
    unpatch_model(model)
    assert estimate_kwargs_from_model(model)["fused_loss"] is False
