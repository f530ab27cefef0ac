"""The private names of other libraries that notebookkit uses (:mod:`notebookkit.compat`)
still behave as they did on the versions checked: each test fails when an installed version changes."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from notebookkit import compat

from .helpers import random_model, tiny_folder


def test_per_layer_checkpoint_functions_are_what_the_layers_call():
    model = random_model("llama").train()
    calls = []

    def counting(tag):
        def run(function, *args, **kwargs):
            calls.append(tag)
            return checkpoint(function, *args, use_reentrant=False, **kwargs)
        return run

    compat.enable_gradient_checkpointing(model, counting("model"))
    layers = list(model.model.layers)
    assert all(layer.gradient_checkpointing for layer in layers) and model.is_gradient_checkpointing
    compat.set_layer_checkpoint_function(layers[0], counting("first"))
    ids = torch.randint(3, 256, (1, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls == ["first"] + ["model"] * (len(layers) - 1)


def test_attention_implementation_is_the_resolved_one():
    assert compat.attention_implementation(random_model("llama").config) in ("sdpa", "eager")
    from transformers import AutoModelForCausalLM

    from .helpers import family_config

    eager = AutoModelForCausalLM.from_config(family_config("llama"), attn_implementation="eager")
    assert compat.attention_implementation(eager.config) == "eager"
    assert compat.attention_implementation(object()) is None


def test_accelerate_hooks_call_the_forward_kept_in_their_slot():
    from accelerate.hooks import ModelHook, add_hook_to_module

    layer = nn.Linear(4, 3)
    assert not compat.accelerate_wrapped(layer)
    add_hook_to_module(layer, ModelHook())
    assert compat.accelerate_wrapped(layer)
    calls = []
    original = layer.__dict__[compat.ACCELERATE_FORWARD]
    setattr(layer, compat.ACCELERATE_FORWARD, functools.partial(lambda f, x: calls.append(1) or f(x), original))
    layer(torch.ones(2, 4))
    assert calls == [1]  # the hook's wrapper runs whatever the slot holds


def test_generation_config_of_a_call_is_the_models_overlaid_by_the_call():
    """Unset values come from the model's generation config, the call's keywords win, and the
    keywords that are no generation setting come back as model inputs."""
    from transformers import GenerationConfig

    model = random_model("llama")
    model.generation_config.eos_token_id = [3, 4]
    model.generation_config.temperature = 0.5
    mask = torch.ones(1, 3, dtype=torch.long)
    config, model_kwargs = compat.prepare_generation_config(model, None, {"max_new_tokens": 7, "attention_mask": mask})
    assert config.max_new_tokens == 7 and config.eos_token_id == [3, 4] and config.temperature == 0.5
    assert model_kwargs["attention_mask"] is mask and "max_new_tokens" not in model_kwargs
    given = GenerationConfig(max_new_tokens=5, top_k=3)
    config, _ = compat.prepare_generation_config(model, given, {})
    assert (config.max_new_tokens, config.top_k, config.eos_token_id) == (5, 3, [3, 4]) and config is not given


def test_bitsandbytes_cpu_kernel_notice_is_dropped_and_nothing_else():
    """Importing notebookkit.models before PEFT (which imports bitsandbytes) drops bitsandbytes' one notice about
    its CPU 4-bit kernel (printed on AVX512-BF16 CPUs without the ``kernels`` package); other records pass."""
    import logging

    import notebookkit.models  # noqa: F401  (the import that adds the filter; the package is lazy, so a test run alone needs it)
    from notebookkit import compat

    logger = logging.getLogger(compat.BNB_CPU_OPS_LOGGER)
    assert any(isinstance(f, compat._DropBnbCpuKernelNotice) for f in logger.filters)
    make = lambda msg: logging.LogRecord(logger.name, logging.WARNING, __file__, 1, msg, (), None)  # noqa: E731
    assert not logger.filter(make(compat.BNB_CPU_KERNEL_NOTICE + " from kernels-community: %s."))
    assert logger.filter(make("another bitsandbytes warning"))
    code = "import notebookkit.models, peft"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert compat.BNB_CPU_KERNEL_NOTICE not in res.stderr, res.stderr


@pytest.mark.gpu
def test_pinned_host_cache_empties_on_a_cuda_build():
    """On the GPU: this torch has ``torch._C._host_emptyCache`` (the CPU build here has none), and a freed pinned
    block is handed back through it."""
    block = torch.empty(2**20, dtype=torch.uint8, pin_memory=True)
    del block
    assert compat.empty_pinned_host_cache()
