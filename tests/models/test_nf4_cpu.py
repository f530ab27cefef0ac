"""4-bit models on the CPU never depend on bitsandbytes' CPU NF4 decode.

bitsandbytes 0.50.2 on the CPU decodes NF4 wrongly on AVX-512 CPUs when rows are not whole
64-element blocks, and on CPUs with AVX512-BF16 its eval-mode forward rewrites the weights in place
(a CPU-only layout, block scales rounded to bf16). The model here has rows of 80 and 160 columns
(the tiny defaults' 128 / 384 happen to be whole blocks), so on such a CPU every path that reached
bitsandbytes' decode gave wrong logits.

Oracle: the same model with every 4-bit layer replaced by a dense ``nn.Linear`` holding the weight
decoded from the NF4 definition (``tests/nf4_format.py``). Both sides are fp32 on the CPU and differ
only in the order of float sums (fused kernels, another matmul): measured rel. error 0 to 5e-7 on
logits, loss and LoRA gradients. ``BOUND = 1e-4`` is 200x that, and 20x below what bitsandbytes' CPU
decode gave on an AVX-512 CPU (loss off by 2e-3 relative after one forward; a wrong block scale moves
weights by up to 0.2 against a 0.04 NF4 step).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bnbF  # noqa: E402

from notebookkit.kernels.nf4 import dequantize_nf4  # noqa: E402
from notebookkit.kernels.testing import rel_err  # noqa: E402
from notebookkit.models import FastLanguageModel, patch_summary, unpatch_model  # noqa: E402
from notebookkit.base_layers.linear4bit import is_linear4bit  # noqa: E402
from tests.nf4_format import replace_4bit_layers_by_dense  # noqa: E402

from .helpers import byte_tokenizer, random_model  # noqa: E402

BOUND = 1e-4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random llama whose projections have rows of 80 and 160 columns (not whole NF4 blocks)."""
    path = tmp_path_factory.mktemp("nf4-80")
    model = random_model("llama", hidden_size=80, intermediate_size=160, head_dim=20)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def _load(folder, **kw):
    kw.setdefault("load_in_4bit", True)
    model, tok = FastLanguageModel.from_pretrained(folder, max_seq_length=64, dtype=torch.float32,
                                                   show_banner=False, **kw)
    return model, tok


def _dense_twin(model):
    """A deep copy of ``model`` on stock code (no notebookkit patch) with each 4-bit layer replaced by
    ``nn.Linear(weight decoded from the NF4 definition)``: the oracle."""
    twin = copy.deepcopy(model)
    unpatch_model(twin, keep_nf4_decode=False)
    assert replace_4bit_layers_by_dense(twin) == 2 * 7
    assert not any(is_linear4bit(m) for m in twin.modules())
    return twin


def _batch(n=2, t=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (n, t), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def test_the_shapes_are_ones_a_wrong_decode_would_show(folder):
    model, _ = _load(folder)
    shapes = {tuple(m.weight.quant_state.shape) for m in model.modules() if is_linear4bit(m)}
    assert shapes and all(s[1] % 64 for s in shapes), shapes
    wrong = 0
    for m in model.modules():
        if is_linear4bit(m):
            wrong += int((bnbF.dequantize_4bit(m.weight.data, m.weight.quant_state) != dequantize_nf4(m.weight)).sum())
    print(f"\nbitsandbytes' CPU decode differs from the NF4 format in {wrong:,} values on this CPU")


@pytest.mark.parametrize("fast_path", [True, False], ids=["fused", "stock"])
def test_eval_forward_equals_the_dense_decode(folder, fast_path):
    """Eval mode without gradients (generation, evaluation): the path where bitsandbytes repacks."""
    model, _ = _load(folder, fast_path=fast_path)
    twin = _dense_twin(model)
    x = _batch()["input_ids"]
    model.eval()
    twin.eval()
    with torch.no_grad():
        got, want = model(input_ids=x).logits, twin(input_ids=x).logits
        again = model(input_ids=x).logits  # the weights did not change under the first call
    err = rel_err(got, want)
    print(f"\n[{'fused' if fast_path else 'stock'} eval] rel. error {err:.2e}")
    assert err <= BOUND
    assert torch.equal(again, got)
    assert all(not getattr(m.weight.quant_state, "packing_format_for_cpu", False)
               for m in model.modules() if is_linear4bit(m))


class _DropoutThatKeepsAll(nn.Dropout):
    """Reads as LoRA dropout 0.1 (so the layer stays on stock PEFT code) but drops nothing, so both
    sides of the comparison compute the same function."""

    def forward(self, x):
        return x


@pytest.mark.parametrize("case", ["fused", "stock", "lora_dropout"])
def test_lora_training_step_equals_the_dense_decode(folder, case):
    """Loss and LoRA gradients of one training step: the fused path, ``fast_path=False``, and layers
    that stay on stock PEFT code (LoRA dropout)."""
    model, _ = _load(folder, fast_path=case != "stock")
    dropout = 0.1 if case == "lora_dropout" else 0.0
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS,
                                             use_gradient_checkpointing=False, show_banner=False)
    if case == "lora_dropout":
        for m in model.modules():
            if hasattr(m, "lora_dropout") and "default" in m.lora_dropout:
                m.lora_dropout["default"] = _DropoutThatKeepsAll(0.1)
        assert not model.notebookkit_banner.is_on("LoRA fast path")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=g)  # non-zero B: every LoRA gradient is exercised
    twin = _dense_twin(model)
    batch = _batch()
    model.train()
    twin.train()
    out, ref = model(**batch), twin(**batch)
    out.loss.backward()
    ref.loss.backward()
    assert abs(out.loss.item() - ref.loss.item()) <= BOUND * abs(ref.loss.item())
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in twin.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 7 * 2
    worst = max(rel_err(grads[n], ref_grads[n]) for n in grads)
    print(f"\n[{case} train] loss {out.loss.item():.6f} vs {ref.loss.item():.6f}, worst LoRA grad rel. error {worst:.2e}")
    assert worst <= BOUND


