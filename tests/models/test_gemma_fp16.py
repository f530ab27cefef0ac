"""Gemma 2 and 3 in fp16: the decision (fp32 on a GPU without bf16, float16 refused) and the reason for it.

Random tiny weights keep every activation near 1, so fp16 looks fine on them. Real Gemma 2/3 checkpoints carry
residual-stream values of 1e4-1e5. Here the tiny models' embedding table is scaled until the residual stream
reaches 9e4 (measured in fp32): stock Hugging Face in fp16 then returns non-finite logits, while fp32 stays
finite and notebookkit's fp32 path matches it. That is why the family record marks ``fp16_overflow`` and the
loader picks fp32 instead (``notebookkit.models.common.precision.family_dtype``).
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from notebookkit.families import FAMILIES
from notebookkit.models import FastLanguageModel
from notebookkit.models.common.precision import family_dtype

from .helpers import tiny_folder

RESIDUAL_TARGET = 9e4  # inside the 1e4-1e5 range of real Gemma 2/3 checkpoints


def _scaled_gemma(name: str):
    """The tiny model in fp32 with its embedding scaled so that the residual stream peaks at RESIDUAL_TARGET."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder(name), dtype=torch.float32).eval()
    ids = torch.arange(3, 40).reshape(1, -1)

    def residual_peak() -> float:  # the last hidden state is the final norm's output, not the residual stream
        return max(h.abs().max().item() for h in model(ids, output_hidden_states=True).hidden_states[:-1])

    with torch.no_grad():
        for _ in range(3):  # the peak is not linear in the scale at first (the layers add their own part)
            model.get_input_embeddings().weight.mul_(RESIDUAL_TARGET / residual_peak())
        peak = residual_peak()
    assert 1e4 <= peak <= 1e5, peak
    return model, ids


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_real_activation_magnitudes_overflow_fp16_but_not_fp32(name, tmp_path):
    model, ids = _scaled_gemma(name)
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        fp32 = model(ids).logits
        assert torch.isfinite(fp32).all()
        assert not torch.isfinite(model.half()(ids).logits).all()  # the same weights, in fp16
    fast, _ = _fast(tmp_path, name)
    with torch.no_grad():
        ours = fast.eval()(ids).logits
    assert torch.isfinite(ours).all()
    assert (ours - fp32).norm() / fp32.norm() < 1e-4


def _fast(folder, name):
    import shutil

    for f in Path(tiny_folder(name)).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, folder / f.name)
    return FastLanguageModel.from_pretrained(str(folder), dtype="float32", load_in_4bit=False, show_banner=False)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_float16_is_refused_and_auto_picks_fp32(name):
    config = types.SimpleNamespace(model_type=FAMILIES[name].model_types[0])
    notes = []
    banner = types.SimpleNamespace(note=notes.append)
    assert family_dtype(config, torch.float16, None, banner) == torch.float32  # dtype=None on a T4
    assert "65504" in notes[0]
    with pytest.raises(ValueError, match="dtype=float16 cannot .*'float32'"):
        family_dtype(config, torch.float16, "float16", banner)
    with pytest.raises(ValueError, match="bfloat16"):
        FastLanguageModel.from_pretrained(tiny_folder(name), dtype="float16", load_in_4bit=False, show_banner=False)
    assert family_dtype(config, torch.bfloat16, None, banner) == torch.bfloat16


@pytest.mark.parametrize("name", [n for n, row in FAMILIES.items() if row.fp16_overflow is None])
def test_other_families_keep_fp16(name):
    config = types.SimpleNamespace(model_type=FAMILIES[name].model_types[0])
    assert family_dtype(config, torch.float16, "float16") == torch.float16
