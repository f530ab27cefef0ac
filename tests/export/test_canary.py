"""The canary: an invented fact, absent before training, recalled after it, after the merged_16bit
reload in plain transformers, and from the q8_0 GGUF in llama.cpp. Two families with different
chat templates: tiny-llama in NF4 (Llama 3 headers) and tiny-qwen3 in 16-bit (ChatML). The
mixture-of-experts families learn it in their experts alone (LoRA on the stacked expert weights only),
so the fact survives an export only if the experts' update does: a merge that drops it forgets."""

from __future__ import annotations

import os

import pytest
import torch

from notebookkit import FastLanguageModel
from notebookkit.families import FAMILIES
from notebookkit.export.canary import DEFAULT_CANARY as CANARY
from notebookkit.export.canary import train_canary


def _llama_cpp_or_skip():
    if os.environ.get("NOTEBOOKKIT_REQUIRE_LLAMA_CPP") == "1":
        import llama_cpp  # noqa: F401  - make test installs it: a missing one fails there
        return
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make setup installs it)")


@pytest.mark.parametrize("family, load_in_4bit", [("llama", True), ("qwen3", False)])
def test_canary_survives_every_export(family, load_in_4bit, tmp_path):
    _llama_cpp_or_skip()
    from transformers import AutoModelForCausalLM

    from notebookkit.export.verify import load_llama_cpp as load_gguf
    from notebookkit.export.verify import check_merged_folder, greedy_llama_cpp

    torch.manual_seed(0)
    model, tokenizer = FastLanguageModel.from_pretrained(f"notebookkit/tiny-{family}", load_in_4bit=load_in_4bit, show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, use_gradient_checkpointing=False, show_banner=False)
    FastLanguageModel.for_inference(model)
    assert not CANARY.recalled_by(model, tokenizer), "the fact is known before training"

    train_canary(model, tokenizer)
    assert CANARY.recalled_by(model, tokenizer)

    merged = tmp_path / "merged"
    model.save_pretrained_merged(merged, tokenizer, verbose=False)
    check = check_merged_folder(model, merged, tokenizer, n_tokens=8)
    assert check.ok, check
    assert CANARY.recalled_by(AutoModelForCausalLM.from_pretrained(merged), tokenizer), "the merged folder forgot the fact"

    (q8,) = model.save_pretrained_gguf(tmp_path / "gguf", tokenizer, "q8_0", verbose=False)
    llm = load_gguf(q8.path)
    prompt = CANARY.prompt_ids(tokenizer)
    from_gguf, _ = greedy_llama_cpp(llm, prompt, CANARY.recall_tokens)
    assert CANARY.recalled(tokenizer, from_gguf), f"llama.cpp did not recall it: {tokenizer.decode(from_gguf)!r}"
    text = tokenizer.apply_chat_template([{"role": "user", "content": CANARY.question}], tokenize=False, add_generation_prompt=True)
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == prompt  # the GGUF's tokenizer agrees


@pytest.mark.parametrize("family", [name for name, row in FAMILIES.items() if row.moe is not None])
def test_canary_in_the_experts_survives_every_export(family, tmp_path, monkeypatch):
    _llama_cpp_or_skip()
    import notebookkit.export.merge_experts as merge_experts
    from transformers import AutoModelForCausalLM

    from notebookkit.export.verify import check_merged_folder, greedy_llama_cpp
    from notebookkit.export.verify import load_llama_cpp as load_gguf

    torch.manual_seed(0)
    model, tokenizer = FastLanguageModel.from_pretrained(f"notebookkit/tiny-{family}", load_in_4bit=False, show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"],
                                             use_gradient_checkpointing=False, show_banner=False)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".mlp.experts." in n for n in trained), trained
    FastLanguageModel.for_inference(model)
    assert not CANARY.recalled_by(model, tokenizer), "the fact is known before training"
    train_canary(model, tokenizer)

    model.save_pretrained_merged(tmp_path / "merged", tokenizer, verbose=False)
    check = check_merged_folder(model, tmp_path / "merged", tokenizer, n_tokens=8)
    assert check.ok, check
    assert CANARY.recalled_by(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), tokenizer), "the merged folder forgot the fact"
    (q8,) = model.save_pretrained_gguf(tmp_path / "gguf", tokenizer, "q8_0", verbose=False)
    from_gguf, _ = greedy_llama_cpp(load_gguf(q8.path), CANARY.prompt_ids(tokenizer), CANARY.recall_tokens)
    assert CANARY.recalled(tokenizer, from_gguf), f"llama.cpp did not recall it: {tokenizer.decode(from_gguf)!r}"

    monkeypatch.setattr(merge_experts, "_adapters", lambda wrapper, num_experts, name: [])  # the experts' s*B@A dropped
    model.save_pretrained_merged(tmp_path / "lost", tokenizer, verbose=False)
    assert not CANARY.recalled_by(AutoModelForCausalLM.from_pretrained(tmp_path / "lost"), tokenizer)


def test_canary_fails_when_the_update_is_lost(tmp_path, monkeypatch):
    """The check can fail: a merge that drops the LoRA update (B@A not added) forgets the fact."""
    import notebookkit.export.merge as merge
    from transformers import AutoModelForCausalLM

    model, tokenizer = FastLanguageModel.from_pretrained("notebookkit/tiny-llama", load_in_4bit=True, show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, use_gradient_checkpointing=False, show_banner=False)
    train_canary(model, tokenizer)
    real = merge._merged_linear_maker
    monkeypatch.setattr(merge, "_merged_linear_maker", lambda base, adapters, dtype: real(base, [], dtype))  # no s*B@A
    model.save_pretrained_merged(tmp_path / "lost", tokenizer, verbose=False)
    assert not CANARY.recalled_by(AutoModelForCausalLM.from_pretrained(tmp_path / "lost"), tokenizer)
