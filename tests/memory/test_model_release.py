"""Memory a loaded model holds: the dtypes it keeps, and that ``del model`` gives it all back.

* After ``from_pretrained(load_in_4bit=True)`` + ``get_peft_model`` the decoder projections are
  packed NF4 (uint8), the LoRA matrices fp32 and trainable, and everything else (embeddings,
  LM head, norms) stays in the 16-bit compute dtype: no ``prepare_model_for_kbit_training``-style
  fp32 upcast, which would double the embeddings (0.5 GiB more for a 128k x 2048 table).
* A patched model holds no reference cycle, so dropping the last reference frees its weights at
  once, without waiting for Python's cycle collector. (A rebound forward kept as a bound method in
  the module's own ``__dict__`` made such a cycle: on the GPU, four models measured one after the
  other each found the previous ones' weights still allocated.)
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch


def _load(load_in_4bit: bool, checkpointing):
    from notebookkit import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained("notebookkit/tiny-llama", max_seq_length=32, dtype=torch.bfloat16,
                                                 load_in_4bit=load_in_4bit, show_banner=False)
    return FastLanguageModel.get_peft_model(model, r=8, lora_alpha=8, use_gradient_checkpointing=checkpointing,
                                            show_banner=False)


def test_nf4_model_keeps_16_bit_embeddings_norms_and_fp32_adapters_only():
    model = _load(True, True)
    seen = set()
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.dtype == torch.float32 and p.requires_grad, name
            seen.add("lora")
        elif type(p).__name__ == "Params4bit":
            assert p.dtype == torch.uint8 and not p.requires_grad, name
            seen.add("nf4")
        else:
            assert p.dtype == torch.bfloat16 and not p.requires_grad, (name, p.dtype)
            seen.add("16-bit")
    assert seen == {"lora", "nf4", "16-bit"}


@pytest.mark.parametrize("load_in_4bit,checkpointing", [(False, False), (False, True), (True, True)])
def test_del_model_frees_it_without_the_cycle_collector(load_in_4bit, checkpointing):
    model = _load(load_in_4bit, checkpointing).train()
    ids = torch.randint(0, 256, (2, 16))
    opt_params = [p for p in model.parameters() if p.requires_grad]
    model(input_ids=ids, labels=ids).loss.backward()
    for p in opt_params:
        p.grad = None
    del opt_params
    embeddings = weakref.ref(model.get_input_embeddings().weight)
    attention = weakref.ref(model.get_base_model().model.layers[0].self_attn)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del model
        assert embeddings() is None and attention() is None, "the model is kept alive by a reference cycle"
    finally:
        if enabled:
            gc.enable()
