"""GGUF files in llama.cpp (llama-cpp-python) against Hugging Face, every family and format.

Held to, per file: llama.cpp's tokenizer gives Hugging Face's ids for every prompt; logits along
Hugging Face's greedy path within the format's stated tolerance (``GGUF_TOLERANCE``, relative to
the largest logit); and every place where the free-running greedy continuations part is a near-tie:
Hugging Face's own margin between the two tokens is below twice the measured logit difference.
f16 continuations are equal on every family. The tiny families other than llama keep random
weights, whose next-token margins are often below bf16 / q8_0 rounding; on tiny-llama (pre-trained:
real margins) bf16 and q8_0 continuations are equal too, and the K-quants' agreement is stated.
"""

from __future__ import annotations

import os

import pytest

from notebookkit.export.verify import GGUF_TOLERANCE, check_gguf_file
from tests.export.conftest import lora_model

if os.environ.get("NOTEBOOKKIT_REQUIRE_LLAMA_CPP") != "1":
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make setup installs it)")

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"]
METHODS = ["f16", "bf16", "q8_0", "q4_0"]
N_TOKENS = 8


def _check_file(model, tokenizer, result):
    check = check_gguf_file(model, result.path, tokenizer, n_tokens=N_TOKENS)
    summary = f"{result.form}: rel {check.relative_diff:.2e}, equal {check.greedy_equal}/{check.prompts}, agreement {check.agreement:.2f}"
    assert check.tokenizer_equal, summary
    assert check.within(result.form), f"{summary} > tolerance {GGUF_TOLERANCE[result.form]:.2e}"
    for margin in check.divergence_margins:
        assert margin <= 2 * check.max_abs_diff, f"{summary}: parted at a margin {margin:.4f} > 2 x {check.max_abs_diff:.4f}"
    return check


@pytest.mark.parametrize("family", FAMILIES)
def test_family_in_llama_cpp(family, tmp_path):
    model, tokenizer = lora_model(family, load_in_4bit=family == "llama")
    results = model.save_pretrained_gguf(tmp_path, tokenizer, METHODS, verbose=False)
    checks = {r.form: _check_file(model, tokenizer, r) for r in results}
    assert checks["f16"].greedy_equal == checks["f16"].prompts
    if family == "llama":
        assert checks["bf16"].greedy_equal == checks["q8_0"].greedy_equal == checks["q8_0"].prompts


def test_k_quants_in_llama_cpp(llama_nf4, tmp_path):
    model, tokenizer = llama_nf4
    results = model.save_pretrained_gguf(tmp_path, tokenizer, ["q4_k_m", "q5_k_m", "q6_k"], verbose=False)
    assert [r.path.name for r in results] == [f"{tmp_path.name}.{m}.gguf" for m in ("Q4_K_M", "Q5_K_M", "Q6_K")]
    assert not list(tmp_path.glob("*.partial.gguf")) and not list(tmp_path.glob(".*partial*"))
    checks = {r.form: _check_file(model, tokenizer, r) for r in results}
    assert checks["q6_k"].agreement >= 0.75 and checks["q5_k_m"].agreement >= 0.5 and checks["q4_k_m"].agreement >= 0.5
