"""The mixture-of-experts families (Qwen3-MoE, gpt-oss) on the fused path, against plain transformers + PEFT.

fp32 on CPU, small random models of each family (``helpers.random_model``: 8 / 4 experts, top-2) with LoRA
on the attention projections and on the experts' stacked weights (PEFT's ``target_parameters``, random
``B`` so every adapter matters), the routers' load-balancing loss switched on, a right-padded batch:

* the loss (cross-entropy + ``router_aux_loss_coef * aux``), ``aux_loss`` and every LoRA gradient, on the
  default path (the kernels' PyTorch references), with every layer recomputed in the backward (gradient
  checkpointing) and with the Triton kernels under the interpreter;
  gpt-oss at a small ``swiglu_limit``, so the clamps of its activation bind;
* a few training steps of the tiny default model through ``FastLanguageModel`` (the experts adapted
  because the default targets name the MLP) in which the loss falls, and the adapters saved by PEFT
  reload onto a plain Hugging Face model with the same logits;
* decode plans the sparse blocks (its parity with Hugging Face's ``generate``:
  ``tests/models/generation/test_moe_decode.py``);
* what does not cover MoE yet says so: the memory estimate of DPO's reference pass, 2-bit / ternary
  loading (the memory model's MoE terms: ``tests/memory/test_moe_memory.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from notebookkit.families import FAMILIES as FAMILY_RECORDS
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import rel_err
from notebookkit.models import FastLanguageModel
from notebookkit.models.patching.patch_moe import experts_status
from notebookkit.models.patching.patcher import patch_model, patch_summary

from .helpers import MOE_FAMILIES, assert_moe_lora_grads_match, random_model, tiny_folder, train_losses

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _models(family: str):
    """(patched + PEFT, plain HF + PEFT) on the same weights and the same random adapters."""
    import peft

    overrides = {"output_router_logits": True}
    if family == "gpt_oss":
        overrides["swiglu_limit"] = 0.1  # the clamps bind on these weights (checked below)
    ref = random_model(family, **overrides)
    ours = copy.deepcopy(ref)
    patch_model(ours)
    wrapped = []
    for model in (ours, ref):
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, target_parameters=EXPERTS,
                                 init_lora_weights=False)
        torch.manual_seed(1)
        wrapped.append(peft.get_peft_model(model, config))
    return wrapped


def _batch(vocab: int = 300, batch: int = 2, seq: int = 11):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, seq - 3:] = 0  # a padded row: the aux loss counts real tokens only
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss_and_grads(model, batch):
    model.train()
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out, grads


PATHS = ["reference", "recompute",
         pytest.param("triton", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1"))]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_loss_and_every_lora_gradient_match_peft(family, path, one_thread):
    """``recompute``: with gradient checkpointing on every layer, which must keep the aux loss's gradient."""
    from notebookkit.models.patching.checkpointing import apply_checkpointing

    ours, ref = _models(family)
    if path == "recompute":
        assert apply_checkpointing(ours, True) == "recompute"
    assert patch_summary(ours)["moe"] == ours.config.num_hidden_layers
    for layer in ours.base_model.model.model.layers:  # the fused experts run, not PEFT's fallback
        assert experts_status(layer.mlp, FAMILY_RECORDS[family].moe) is None
    if family == "gpt_oss":
        experts = ref.base_model.model.model.layers[0].mlp.experts.base_layer.base_layer
        x = torch.randn(64, experts.gate_up_proj.shape[1])
        gu = torch.einsum("th,ehi->eti", x, experts.gate_up_proj)
        assert (gu[..., 0::2] > 0.1).any() and (gu[..., 1::2].abs() > 0.1).any()
    batch = _batch(seq=6 if path == "triton" else 11)
    with use_triton(path == "triton"):
        out, grads = _loss_and_grads(ours, batch)
    want, want_grads = _loss_and_grads(ref, batch)
    assert out.aux_loss is not None and torch.allclose(out.aux_loss, want.aux_loss, rtol=1e-5)
    assert abs(out.loss.item() - want.loss.item()) <= 1e-5 * abs(want.loss.item())
    # attention (4 projections x A, B) and experts (2 stacked weights x A, B), every layer
    assert len(grads) == 12 * ours.config.num_hidden_layers
    assert_moe_lora_grads_match(grads, want_grads, ours.config.num_hidden_layers)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_training_lowers_the_loss_and_adapters_reload(family, tmp_path, one_thread):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = tiny_folder(family)
    model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=64, dtype=torch.float32, load_in_4bit=False,
                                                 show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False,
                                             show_banner=False)
    assert model.notebookkit_banner.is_on("MoE experts"), str(model.notebookkit_banner)
    assert model.notebookkit_banner.is_on("LoRA fast path")
    # the experts are adapted: by PEFT's own mapping of gate/up/down onto them (Qwen3-MoE), by notebookkit's
    # target_parameters (gpt-oss, where PEFT would leave the MLP without adapters)
    wanted = {"down_proj", "gate_up_proj"} if FAMILY_RECORDS[family].moe.peft_maps_mlp_targets else set(EXPERTS)
    assert set(model.peft_config["default"].target_parameters) == wanted
    for layer in model.base_model.model.model.layers:
        assert experts_status(layer.mlp, FAMILY_RECORDS[family].moe) is None
    batches = [_batch(model.config.vocab_size, batch=2, seq=16)]
    losses = train_losses(model, batches, steps=6, lr=1e-2)
    assert losses[-1] < 0.9 * losses[0], losses

    model.save_pretrained(tmp_path)
    saved = __import__("safetensors.torch", fromlist=["load_file"]).load_file(tmp_path / "adapter_model.safetensors")
    assert any("experts" in k for k in saved), sorted(saved)
    model.eval()
    ids = batches[0]["input_ids"]
    with torch.no_grad():
        want = model(input_ids=ids).logits
        plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tmp_path)
        got = plain(input_ids=ids).logits
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_decode_plans_every_sparse_block(family):
    from notebookkit.models.generation.decoder_plan import DecoderPlan, plan_for

    plan = plan_for(random_model(family))
    assert isinstance(plan, DecoderPlan), plan
    assert [lp.moe for lp in plan.layers] == [FAMILY_RECORDS[family].moe] * len(plan.layers)
    assert all((lp.sinks is not None) == (family == "gpt_oss") for lp in plan.layers)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_what_does_not_cover_moe_says_so(family):
    from notebookkit.memory.estimate import estimate_training_memory

    model = random_model(family)
    assert estimate_training_memory(model.config, seq_len=64).total > 0
    assert estimate_training_memory(model.config, seq_len=64, method="dpo").total > 0  # covered since s25
    with pytest.raises(ValueError, match="mixture of experts.*lora_dropout=0.1 PEFT refuses"):
        estimate_training_memory(model.config, seq_len=64, lora_dropout=0.1)
    with pytest.raises(ValueError, match="2-bit and ternary bases do not cover mixture-of-experts"):
        FastLanguageModel.from_pretrained(tiny_folder(family), load_in_2bit=True, show_banner=False)


def test_recomputed_gpt_oss_makes_each_boolean_mask_once(monkeypatch, one_thread):
    """gpt-oss with every layer recomputed (torch's checkpoint, re-entering the forward pass:
    ``checkpointing.checkpoint_in_pass``) turns each of Hugging Face's two masks (full, sliding window) into a
    boolean one once in the whole step, its forward and its four recomputes: the layers share them."""
    import notebookkit.models.patching.patch_attention as patch_attention
    from notebookkit.models.patching.checkpointing import apply_checkpointing

    model = random_model("gpt_oss", num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
    patch_model(model)
    assert apply_checkpointing(model, True) == "recompute"
    made = []
    as_bool = patch_attention._as_bool_mask
    monkeypatch.setattr(patch_attention, "_as_bool_mask", lambda *args: made.append(args[0]) or as_bool(*args))
    model.train()
    model(**_batch()).loss.backward()
    assert len(made) == 2 and made[0] is not made[1], len(made)
