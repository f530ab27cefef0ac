"""Bad input fails before any work, with a message that says what to change."""

from __future__ import annotations

import re
import shutil
from collections import namedtuple

import pytest
import torch

import notebookkit.export.merge as merge
from notebookkit.export import push_to_hub_gguf, push_to_hub_merged, save_pretrained_gguf, save_pretrained_merged
from notebookkit.export.checks import ExportError


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if any merged tensor is computed."""
    real = merge.plan_merged_tensors

    def plan(model, dtype):
        tensors = real(model, dtype)
        for t in tensors:
            t.make = lambda device, name=t.name: pytest.fail(f"{name} was computed before the check failed")
        return tensors

    monkeypatch.setattr(merge, "plan_merged_tensors", plan)
    import notebookkit.export.gguf_file as gguf_file
    import notebookkit.export.merged as merged

    monkeypatch.setattr(merged, "plan_merged_tensors", plan)
    monkeypatch.setattr(gguf_file, "plan_merged_tensors", plan)


def test_unknown_quantization_method(llama_nf4, tmp_path, no_work):
    model, tokenizer = llama_nf4
    from notebookkit.export_forms import GGUF_TYPES

    valid = re.escape("Valid: " + ", ".join(GGUF_TYPES))  # every type of the record, in its order
    with pytest.raises(ExportError, match=r"quantization_method='q2_xs'.*" + valid):
        model.save_pretrained_gguf(tmp_path / "g", tokenizer, quantization_method="q2_xs")
    assert not (tmp_path / "g").exists()


def test_folder_that_cannot_be_written(llama_nf4, tmp_path, no_work):
    model, tokenizer = llama_nf4
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ExportError, match=r"Cannot write the merged model to .*a-file/out: the folder .*a-file is not writable"):
        model.save_pretrained_merged(blocker / "out", tokenizer)
    with pytest.raises(ExportError, match="is a file, not a folder"):
        model.save_pretrained_gguf(blocker, tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_not_enough_disk_space(llama_nf4, tmp_path, monkeypatch, no_work):
    model, tokenizer = llama_nf4
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 2**20, 2**20))
    with pytest.raises(ExportError, match=r"Not enough disk space for the merged model in .*: it needs about .* and 1.00 MiB is free"):
        model.save_pretrained_merged(tmp_path / "m", tokenizer)
    with pytest.raises(ExportError, match="Not enough disk space for the GGUF export"):
        model.save_pretrained_gguf(tmp_path / "g", tokenizer, "f16")
    assert list(tmp_path.iterdir()) == []


def test_architecture_gguf_does_not_support(llama_nf4, tmp_path, monkeypatch, no_work):
    model, tokenizer = llama_nf4
    monkeypatch.setattr(model.get_base_model().config, "model_type", "phi3")
    with pytest.raises(ExportError, match=r"does not support model_type='phi3'\. Supported: gemma, gemma2, gemma3_text, gpt_oss, llama, mistral, qwen2, qwen3, qwen3_moe"):
        model.save_pretrained_gguf(tmp_path / "g", tokenizer)
    assert not (tmp_path / "g").exists()


def test_model_not_from_fast_language_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from notebookkit.embedded.tiny import ensure_tiny_model

    plain = AutoModelForCausalLM.from_pretrained(ensure_tiny_model("notebookkit/tiny-llama"))
    with pytest.raises(ExportError, match=r"(?s)save_pretrained_merged needs a model loaded by notebookkit, but got LlamaForCausalLM.*FastLanguageModel\.from_pretrained"):
        save_pretrained_merged(plain, tmp_path / "m")
    with pytest.raises(ExportError, match="save_pretrained_gguf needs a model loaded by notebookkit"):
        save_pretrained_gguf(plain, tmp_path / "g")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def no_llama_cpp(monkeypatch):
    """``import llama_cpp`` fails, as where llama-cpp-python is not installed."""
    import builtins

    real_import = builtins.__import__

    def without_llama_cpp(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ImportError("No module named 'llama_cpp'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_llama_cpp)


def test_k_quant_without_llama_cpp_says_how_to_get_it(llama_nf4, tmp_path, no_llama_cpp, no_work):
    model, tokenizer = llama_nf4
    with pytest.raises(ExportError, match=r"q4_k_m is made by llama.cpp's quantiser.*pip install llama-cpp-python.*q8_0"):
        model.save_pretrained_gguf(tmp_path / "g", tokenizer, ["q8_0", "q4_k_m"])
    assert not (tmp_path / "g").exists()


def test_gguf_check_without_llama_cpp_says_how_to_get_it(llama_nf4, tmp_path, no_llama_cpp, no_work):
    from notebookkit.export import export_and_verify

    model, tokenizer = llama_nf4
    with pytest.raises(ExportError, match=r"Verifying a GGUF export loads the GGUF file in llama.cpp.*pip install llama-cpp-python.*verify=False"):
        export_and_verify(model, tokenizer, tmp_path / "out", forms=("lora", "merged_16bit", "gguf"))
    assert not (tmp_path / "out").exists()


def test_push_offline_fails_before_any_work(llama_nf4, monkeypatch, no_work):
    model, tokenizer = llama_nf4
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ExportError, match=r"Cannot push to the Hugging Face Hub \(me/tiny\): this session is offline.*Nothing was exported"):
        model.push_to_hub_merged("me/tiny", tokenizer)
    with pytest.raises(ExportError, match="this session is offline"):
        model.push_to_hub_gguf("me/tiny", tokenizer, "q8_0")
    with pytest.raises(ExportError, match="is not one GGUF export knows"):
        push_to_hub_gguf(model, "me/tiny", tokenizer, "q9")


def test_push_unreachable_hub_fails_before_any_work(llama_nf4, monkeypatch, no_work):
    import huggingface_hub
    from huggingface_hub import constants

    model, tokenizer = llama_nf4
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def unreachable(self, *args, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", unreachable)
    with pytest.raises(ExportError, match=r"Cannot push .*ConnectionError: Failed to resolve 'huggingface.co'.*Nothing was exported.*log in"):
        push_to_hub_merged(model, "me/tiny", tokenizer)
    with pytest.raises(ExportError, match="should look like 'your-name/model-name'"):
        push_to_hub_merged(model, "tiny", tokenizer)


@pytest.mark.parametrize("family, setting", [("qwen3_moe", {"norm_topk_prob": False}), ("qwen3_moe", {"mlp_only_layers": [1]}),
                                             ("gpt_oss", {"swiglu_limit": 5.0}),
                                             ("gpt_oss", {"layer_types": ["full_attention", "sliding_attention"]})])
def test_gguf_refuses_a_mixture_of_experts_llama_cpp_computes_otherwise(family, setting):
    """llama.cpp fixes these for qwen3moe / gpt-oss (export.gguf_experts): a model that differs is refused, naming it."""
    from notebookkit.export.gguf_arch import gguf_family
    from tests.models.helpers import family_config

    with pytest.raises(ExportError, match=f"{next(iter(setting))}.*llama.cpp.*save_pretrained_merged"):
        gguf_family(family_config(family, **setting))
    gguf_family(family_config(family))  # the family's own settings pass
