"""Mixture-of-experts models loaded with ``load_in_4bit=True``: the stacked expert weights in NF4
(``notebookkit.base_layers.nf4_experts``), read by the grouped expert kernel, against Hugging Face + PEFT on
the dequantised weights.

The tiny defaults of each family (the embedded ``notebookkit/tiny-qwen3_moe`` / ``tiny-gpt_oss``), fp32 on CPU:

* every stacked expert weight is an ``NF4ExpertParam`` whose codes and nested scales are the NF4 format's
  for the 16-bit weight (``tests/nf4_format.assert_packing_is_nearest_level``), the 16-bit copy is gone,
  PEFT wraps it with the same factor shapes as the 16-bit weight, and the fused experts run (no fallback);
* the loss and every LoRA gradient (attention, both stacked weights; random ``B`` so each adapter matters)
  equal those of the oracle: a deep copy on stock code with every 4-bit linear and every NF4 expert weight
  replaced by its decode by the format's definition (``tests/nf4_format.py``), adapted by PEFT with the same
  config and factors: on the default path (the kernels' references) and on the Triton kernels under the
  interpreter;
* a few training steps lower the loss; the adapters save as PEFT's and reload onto the 4-bit model with the
  same logits; stock code on NF4 experts is refused with what to change.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("bitsandbytes")

from notebookkit.base_layers.nf4_experts import NF4ExpertParam  # noqa: E402
from notebookkit.families import FAMILIES as FAMILY_RECORDS  # noqa: E402
from notebookkit.kernels.runtime import interpreter_on, use_triton  # noqa: E402
from notebookkit.kernels.testing import rel_err  # noqa: E402
from notebookkit.models import FastLanguageModel, unpatch_model  # noqa: E402
from notebookkit.models.patching.patch_moe import experts_status, unwrap_experts  # noqa: E402
from tests.nf4_format import (assert_packing_is_nearest_level, decode_nf4_by_definition,  # noqa: E402
                              replace_4bit_layers_by_dense)

from .helpers import MOE_FAMILIES, assert_moe_lora_grads_match, tiny_folder, train_losses  # noqa: E402

PATHS = ["reference",
         pytest.param("triton", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1"))]


def _load(family):
    model, _ = FastLanguageModel.from_pretrained(tiny_folder(family), max_seq_length=64, dtype=torch.float32,
                                                 load_in_4bit=True, show_banner=False)
    return model


def _experts(model):
    return [unwrap_experts(layer.mlp.experts)[0] for layer in model.get_base_model().model.layers] \
        if hasattr(model, "get_base_model") else [layer.mlp.experts for layer in model.model.layers]


def _dense_twin(model):
    """The 4-bit model on stock code with every NF4 weight (linears and experts) decoded by the format's
    definition into a dense fp32 parameter."""
    twin = copy.deepcopy(model)
    unpatch_model(twin, keep_nf4_decode=False)
    assert replace_4bit_layers_by_dense(twin) > 0
    for experts in _experts(twin):
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name)
            assert isinstance(p, NF4ExpertParam)
            dense = decode_nf4_by_definition(p.data, p.quant_state, out_dtype=torch.float32)
            setattr(experts, name, torch.nn.Parameter(dense, requires_grad=False))
    return twin


def _batch(vocab, batch=2, seq=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, seq - 3:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _adapted_pair(family):
    """(4-bit model + notebookkit's get_peft_model, dense twin + PEFT with the same config and factors)."""
    import peft

    model = _load(family)
    twin = _dense_twin(model)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False,
                                             show_banner=False)
    twin = peft.get_peft_model(twin, copy.deepcopy(model.peft_config["default"]))
    g = torch.Generator().manual_seed(1)
    ours = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if "lora_" in name:
                assert ours[name].shape == p.shape, name
                ours[name].copy_(torch.randn(p.shape, generator=g) * 0.05)
                p.copy_(ours[name])
    return model, twin


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_experts_are_nf4_in_the_format_and_peft_wraps_them(family, one_thread):
    model = _load(family)
    assert model.notebookkit_banner.is_on("NF4 experts"), str(model.notebookkit_banner)
    moe = FAMILY_RECORDS[family].moe
    for i, experts in enumerate(_experts(model)):
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name)
            assert isinstance(p, NF4ExpertParam) and p.dtype == torch.uint8 and not p.requires_grad
            assert p.numel() == p.ds_shape.numel() // 2  # 4 bits an element: the 16-bit tensor is gone
            assert p.quant_state.state2 is not None and p.quant_state.blocksize == 64
            if i == 0:  # the codes and scales are the format's for the 16-bit checkpoint weight
                from transformers import AutoModelForCausalLM

                plain = AutoModelForCausalLM.from_pretrained(tiny_folder(family), dtype=torch.float32)
                w = getattr(plain.model.layers[0].mlp.experts, name)
                assert tuple(w.shape) == tuple(p.ds_shape)
                assert_packing_is_nearest_level(w, p.data, p.quant_state)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False,
                                             show_banner=False)
    for layer in model.get_base_model().model.layers:
        assert experts_status(layer.mlp, moe) is None
        base, wrappers = unwrap_experts(layer.mlp.experts)
        for name, wrapper in wrappers.items():
            E, a, b = getattr(base, name).ds_shape
            fan_in, fan_out = (a, b) if moe.transposed else (b, a)
            assert wrapper.lora_A["default"].weight.shape == (wrapper.r["default"] * E, fan_in)
            assert wrapper.lora_B["default"].weight.shape == (fan_out, wrapper.r["default"] * E)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_loss_and_lora_gradients_match_peft_on_the_dequantised_weights(family, path, one_thread):
    model, twin = _adapted_pair(family)
    batch = _batch(model.config.vocab_size, seq=6 if path == "triton" else 12)
    model.train()
    twin.train()
    with use_triton(path == "triton"):
        out = model(**batch)
        out.loss.backward()
    want = twin(**batch)
    want.loss.backward()
    assert abs(out.loss.item() - want.loss.item()) <= 1e-5 * abs(want.loss.item())
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ref = {n: p.grad for n, p in twin.named_parameters() if p.requires_grad}
    assert_moe_lora_grads_match(got, ref, model.config.num_hidden_layers)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_training_lowers_the_loss_and_adapters_reload(family, tmp_path, one_thread):
    from peft import PeftModel

    model = _load(family)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False,
                                             show_banner=False)
    batches = [_batch(model.config.vocab_size, seq=16)]
    losses = train_losses(model, batches, steps=6, lr=1e-2)
    assert losses[-1] < 0.9 * losses[0], losses
    model.save_pretrained(tmp_path)
    saved = __import__("safetensors.torch", fromlist=["load_file"]).load_file(tmp_path / "adapter_model.safetensors")
    assert any("experts" in k for k in saved) and not any("proj" in k and "lora" not in k for k in saved)
    model.eval()
    ids = batches[0]["input_ids"]
    with torch.no_grad():
        want = model(input_ids=ids).logits
        again = PeftModel.from_pretrained(_load(family), tmp_path)
        got = again(input_ids=ids).logits
    assert rel_err(got, want) <= 1e-6


def test_stock_code_on_nf4_experts_is_refused(one_thread):
    """An adapter the fused experts do not take (a second active adapter) would send the block to PEFT's own
    ``W + s B A`` on dense weights, which NF4 experts are not: the forward says why and what to change."""
    model = _load("qwen3_moe")
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False,
                                             show_banner=False)
    config = copy.deepcopy(model.peft_config["default"])
    model.add_adapter("second", config)
    model.base_model.set_adapter(["default", "second"])
    with pytest.raises(RuntimeError, match="loaded in NF4.*cannot use it: .*adapter.*load_in_4bit=False"):
        model(input_ids=torch.tensor([[5, 6, 7]]))


def test_merged_export_of_nf4_experts_is_refused(tmp_path, one_thread):
    model = FastLanguageModel.get_peft_model(_load("gpt_oss"), r=4, lora_alpha=8, use_gradient_checkpointing=False,
                                             show_banner=False)
    with pytest.raises(NotImplementedError, match="expert weights are in NF4.*load_in_4bit=False"):
        model.save_pretrained_merged(str(tmp_path / "merged"), None, save_method="merged_16bit")