def _trap(*_a, **_k):
    raise AssertionError("bitsandbytes' CPU 4-bit kernels were called")


def test_no_cpu_path_reaches_bitsandbytes_decode(folder, monkeypatch):
    """Loading, generating, evaluating, training (fused and stock PEFT layers), switching modes and the
    calibration's plain-PEFT baseline: none of them calls bitsandbytes' 4-bit matmul or decode."""
    import bitsandbytes.nn.modules as bnb_modules

    from notebookkit.train.calibration import _load_plain

    monkeypatch.setattr(bnb, "matmul_4bit", _trap)
    monkeypatch.setattr(bnbF, "dequantize_4bit", _trap)
    monkeypatch.setattr(bnbF, "gemv_4bit", _trap)
    monkeypatch.setattr(bnb_modules, "_convert_weight_packed_for_cpu", _trap)
    x = _batch(1, 7)["input_ids"]
    for fast_path in (True, False):
        model, _ = _load(folder, fast_path=fast_path)
        FastLanguageModel.for_inference(model)
        model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False, pad_token_id=0)
        model = FastLanguageModel.get_peft_model(model, r=4, target_modules=TARGETS, lora_dropout=0.1,
                                                 use_gradient_checkpointing=False, show_banner=False)
        model(**_batch()).loss.backward()
        FastLanguageModel.for_inference(model)
        with torch.no_grad():
            model(input_ids=x)
    from peft import LoraConfig, get_peft_model

    plain, _ = _load_plain(folder, 64, torch.float32, load_in_4bit=True)
    plain = get_peft_model(plain, LoraConfig(r=4, target_modules=TARGETS, task_type="CAUSAL_LM"))
    plain(**_batch()).loss.backward()
    plain.eval()
    with torch.no_grad():
        plain(input_ids=x)


def test_unpatch_keeps_the_nf4_decode_unless_asked(folder):
    model, _ = _load(folder)
    n4 = sum(1 for m in model.modules() if is_linear4bit(m))
    assert patch_summary(model)["nf4_cpu"] == n4
    assert "NF4 on CPU" in str(model.notebookkit_banner)
    unpatch_model(model)
    assert patch_summary(model) == {"nf4_cpu": n4}
    unpatch_model(model, keep_nf4_decode=False)
    assert patch_summary(model) == {}


def test_merging_on_the_cpu_is_refused_where_bitsandbytes_decodes_wrongly(folder, monkeypatch):
    """PEFT's merge decodes with bitsandbytes. Made wrong on purpose here (so the test does not depend
    on this CPU), it is refused before any layer is merged; where it is right, the merge runs."""
    model, _ = _load(folder)
    model = FastLanguageModel.get_peft_model(model, r=4, target_modules=TARGETS, use_gradient_checkpointing=False,
                                             show_banner=False)
    right = lambda data, qs, *a, **k: dequantize_nf4(data, qs)  # noqa: E731
    wrong = lambda data, qs, *a, **k: dequantize_nf4(data, qs) * 1.01  # noqa: E731
    monkeypatch.setattr(bnbF, "dequantize_4bit", wrong)
    with pytest.raises(RuntimeError, match="bitsandbytes' CPU dequantize_4bit.*Nothing was merged.*model.to\\('cuda'\\)"):
        model.merge_and_unload()
    assert not any(getattr(m, "merged", False) for m in model.modules())
    monkeypatch.setattr(bnbF, "dequantize_4bit", right)
    merged = model.merge_and_unload()
    assert sum(1 for m in merged.modules() if is_linear4bit(m)) == 2 * 7
