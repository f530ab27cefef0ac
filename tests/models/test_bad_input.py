"""Bad input to FastLanguageModel on the tiny default: each mistake a notebook user makes gets a message
that names the argument and says what to write, and a refused call leaves the model as it was."""

from __future__ import annotations

import pytest
import torch

from notebookkit.memory.model_setup import fp8_forward
from notebookkit.models import FastLanguageModel
from notebookkit.models.common.banner import Banner
from notebookkit.models.lora_setup import note_unused_max_memory
from notebookkit.models.loading.loader import pick_dtype
from notebookkit.models.common.precision import is_bf16_supported, is_bfloat16_supported

TINY = "notebookkit/tiny-llama"


def _load(**kw):
    kw.setdefault("load_in_4bit", False)
    kw.setdefault("show_banner", False)
    kw.setdefault("max_seq_length", 64)
    return FastLanguageModel.from_pretrained(TINY, **kw)


@pytest.fixture(scope="module")
def loaded():
    return _load()


def _untouched(model) -> None:
    """No adapter, no LoRA layer, the length limit of from_pretrained, no FP8 flag."""
    assert not hasattr(model, "peft_config")
    assert not any("lora_" in name for name, _ in model.named_modules())
    assert model.max_seq_length == 64
    assert not any(fp8_forward(m) for m in model.modules())


@pytest.mark.parametrize(
    "value,error,text",
    [
        (-5, ValueError, "from_pretrained: max_seq_length=-5 is not a positive whole number"),
        (0, ValueError, "from_pretrained: max_seq_length=0 is not a positive whole number"),
        (1.5, ValueError, "max_seq_length=1.5 is not a positive whole number"),
        (True, TypeError, "max_seq_length=True is a bool, not a whole number"),
        ("512", TypeError, "max_seq_length='512' is a str, not a whole number"),
    ],
)
def test_max_seq_length_must_be_a_positive_whole_number(value, error, text):
    with pytest.raises(error) as info:
        FastLanguageModel.from_pretrained(TINY, max_seq_length=value, show_banner=False)
    assert text in str(info.value)
    assert "e.g. max_seq_length=2048" in str(info.value)


def test_integral_float_length_is_accepted():
    model, tok = _load(max_seq_length=64.0)
    assert model.max_seq_length == 64 and isinstance(model.max_seq_length, int)
    assert tok.model_max_length == 64


@pytest.mark.parametrize("name", [None, "", "   "])
def test_missing_model_name(name):
    with pytest.raises(TypeError, match="is not a model name. Pass a built-in tiny model such as 'notebookkit/tiny-llama'"):
        FastLanguageModel.from_pretrained(name, show_banner=False)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, 16])
def test_dtype_that_is_not_a_training_dtype(dtype):
    with pytest.raises(ValueError) as info:
        _load(dtype=dtype)
    assert f"dtype={dtype!r} is not one of None, torch.bfloat16, torch.float16, torch.float32" in str(info.value)
    assert "None picks the best one for this machine" in str(info.value)


def test_misspelt_keyword_names_the_close_spelling():
    with pytest.raises(TypeError) as info:
        FastLanguageModel.from_pretrained(TINY, max_seq_lenght=128, load_in_4bit=False, show_banner=False)
    msg = str(info.value)
    assert msg.startswith("from_pretrained: unknown argument max_seq_lenght=. Did you mean max_seq_length=?")
    assert "transformers' from_pretrained" in msg
    assert info.value.__cause__ is None


def test_other_notebooks_keywords_are_accepted_and_explained():
    model, _ = _load(load_in_4bit=True, load_in_16bit=True, offload_embedding=True, fast_inference=True,
                     max_lora_rank=32, gpu_memory_utilization=0.9)
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "Linear", "load_in_16bit=True means 16-bit weights"
    banner = str(model.notebookkit_banner)
    assert "weights: float32" in banner
    assert "[off] offload_embedding" in banner and "tied to the LM head" in banner  # tiny-llama ties it
    assert "fast_inference=True ignored: notebookkit has no vLLM engine: model.generate" in banner
    assert "max_lora_rank=32 ignored: only used by vLLM fast inference" in banner


@pytest.mark.parametrize(
    "kw,error,text",
    [
        (dict(r=0), ValueError, "get_peft_model: r=0 is not a positive whole number. r is the LoRA rank"),
        (dict(r=4.5), ValueError, "get_peft_model: r=4.5 is not a positive whole number"),
        (dict(r="16"), TypeError, "get_peft_model: r='16' is a str, not a whole number"),
        (dict(r=8, lora_alpha=0), ValueError, "get_peft_model: lora_alpha=0 must be greater than 0. The LoRA update "
         "is scaled by lora_alpha / r, so it must be positive: the usual choice is lora_alpha = r or 2 * r (here 8 or 16)"),
        (dict(lora_alpha=-16), ValueError, "lora_alpha=-16 must be greater than 0"),
        (dict(lora_dropout=1.5), ValueError, "get_peft_model: lora_dropout=1.5 must be in [0, 1). It is the fraction"),
        (dict(lora_dropout="0.1"), TypeError, "get_peft_model: lora_dropout='0.1' is a str, not a number"),
        (dict(max_seq_length=-1), ValueError, "get_peft_model: max_seq_length=-1 is not a positive whole number"),
        (dict(planning_batch_size=0), ValueError, "get_peft_model: planning_batch_size=0 is not a positive whole"),
        (dict(use_gradient_checkpointing="sometimes"), ValueError, "use_gradient_checkpointing='sometimes' is not one of"),
        (dict(max_memory="12 parsecs"), ValueError, "get_peft_model: max_memory='12 parsecs' is not a memory size: it "
         "is neither a size with a unit nor a known GPU card. Write a size such as '15GB'"),
        (dict(max_memory="16"), ValueError, "get_peft_model: max_memory='16': '16' has no unit: write '16GB'"),
        (dict(lora_alpah=16), TypeError, "get_peft_model: unknown argument lora_alpah=. Did you mean lora_alpha=?"),
    ],
)
def test_bad_lora_settings_are_refused_before_anything_changes(loaded, kw, error, text):
    model, _ = loaded
    with pytest.raises(error) as info:
        FastLanguageModel.get_peft_model(model, show_banner=False, **kw)
    assert text in str(info.value)
    _untouched(model)


