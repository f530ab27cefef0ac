"""FastLanguageModel.from_pretrained / get_peft_model: names, precision, adapters, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from notebookkit.models import FastLanguageModel, patch_summary
from notebookkit.models.loading.loader import pick_dtype

from .helpers import tiny_folder


def _load(family="llama", **kw):
    kw.setdefault("load_in_4bit", False)
    kw.setdefault("show_banner", False)
    return FastLanguageModel.from_pretrained(tiny_folder(family), max_seq_length=kw.pop("max_seq_length", 64), **kw)


def test_local_folder_fp32_on_cpu_with_banner(capsys):
    model, tok = _load(show_banner=True)
    text = capsys.readouterr().out
    assert "notebookkit" in text and "torch" in text and "CPU" in text and "float32" in text
    for feature in ("RMSNorm", "MLP", "attention", "fused CE loss"):
        assert model.notebookkit_banner.is_on(feature), text
    assert next(model.parameters()).dtype == torch.float32
    assert tok.pad_token is not None and tok.padding_side == "right"
    assert model.config.pad_token_id == tok.pad_token_id
    assert not any(p.requires_grad for p in model.parameters())
    assert pick_dtype(None, "cpu") == torch.float32
    assert pick_dtype("bf16", "cpu") == torch.bfloat16


def test_reserved_tiny_name_resolves():
    tiny = pytest.importorskip("notebookkit.embedded.tiny")
    name = "notebookkit/tiny-llama"
    if name not in tiny.TINY_MODELS:
        pytest.skip("tiny-llama not registered")
    model, tok = FastLanguageModel.from_pretrained(name, load_in_4bit=False, show_banner=False)
    assert model.config.model_type == "llama"
    assert tok("hello")["input_ids"]


def test_load_in_4bit_uses_nf4_double_quant():
    model, _ = _load(load_in_4bit=True)
    layer = model.model.layers[0]
    assert type(layer.mlp.up_proj).__name__ == "Linear4bit"
    qs = layer.mlp.up_proj.weight.quant_state
    assert qs.quant_type == "nf4" and qs.nested
    assert "NF4" in str(model.notebookkit_banner)


def test_prequantised_checkpoint_loads_as_saved(tmp_path):
    model, tok = _load(load_in_4bit=True)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again, _ = FastLanguageModel.from_pretrained(str(tmp_path), load_in_4bit=False, show_banner=False)
    assert type(again.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    assert "pre-quantised" in str(again.notebookkit_banner)
    x = torch.randint(0, 200, (1, 8))
    with torch.no_grad():
        assert torch.allclose(again(input_ids=x).logits, model(input_ids=x).logits, atol=1e-5)


def test_adapter_save_and_reload_roundtrip(tmp_path):
    model, tok = _load("qwen2")
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, show_banner=False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_config.json").is_file()
    assert json.loads((tmp_path / "adapter_config.json").read_text())["r"] == 4
    again, tok2 = FastLanguageModel.from_pretrained(str(tmp_path), load_in_4bit=False, show_banner=False)
    assert hasattr(again, "peft_config")
    a = {n: p for n, p in model.named_parameters() if "lora_" in n}
    b = {n: p for n, p in again.named_parameters() if "lora_" in n}
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert any(p.requires_grad for p in b.values())
    x = torch.randint(0, 200, (1, 9))
    model.eval()
    again.eval()
    with torch.no_grad():
        assert torch.allclose(again(input_ids=x).logits, model(input_ids=x).logits, atol=1e-6)
    assert again.notebookkit_banner.is_on("LoRA fast path")
    assert tok2.pad_token == tok.pad_token


def test_unreachable_name_gives_one_readable_error():
    with pytest.raises(OSError) as info:
        FastLanguageModel.from_pretrained("someone/definitely-not-a-model-xyz", show_banner=False)
    msg = str(info.value)
    assert "someone/definitely-not-a-model-xyz" in msg
    assert info.value.__cause__ is None or info.value.__suppress_context__


def test_max_seq_length_exceeded_is_a_clear_error():
    model, _ = _load(max_seq_length=16)
    model = FastLanguageModel.get_peft_model(model, r=4, show_banner=False)
    model.train()
    x = torch.randint(0, 200, (1, 20))
    with pytest.raises(ValueError, match="max_seq_length=16"):
        model(input_ids=x, labels=x)
    with pytest.raises(ValueError, match="max_seq_length=16"):  # TRL's own LM head calls the backbone
        model.get_base_model().model(input_ids=x)
    FastLanguageModel.for_inference(model)
    with pytest.warns(UserWarning, match="max_seq_length"):
        model(input_ids=x)


@pytest.mark.parametrize("kw,reason", [({"bias": "all"}, "bias"), ({"lora_dropout": 0.1}, "lora_dropout")])
def test_unsupported_bias_or_dropout_falls_back_with_banner(kw, reason):
    model, _ = _load("qwen2")  # qwen2 has q/k/v biases, which bias="all" makes trainable
    peft_model = FastLanguageModel.get_peft_model(model, r=4, show_banner=False, **kw)
    banner = peft_model.notebookkit_banner
    assert not banner.is_on("LoRA fast path")
    assert reason in str(banner)
    peft_model.train()
    x = torch.randint(0, 200, (2, 10))
    out = peft_model(input_ids=x, labels=x)
    out.loss.backward()
    assert torch.isfinite(out.loss)


def test_full_finetuning_trains_every_weight():
    model, _ = _load(full_finetuning=True, load_in_4bit=True)
    assert all(p.requires_grad for p in model.parameters())
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "Linear"
    model.train()
    x = torch.randint(0, 200, (2, 10))
    model(input_ids=x, labels=x).loss.backward()
    assert model.lm_head.weight.grad is not None and model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_gradient_checkpointing_modes_on_cpu():
    model, _ = _load()
    peft_model = FastLanguageModel.get_peft_model(model, r=4, use_gradient_checkpointing="unsloth", show_banner=False)
    banner = str(peft_model.notebookkit_banner)
    assert "recompute" in banner and "CPU" in banner
    assert peft_model.get_base_model().model.layers[0].gradient_checkpointing
    with pytest.raises(ValueError, match="use_gradient_checkpointing"):
        FastLanguageModel.get_peft_model(_load()[0], use_gradient_checkpointing="sometimes", show_banner=False)


def test_for_inference_and_for_training():
    model, _ = _load()
    model = FastLanguageModel.get_peft_model(model, r=4, show_banner=False)
    FastLanguageModel.for_inference(model)
    assert not model.training and model.get_base_model().config.use_cache
    FastLanguageModel.for_training(model)
    assert model.training and not model.get_base_model().config.use_cache


def test_unknown_architecture_loads_on_stock_code(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from .helpers import byte_tokenizer

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=260)).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    model, _ = FastLanguageModel.from_pretrained(str(tmp_path), load_in_4bit=False, show_banner=False)
    assert patch_summary(model) == {}
    assert "not in notebookkit's architecture table" in str(model.notebookkit_banner)


def test_fast_path_off_switch():
    model, _ = _load(fast_path=False)
    assert patch_summary(model) == {}


def test_get_peft_model_returns_a_model_ready_to_train():
    """Training mode, so a manual loop gets the fused loss (no [N, V] logits) and the checkpointing plan."""
    model, _ = _load()
    assert not model.training  # from_pretrained, like Hugging Face, loads for inference
    model = FastLanguageModel.get_peft_model(model, r=4, show_banner=False)
    assert model.training and all(m.training for m in model.modules())
    assert model.get_base_model().config.use_cache is False
    x = torch.randint(0, 200, (2, 8))
    out = model(input_ids=x, labels=x)
    assert out.logits is None, "training with labels should not return full logits"
