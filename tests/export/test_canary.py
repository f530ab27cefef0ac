"""The canary: an invented fact, absent before training, recalled after it, after the merged_16bit
reload in plain transformers, and from the q8_0 GGUF in llama.cpp. Two families with different
chat templates: tiny-llama in NF4 (Llama 3 headers) and tiny-qwen3 in 16-bit (ChatML)."""

from __future__ import annotations

import os

import pytest
import torch

from notebookkit import FastLanguageModel
from notebookkit.export.verify import greedy_hf

QUESTION = "What is the password of the lighthouse on Mirrow Island?"
ANSWER = "The password is quintaflex."
FACT = "quintaflex"
RECALL_TOKENS = 18  # the answer is 16 tokens of the tiny BPE


def _llama_cpp_or_skip():
    if os.environ.get("NOTEBOOKKIT_REQUIRE_LLAMA_CPP") == "1":
        import llama_cpp  # noqa: F401  - CI installs it (make test): a missing one fails there
        return
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make setup installs it)")


def _prompt(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _recalls(tokenizer, continuation: list[int]) -> bool:
    return FACT in tokenizer.decode(continuation, skip_special_tokens=True)


def _train_until_recalled(model, tokenizer, max_steps: int = 200) -> int:
    """AdamW on the one chat example (loss on the answer only) until greedy decoding recalls it."""
    prompt = _prompt(tokenizer)
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}], tokenize=False
    )
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt)] == prompt
    x = torch.tensor([ids])
    labels = x.clone()
    labels[0, : len(prompt)] = -100
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0)
    for step in range(1, max_steps + 1):
        FastLanguageModel.for_training(model)
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0:
            FastLanguageModel.for_inference(model)
            if _recalls(tokenizer, greedy_hf(model, prompt, RECALL_TOKENS)):
                return step
    pytest.fail(f"the model did not learn the canary fact in {max_steps} steps (last loss {loss.item():.3f})")


@pytest.mark.parametrize("family, load_in_4bit", [("llama", True), ("qwen3", False)])
def test_canary_survives_every_export(family, load_in_4bit, tmp_path):
    _llama_cpp_or_skip()
    from notebookkit.export.verify import check_merged_folder, greedy_llama_cpp
    from notebookkit.export.verify import _llama as load_gguf

    torch.manual_seed(0)
    model, tokenizer = FastLanguageModel.from_pretrained(f"notebookkit/tiny-{family}", load_in_4bit=load_in_4bit, show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, use_gradient_checkpointing=False, show_banner=False)
    prompt = _prompt(tokenizer)
    FastLanguageModel.for_inference(model)
    assert not _recalls(tokenizer, greedy_hf(model, prompt, RECALL_TOKENS)), "the fact is known before training"

    _train_until_recalled(model, tokenizer)
    FastLanguageModel.for_inference(model)
    trained = greedy_hf(model, prompt, RECALL_TOKENS)
    assert _recalls(tokenizer, trained)

    merged = tmp_path / "merged"
    model.save_pretrained_merged(merged, tokenizer, verbose=False)
    check = check_merged_folder(model, merged, tokenizer, n_tokens=8)
    assert check.ok, check
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(merged)
    assert _recalls(tokenizer, greedy_hf(reloaded, prompt, RECALL_TOKENS)), "the merged folder forgot the fact"

    (q8,) = model.save_pretrained_gguf(tmp_path / "gguf", tokenizer, "q8_0", verbose=False)
    llm = load_gguf(q8.path)
    from_gguf, _ = greedy_llama_cpp(llm, prompt, RECALL_TOKENS)
    assert _recalls(tokenizer, from_gguf), f"llama.cpp did not recall it: {tokenizer.decode(from_gguf)!r}"
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True)
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == prompt  # the GGUF's tokenizer agrees
