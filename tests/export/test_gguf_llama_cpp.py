"""GGUF files in llama.cpp (llama-cpp-python) against Hugging Face, every family and format.

Held to, per file: llama.cpp's tokenizer gives Hugging Face's ids for every prompt; logits along
Hugging Face's greedy path within the format's stated tolerance (``GGUF_TOLERANCE``, relative to
the largest logit); and the difference is the size the format's rounding explains
(``GGUFCheck.explained``): llama.cpp's difference is at most ``ROUNDING_FACTOR`` x the difference
the rounded weights alone make in Hugging Face (measured without llama.cpp) plus llama.cpp's own
arithmetic (measured on the f32 file, which has no weight rounding), and wherever a free-running
continuation parts from Hugging Face's, Hugging Face's own gap between the two tokens is below twice
that at the step. f16 continuations are equal on every family. The tiny families other than llama
keep random weights, whose next-token gaps are often below bf16 / q8_0 rounding (the numbers are
printed); on tiny-llama (pre-trained: real gaps) bf16 and q8_0 continuations are equal too, and the
agreement of q4_0 and the K-quants is stated. A wrong Q/K permutation and a misplaced tensor fail.

The mixture-of-experts families (Qwen3-MoE, gpt-oss) are held to the same in f32 and f16 (llama.cpp's
``qwen3moe`` / ``gpt-oss`` with the experts split and transposed as it lays them out). Their coarser formats
are not held to a logit tolerance: a random tiny router has near-ties between experts, and where rounding
(llama.cpp's of the activations included) swaps one expert for another the logits jump at that token.
Measured (teacher-forced, relative to the largest logit; "rounding" = the weights' rounding alone in
Hugging Face): tiny-qwen3_moe q8_0 0.24 (rounding 0.12); tiny-gpt_oss bf16 0.25 (rounding 0.0035), q8_0 0.25,
q4_0 0.33. With gpt-oss's routers scaled 8x (decisive routing) bf16 falls to 5e-3, within its tolerance,
and q8_0 keeps 31 of 32 steps within 1.3x the weights' rounding, one step at 0.165 (12x): a jump, not a drift.
The canary test reads the q8_0 file of both families.

From a 2-bit base (``load_in_2bit``): f16 of tiny-llama, and q2_k of a model whose rows are whole Q2_K
blocks (tiny-llama's are not: llama.cpp writes its q2_k file in Q4_0), held to the same.
"""

from __future__ import annotations

import os

import pytest

from notebookkit import families
from notebookkit.export_forms import GGUF_TYPES
from notebookkit.export.verify import GGUF_TOLERANCE, check_gguf_file
from tests.export.conftest import low_bit_lora_model, lora_model, q2_k_sized_llama

if os.environ.get("NOTEBOOKKIT_REQUIRE_LLAMA_CPP") != "1":
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make setup installs it)")

FAMILIES = [name for name, row in families.FAMILIES.items() if row.gguf is not None]  # every family GGUF writes
METHODS = [t.name for t in GGUF_TYPES.values() if not t.needs_llama_cpp]  # written by notebookkit
K_QUANTS = [t.name for t in GGUF_TYPES.values() if t.needs_llama_cpp]  # by llama.cpp's quantiser
N_TOKENS = 8


def _checks(model, tokenizer, results, label: str) -> dict:
    """Check every file; the f32 file first, as llama.cpp's arithmetic floor for the others."""
    checks = {r.form: check_gguf_file(model, r.path, tokenizer, n_tokens=N_TOKENS, method=r.form) for r in results}
    arithmetic = checks["f32"]
    for method, check in checks.items():
        floor = arithmetic if method != "f32" else None
        summary = f"{label} {check.summary(floor)}"
        print(summary)
        assert check.tokenizer_equal, summary
        assert check.within(method), f"{summary} > tolerance {GGUF_TOLERANCE[method]:.2e}"
        if method != "f32":
            assert check.explained(arithmetic), f"{summary}: not explained by the format's rounding"
    return checks


@pytest.mark.parametrize("family", FAMILIES)
def test_family_in_llama_cpp(family, tmp_path):
    model, tokenizer = lora_model(family, load_in_4bit=family == "llama")
    methods = ["f32", "f16"] if families.FAMILIES[family].moe is not None else METHODS  # routing: module docstring
    results = model.save_pretrained_gguf(tmp_path, tokenizer, methods, verbose=False)
    checks = _checks(model, tokenizer, results, family)
    assert checks["f32"].greedy_equal == checks["f16"].greedy_equal == checks["f16"].prompts
    if family == "llama":
        assert checks["bf16"].greedy_equal == checks["q8_0"].greedy_equal == checks["q8_0"].prompts


def test_k_quants_in_llama_cpp(llama_nf4, tmp_path):
    model, tokenizer = llama_nf4
    results = model.save_pretrained_gguf(tmp_path, tokenizer, ["f32", *K_QUANTS], verbose=False)
    assert [r.path.name for r in results] == [f"{tmp_path.name}.{m.upper()}.gguf" for m in ("f32", *K_QUANTS)]
    assert not list(tmp_path.glob("*.partial.gguf")) and not list(tmp_path.glob(".*partial*"))
    checks = _checks(model, tokenizer, results, "llama")
    assert checks["q6_k"].agreement >= 0.75 and checks["q5_k_m"].agreement >= 0.5 and checks["q4_k_m"].agreement >= 0.5


