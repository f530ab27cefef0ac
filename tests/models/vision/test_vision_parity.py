"""Parity of FastVisionModel's fused path against plain transformers + PEFT (CPU, fp32, the tiny VLMs).

Same weights (the family's tiny VLM), same LoRA targets (the four finetune_* switches on: attention
and MLP layers of the vision tower, its projector and the decoder), same LoRA initialisation seed,
same batches (bundled caption rows through VisionDataCollator: real pixel inputs, answer-only
labels), 10 AdamW steps:

* per-step losses within 1e-4 relative;
* the LoRA gradients of every adapted layer, vision and language, within 1e-4 relative each: at the
  first step (only the ``lora_B`` gradients are non-zero there: ``B`` starts at zero, so
  ``dL/dA = 0``), and at the reference's final LoRA weights, copied into both models (every
  gradient non-zero; the same point for both, so the trajectories' drift over 10 Adam steps, which
  amplifies rounding differences, is not mistaken for a gradient difference);
* the final LoRA weights within 1e-3 relative.

What differs between the two runs is the order of floating-point operations (the fused kernels'
references on CPU, the fused cross-entropy, SDPA with ``is_causal`` against an explicit mask): in
fp32 the losses agree to about 1e-7 and the gradients to about 1e-6 (measured on this machine), so
the bounds leave two decades for other CPUs. A gradient that is all zero on either side fails
(``rel_err`` of an empty update against a real one is 1.0), and NaN never passes.
4-bit: the same run with NF4 base weights; the reference replaces each 4-bit layer by a dense one
holding its weight decoded from the NF4 definition (``tests/nf4_format.py``), never bitsandbytes'
CPU decode.
"""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.testing import rel_err
from notebookkit.models import FastVisionModel
from notebookkit.models.patching.patcher import patch_summary
from notebookkit.models.vision.targets import select_targets, tower_of

from .conftest import VISION

STEPS = 10
R, ALPHA, SEED, LR = 8, 16, 3407, 5e-3


def _targets(folder: str, family: str) -> list[str]:
    import transformers as tf

    model = getattr(tf, VISION[family].model_class).from_pretrained(folder, dtype=torch.float32)
    return select_targets(model, VISION[family]).names


def reference(folder: str, family: str, names: list[str], load_in_4bit: bool, dtype=torch.float32, device=None):
    import transformers as tf
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig

    kw = {}
    if load_in_4bit:
        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_use_double_quant=True,
                                                       bnb_4bit_compute_dtype=dtype,
                                                       bnb_4bit_quant_storage=torch.uint8)
    if device is not None:
        kw["device_map"] = {"": device}
    model = getattr(tf, VISION[family].model_class).from_pretrained(folder, dtype=dtype, **kw)
    if load_in_4bit and device is None:  # on the CPU: the NF4 definition, never bitsandbytes' CPU decode
        from tests.nf4_format import replace_4bit_layers_by_dense

        assert replace_4bit_layers_by_dense(model) > 0
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(SEED)
    config = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, bias="none", target_modules=names,
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def ours(folder: str, load_in_4bit: bool, dtype=torch.float32):
    model, processor = FastVisionModel.from_pretrained(folder, max_seq_length=128, dtype=dtype,
                                                       load_in_4bit=load_in_4bit, show_banner=False)
    model = FastVisionModel.get_peft_model(model, r=R, lora_alpha=ALPHA, random_state=SEED,
                                           use_gradient_checkpointing=False, show_banner=False)
    banner = model.notebookkit_banner
    assert banner.is_on("LoRA fast path") and banner.is_on("fused CE loss") and banner.is_on("attention"), str(banner)
    return model, processor


def _trainable(model) -> dict:
    return {n: p for n, p in sorted(model.named_parameters()) if p.requires_grad}


def run(model, batches: list[dict]) -> tuple[list[float], dict, dict]:
    """10 AdamW steps; losses, first-step LoRA gradients, final LoRA weights (by name)."""
    model.train()
    params = _trainable(model)
    opt = torch.optim.AdamW(list(params.values()), lr=LR, weight_decay=0.0, eps=1e-6)
    losses, first = [], {}
    for step in range(STEPS):
        out = model(**batches[step % len(batches)])
        out.loss.backward()
        if step == 0:
            first = {n: p.grad.detach().clone() for n, p in params.items()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    return losses, first, {n: p.detach().clone() for n, p in params.items()}


def gradients_at(model, weights: dict, batch: dict) -> dict:
    """The LoRA gradients of ``model`` on ``batch`` with its LoRA weights set to ``weights``."""
    params = _trainable(model)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
    model(**batch).loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    model.zero_grad(set_to_none=True)
    return grads


def _compare(family: str, load_in_4bit: bool, vlm_folder, caption_rows):
    from notebookkit.data import VisionDataCollator

    folder = vlm_folder(family)
    model, processor = ours(folder, load_in_4bit)
    counts = patch_summary(model)
    assert counts["attention"] == counts["mlp"] - (2 if family == "qwen2" else 0) == 2  # decoder (+ vision MLPs)
    collator = VisionDataCollator(model, processor)
    rows = caption_rows(6)
    batches = [collator(rows[:3]), collator(rows[3:])]
    names = _targets(folder, family)
    ref_model = reference(folder, family, names, load_in_4bit)
    assert {n for n, _ in model.named_parameters() if "lora_" in n} == \
        {n for n, _ in ref_model.named_parameters() if "lora_" in n}
    got, want = run(model, batches), run(ref_model, batches)
    shared = want[2]
    got, want = (*got, gradients_at(model, shared, batches[0])), (*want, gradients_at(ref_model, shared, batches[0]))
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(got[0], want[0]))
    assert worst_loss <= 1e-4, f"per-step loss rel. diff {worst_loss:.2e}\nours {got[0]}\nref  {want[0]}"
    assert got[0][-1] < got[0][0]  # it trained
    towers = {"vision": 0, "language": 0}
    worst = {}
    for which, (g, w) in {"first": (got[1], want[1]), "last": (got[3], want[3])}.items():
        for name, ref_grad in w.items():
            if which == "first" and "lora_A" in name:
                assert ref_grad.abs().max() == 0 and g[name].abs().max() == 0  # B = 0 at the start
                continue
            assert ref_grad.abs().max() > 0, f"{name}: zero reference gradient at the {which} step"
            err = rel_err(g[name], ref_grad)
            worst[which] = max(worst.get(which, 0.0), err)
            assert err <= 1e-4, f"{which}-step gradient of {name}: rel. diff {err:.2e}"
            towers[tower_of(name.split("base_model.model.", 1)[-1], VISION[family])] += which == "last"
    assert towers["vision"] > 0 and towers["language"] > 0, towers
    worst_weight = max(rel_err(got[2][n], want[2][n]) for n in want[2])
    assert worst_weight <= 1e-3, f"final LoRA weights rel. diff {worst_weight:.2e}"
    return worst_loss, worst, worst_weight


@pytest.mark.parametrize("family", list(VISION))
def test_parity_10_steps(family, vlm_folder, caption_rows):
    loss, grads, weights = _compare(family, False, vlm_folder, caption_rows)
    print(f"\n[vision parity fp32 {family}] loss rel {loss:.2e}, grad rel {grads}, weight rel {weights:.2e}")


@pytest.mark.parametrize("family", list(VISION))
def test_parity_10_steps_4bit(family, vlm_folder, caption_rows):
    loss, grads, weights = _compare(family, True, vlm_folder, caption_rows)
    print(f"\n[vision parity 4-bit {family}] loss rel {loss:.2e}, grad rel {grads}, weight rel {weights:.2e}")
