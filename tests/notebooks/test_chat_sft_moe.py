"""The chat SFT notebook's mixture-of-experts choice (``MOE = True``).

* Its GPU defaults (gpt-oss-20b's 16-bit copy in NF4, the LoRA rank, sequence length and batch size the resolve
  cell fills in) fit a T4 by the memory model, as the notebook's own verdict cell computes it, and fit a 24 GB
  card; four times the rank or eight times the sequence length does not fit a T4, and the verdict says what to
  change.
* On the CPU the same switch runs the tiny gpt-oss through the whole notebook, its learning-signal cell included
  (papermill, about 20 s).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "notebooks" / "sft" / "chat_sft.py"


def _cells(*needles: str) -> list[str]:
    """The notebook's parameters cell, then the first code cell holding each of ``needles``, in order."""
    import jupytext

    code = [c for c in jupytext.read(SOURCE).cells if c.cell_type == "code"]
    cells = [next(c.source for c in code if "parameters" in c.metadata.get("tags", []))]
    for needle in needles:
        found = [c.source for c in code if needle in c.source]
        assert len(found) == 1, f"{SOURCE.name}: expected one code cell with {needle!r}, found {len(found)}"
        cells.append(found[0])
    return cells


def _run_verdict_cells(monkeypatch, tmp_path, on_gpu: bool, **parameters) -> dict:
    """The parameters cell (with ``parameters`` set after it, as papermill does), the resolve cell and the
    verdict cell, run as the notebook runs them on a GPU (a T4) or on the CPU; returns the namespace."""
    monkeypatch.chdir(tmp_path)  # the resolve cell creates OUTPUT_DIR
    monkeypatch.setattr(sys, "argv", ["chat_sft.py"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: on_gpu)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    params, resolve, verdict = _cells("resolve_parameters(", "card_verdicts(")
    ns: dict = {}
    exec(compile(params, "parameters", "exec"), ns)
    ns.update(parameters)
    for name, source in (("resolve", resolve), ("verdict", verdict)):
        exec(compile(source, name, "exec"), ns)
    return ns


# ids: a test whose id says "gpu" is skipped without a GPU (tests/conftest.py); this one only pretends to have a T4
@pytest.mark.parametrize("on_gpu", [True, False], ids=["on-t4", "on-cpu"])
def test_moe_default_fits_a_t4(monkeypatch, tmp_path, capsys, on_gpu):
    ns = _run_verdict_cells(monkeypatch, tmp_path, on_gpu, MOE=True)
    t4, card24 = ns["gpu_verdicts"]
    est = t4.result.estimate
    assert ns["gpu_run"]["MODEL_NAME"] == "unsloth/gpt-oss-20b-BF16" and est.shape.num_experts == 32
    assert est.inputs["base_format"] == "nf4" and est.inputs["dtype"] == "float16"  # a T4 has no bf16
    assert (est.inputs["lora_r"], est.inputs["seq_len"]) == (ns["gpu_run"]["LORA_R"], ns["gpu_run"]["MAX_SEQ_LENGTH"])
    assert t4.result.budget_label == "Tesla T4 16GB" and t4.fits and t4.total <= t4.result.budget_bytes, str(t4)
    assert card24.result.budget_label == "NVIDIA L4 24GB" and card24.fits, str(card24)
    printed = capsys.readouterr().out
    assert f"Tesla T4 16GB: {est.total / 2**30:.2f} GiB of 14.75 GiB — fits" in printed, printed
    if on_gpu:  # what the GPU run trains is what the verdict is for
        want = dict(MODEL_NAME="unsloth/gpt-oss-20b-BF16", LOAD_IN_4BIT=True, MAX_SEQ_LENGTH=1024, LORA_R=8,
                    BATCH_SIZE=1, GRAD_ACCUM=4, CALIBRATION_STEPS=0)
    else:  # the CPU trains the tiny gpt-oss
        want = dict(MODEL_NAME="notebookkit/tiny-gpt_oss", LOAD_IN_4BIT=False, MAX_SEQ_LENGTH=512, LORA_R=8,
                    MAX_STEPS=60, LEARNING_RATE=5e-3, MIN_LOSS_DROP=0.1)
    assert {k: ns[k] for k in want} == want


@pytest.mark.parametrize("grown, factor", [("LORA_R", 4), ("MAX_SEQ_LENGTH", 8)])
def test_moe_default_grown_past_the_t4_does_not_fit(monkeypatch, tmp_path, grown, factor):
    """The default is inside the T4's budget, and the verdict says what to change once it is not: four times its
    rank, or eight times its sequence length (the estimate's longest on a T4 at the default rank is about 4,800
    tokens). While gpt-oss ran Hugging Face's eager attention, twice either did not fit; the fused attention with
    sinks leaves that room by the memory model, and the defaults stay until a T4 emulation has measured it."""
    default = _run_verdict_cells(monkeypatch, tmp_path, True, MOE=True)["gpu_run"][grown]
    ns = _run_verdict_cells(monkeypatch, tmp_path, True, MOE=True, **{grown: factor * default})
    t4 = ns["gpu_verdicts"][0]
    assert not t4.fits and "does not fit" in str(t4) and "What to change" in str(t4), str(t4)


@pytest.mark.slow
def test_moe_on_cpu_trains_the_tiny_moe_through_the_notebook(tmp_path, monkeypatch):
    from tests.notebooks.papermill_run import run_with_papermill

    monkeypatch.chdir(ROOT)
    run = run_with_papermill("notebooks/sft/chat_sft.ipynb", tmp_path / "chat_sft_moe.ipynb",
                             dict(MOE=True, OUTPUT_DIR=str(tmp_path / "out")), timeout=300)
    print(run.log_line())
    assert run.ok, run.error
    out = run.stdout()
    for line in ("MODEL_NAME: notebookkit/tiny-gpt_oss", "MoE experts", "Memory estimate for unsloth/gpt-oss-20b-BF16",
                 "Tesla T4 16GB:", "NVIDIA L4 24GB:", "chat template: the one its tokenizer ships",
                 "learning signal: OK"):
        assert line in out, f"{line!r} not in the notebook's output:\n{out[-4000:]}"
    assert (tmp_path / "out" / "lora_adapter" / "adapter_model.safetensors").is_file()