def test_targets_peft_cannot_find_leave_the_model_as_it_was(loaded):
    model, _ = loaded
    with pytest.raises(ValueError, match="not found in the base model"):  # PEFT's own message, kept
        FastLanguageModel.get_peft_model(model, target_modules=["qkv"], max_seq_length=32, show_banner=False)
    _untouched(model)


def test_all_linear_is_peft_s_spelling_not_a_list_of_letters():
    model, _ = _load()
    model = FastLanguageModel.get_peft_model(model, r=4, target_modules="all-linear", show_banner=False)
    adapted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert model.notebookkit_banner.is_on("LoRA fast path")
    assert "on all-linear:" in str(model.notebookkit_banner)


def test_max_memory_on_a_cpu_is_reported_unused(capsys):
    model, _ = _load()
    model = FastLanguageModel.get_peft_model(model, r=4, max_memory="1MB")
    out = capsys.readouterr().out
    assert ("note: max_memory='1MB' not used: the cap applies to a GPU only (it sizes the activation plan of "
            "use_gradient_checkpointing='auto' in VRAM); this model is on the CPU") in out


def test_max_memory_without_auto_is_reported_unused():
    banner = Banner()
    note_unused_max_memory(banner, "15GB", "offload", "cuda")
    assert banner.notes == [
        "max_memory='15GB' not used: only use_gradient_checkpointing='auto' plans within it (this call asked for "
        "'offload')"
    ]
    note_unused_max_memory(banner, "15GB", "auto", "cuda")
    assert len(banner.notes) == 1


@pytest.mark.parametrize("call", ["get_peft_model", "for_inference", "for_training"])
def test_the_model_tokenizer_pair_is_not_a_model(loaded, call):
    model, tok = loaded
    with pytest.raises(TypeError) as info:
        getattr(FastLanguageModel, call)((model, tok))
    assert str(info.value).startswith(f"{call}: the model argument is a tuple (LlamaForCausalLM, ")
    assert "write `model, tokenizer = FastLanguageModel.from_pretrained(...)` and pass `model`" in str(info.value)
    with pytest.raises(TypeError, match=f"{call}: got a tokenizer .* where the model is expected"):
        getattr(FastLanguageModel, call)(tok)
    _untouched(model)


def test_a_model_not_from_fast_language_model_is_named_in_the_banner():
    from transformers import AutoModelForCausalLM

    from notebookkit.embedded.tiny import resolve_model_name

    plain = AutoModelForCausalLM.from_pretrained(str(resolve_model_name(TINY)))
    peft_model = FastLanguageModel.get_peft_model(plain, r=4, show_banner=False)
    assert ("this model was not loaded by FastLanguageModel.from_pretrained, so its layers run stock Hugging Face "
            "code") in str(peft_model.notebookkit_banner)


def test_a_second_get_peft_model_returns_the_model_unchanged(capsys):
    model, _ = _load()
    model = FastLanguageModel.get_peft_model(model, r=4, show_banner=False)
    again = FastLanguageModel.get_peft_model(model, r=64)
    assert again is model and model.peft_config["default"].r == 4
    assert "get_peft_model called on a model that already has LoRA adapters; returning it unchanged" in capsys.readouterr().out


def _fake_gpu(monkeypatch, capability, emulates_bf16=True):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: emulates_bf16 or capability[0] >= 8)


def test_a_t4_has_no_bf16_although_torch_emulates_it(monkeypatch):
    """torch.cuda.is_bf16_supported() says True on a T4 (emulation); dtype=None must pick fp16 there."""
    assert not is_bfloat16_supported() and is_bf16_supported is is_bfloat16_supported  # this CPU machine
    _fake_gpu(monkeypatch, (7, 5))
    assert torch.cuda.is_bf16_supported() and not is_bfloat16_supported()
    assert pick_dtype(None, "cuda") == torch.float16
    banner = Banner()
    assert pick_dtype("bf16", "cuda", banner) == torch.float16
    assert "this GPU has no bf16: using float16 instead of the requested bfloat16" in banner.notes
    _fake_gpu(monkeypatch, (8, 0))
    assert is_bfloat16_supported() and pick_dtype(None, "cuda") == torch.bfloat16