def _check_alone(model, tokenizer, result):
    """One file's check without an f32 file beside it (llama.cpp's arithmetic floor: the f32 tolerance)."""
    check = check_gguf_file(model, result.path, tokenizer, n_tokens=N_TOKENS, method=result.form)
    summary = f"2bit base {check.summary()}"
    print(summary)
    assert check.tokenizer_equal, summary
    assert check.within(result.form), f"{summary} > tolerance {GGUF_TOLERANCE[result.form]:.2e}"
    assert check.explained(), f"{summary}: not explained by the format's rounding"
    return check


def test_f16_from_a_2bit_base_in_llama_cpp(tmp_path):
    """tiny-llama on a 2-bit base, LoRA on all but the down projections (written dense from their codes)."""
    model, tokenizer = low_bit_lora_model("notebookkit/tiny-llama", "2bit")
    (result,) = model.save_pretrained_gguf(tmp_path, tokenizer, "f16", verbose=False)
    check = _check_alone(model, tokenizer, result)
    assert check.greedy_equal == check.prompts


def test_q2_k_from_a_2bit_base_in_llama_cpp(tmp_path):
    """q2_k of a 2-bit base whose rows are whole Q2_K blocks: the projections are Q2_K (and Q3_K, llama.cpp's
    mix) in the file, and llama.cpp's logits differ from the model's by what that rounding explains."""
    import gguf

    model, tokenizer = low_bit_lora_model(q2_k_sized_llama(tmp_path / "model"), "2bit")
    (result,) = model.save_pretrained_gguf(tmp_path / "gguf", tokenizer, "q2_k", verbose=False)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(result.path).tensors}
    assert types["blk.0.attn_q.weight"] == "Q2_K" and types["blk.1.ffn_up.weight"] == "Q2_K", types
    _check_alone(model, tokenizer, result)


@pytest.mark.parametrize("fault", ["no Q/K permutation", "down projections of layers 0 and 1 swapped"])
def test_a_broken_file_is_not_explained_by_rounding(fault, llama_nf4, tmp_path, monkeypatch):
    """Negative controls: the writer broken on purpose (llama.cpp's floor from a good f32 file)."""
    import notebookkit.export.gguf_file as gguf_file

    model, tokenizer = llama_nf4
    (good,) = model.save_pretrained_gguf(tmp_path / "good", tokenizer, "f32", verbose=False)
    arithmetic = check_gguf_file(model, good.path, tokenizer, n_tokens=N_TOKENS)
    if fault.startswith("no Q/K"):
        monkeypatch.setattr(gguf_file, "permute_for_llama_rope", lambda weight, heads: weight)
    else:
        real = gguf_file.gguf_tensors

        def swapped(model, family):
            tensors = real(model, family)
            by_name = {t.name: t for t in tensors}
            a, b = by_name["blk.0.ffn_down.weight"], by_name["blk.1.ffn_down.weight"]
            a.source, b.source = b.source, a.source
            return tensors

        monkeypatch.setattr(gguf_file, "gguf_tensors", swapped)
    (bad,) = model.save_pretrained_gguf(tmp_path / "bad", tokenizer, "q8_0", verbose=False)
    check = check_gguf_file(model, bad.path, tokenizer, n_tokens=N_TOKENS)
    print(f"{fault}: {check.summary(arithmetic)}")
    assert not check.explained(arithmetic)


@pytest.mark.parametrize("truncate", [True, False])
def test_gpt_oss_yarn_in_llama_cpp(truncate, tmp_path):
    """gpt-oss's YaRN RoPE (factor 32 over 4096 positions, betas 32 / 1) in llama.cpp: with ``truncate=True`` the
    f32 file matches to llama.cpp's arithmetic; gpt-oss's own ``truncate=False`` has no llama.cpp key, so the
    export warns and the small difference it makes is bounded (measured 2e-4 of the largest logit)."""
    import json
    import shutil

    from notebookkit.embedded.tiny import ensure_tiny_model
    from tests.export.conftest import lora_model_from

    folder = tmp_path / "model"
    shutil.copytree(ensure_tiny_model("notebookkit/tiny-gpt_oss"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 32 * 4096
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
                                 "original_max_position_embeddings": 4096, "rope_theta": config["rope_parameters"]["rope_theta"]}
    (folder / "config.json").write_text(json.dumps(config))
    model, tokenizer = lora_model_from(folder, load_in_4bit=False)
    if truncate:
        (result,) = model.save_pretrained_gguf(tmp_path / "gguf", tokenizer, "f32", verbose=False)
    else:
        with pytest.warns(UserWarning, match="truncate=False"):
            (result,) = model.save_pretrained_gguf(tmp_path / "gguf", tokenizer, "f32", verbose=False)
    check = check_gguf_file(model, result.path, tokenizer, n_tokens=N_TOKENS, method="f32")
    print(f"yarn truncate={truncate} {check.summary()}")
    assert check.tokenizer_equal and check.greedy_equal == check.prompts
    assert check.relative_diff <= (1e-5 if truncate else 1e-3), check.summary()
