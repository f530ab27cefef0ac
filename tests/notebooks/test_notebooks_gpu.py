"""GPU runs of the notebooks (on the GPU machine: `pytest -m gpu`): chat_sft.ipynb on a real-size, random-weight
model, in bf16 and as a T4 runs it (fp16, 15 GiB cap); the DPO, GRPO and vision notebooks on their tiny defaults
as a T4 runs them.

The model has the shapes of Llama-3.2-1B (or Llama-3.1-8B with NOTEBOOKKIT_GPU_SHAPE=8b) and random
weights, with the tiny default's tokenizer, so nothing is downloaded. The notebook runs with 4-bit
loading, the 30-step calibration and 60 training steps; the executed notebook and its figures
(dashboard.png, loss_curve.png, calibration.png) are kept in runs/gpu-chat-sft/.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.notebooks.papermill_run import run_with_papermill

ROOT = Path(__file__).resolve().parents[2]
#: NOTEBOOKKIT_GPU_SHAPE -> the model whose shape (notebookkit.memory.shapes) the random-weight checkpoint takes
SHAPES = {"1b": "meta-llama/Llama-3.2-1B", "8b": "meta-llama/Llama-3.1-8B"}


def _random_llama(folder: Path, shape: str) -> Path:
    """A random-weight checkpoint of that shape with the tiny Llama's tokenizer (benchmarks/t4_notebooks.py)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from t4_notebooks import build_text_checkpoint

    return build_text_checkpoint(folder, SHAPES[shape])


def _t4_env(tmp_path: Path) -> dict:
    """The kernel's environment for a T4 emulation: a ``sitecustomize`` that caps this process's VRAM at
    15 GiB (``set_per_process_memory_fraction``) before anything else runs. papermill's kernel inherits it
    (``run_with_papermill`` sets it in ``os.environ`` around the run)."""
    startup = tmp_path / "startup"
    startup.mkdir(exist_ok=True)
    (startup / "sitecustomize.py").write_text(
        "import torch\n"
        "total = torch.cuda.get_device_properties(0).total_memory\n"
        "torch.cuda.set_per_process_memory_fraction(min(1.0, 15 * 2**30 / total))\n"
    )
    return {"PYTHONPATH": os.pathsep.join([str(startup), os.environ.get("PYTHONPATH", "")])}


#: the DPO, GRPO and vision notebooks on their tiny defaults as a T4 runs them: 4-bit, fp16, the 15 GiB cap,
#: the tiny models' step counts and learning rates (the notebooks' GPU defaults are for real models)
T4_TINY_RUNS = {
    "dpo": ("notebooks/dpo/dpo.ipynb", dict(
        MODEL_NAME="notebookkit/tiny-llama", MAX_SEQ_LENGTH=256, MAX_STEPS=60, LEARNING_RATE=5e-4)),
    "grpo": ("notebooks/grpo/grpo.ipynb", dict(
        MODEL_NAME="notebookkit/tiny-llama", MAX_SEQ_LENGTH=256, PRIME_STEPS=40, PRIME_LEARNING_RATE=5e-3,
        GRPO_STEPS=50, MAX_COMPLETION_LENGTH=24, LEARNING_RATE=1e-3, FORMAT_ROWS=True)),
    # batches of 32 (8 x 4 accumulated): at the CPU run's 8, how much the tiny model learns to see depends on the
    # seed as much in bf16 as in fp16 (held-out accuracy 49/27/44% bf16 and 13/33/48% fp16 over seeds 3407/1/2,
    # benchmarks/vision_fp16_probe.py); at 32 both reach 57.5% (seed 3407)
    "vision": ("notebooks/vision/vision_sft.ipynb", dict(
        MODEL_NAME="notebookkit/tiny-qwen2.5-vl", MAX_SEQ_LENGTH=256, MAX_STEPS=450, LEARNING_RATE=5e-3, BATCH_SIZE=8,
        GRAD_ACCUM=4)),
}


@pytest.mark.gpu
@pytest.mark.long  # the vision case alone took 188 s on the H200 (session 18)
@pytest.mark.parametrize("kind", sorted(T4_TINY_RUNS))
def test_rl_and_vision_notebooks_t4_emulation_fp16(tmp_path, monkeypatch, kind):
    """Each notebook's own learning-signal cell passes under fp16 (GradScaler) with 4-bit weights and the
    15 GiB cap, on the fast path (generation for GRPO and the captions on the decode path)."""
    notebook, params = T4_TINY_RUNS[kind]
    monkeypatch.chdir(ROOT)
    out = ROOT / "runs" / f"gpu-{kind}-fp16"
    params = dict(params, LOAD_IN_4BIT=True, DTYPE="float16", OUTPUT_DIR=str(out))
    result = run_with_papermill(notebook, out / Path(notebook).name, params, timeout=1200, env=_t4_env(tmp_path))
    print(result.log_line())
    assert result.ok, result.error
    fp16 = [line for line in result.stdout().splitlines() if line.startswith("fp16: ")]
    print("\n".join(fp16))
    assert fp16 and all(line.startswith("fp16: 0 of ") for line in fp16), fp16


@pytest.mark.gpu
def test_chat_sft_on_gpu_real_size_random_weights(tmp_path, monkeypatch):
    shape = os.environ.get("NOTEBOOKKIT_GPU_SHAPE", "1b")
    folder = _random_llama(tmp_path / f"random-llama-{shape}", shape)
    monkeypatch.chdir(ROOT)
    out = ROOT / "runs" / "gpu-chat-sft"
    params = dict(
        MODEL_NAME=str(folder), CHAT_TEMPLATE="llama-3", LOAD_IN_4BIT=True, MAX_STEPS=60, CALIBRATION_STEPS=30,
        LEARNING_RATE=1e-3, MIN_LOSS_DROP=0.1, OUTPUT_DIR=str(out),
    )
    result = run_with_papermill("notebooks/sft/chat_sft.ipynb", out / "chat_sft.ipynb", params, timeout=1800)
    print(result.log_line())
    assert result.ok, result.error
    assert (out / "dashboard.png").exists() and (out / "calibration.png").exists()


@pytest.mark.gpu
def test_chat_sft_t4_emulation_fp16_under_15_gib(tmp_path, monkeypatch):
    """The T4 path end to end: fp16 weights (HF Trainer fp16=True, GradScaler), a 15 GiB VRAM cap set in the
    kernel before anything else (``set_per_process_memory_fraction``, through a ``sitecustomize`` on its path),
    no optimizer step skipped for overflow, and the notebook's own learning-signal cell passes."""
    folder = _random_llama(tmp_path / "random-llama-1b", "1b")
    env = _t4_env(tmp_path)
    monkeypatch.chdir(ROOT)
    out = ROOT / "runs" / "gpu-chat-sft-fp16"
    params = dict(
        MODEL_NAME=str(folder), CHAT_TEMPLATE="llama-3", LOAD_IN_4BIT=True, DTYPE="float16", MAX_STEPS=40,
        CALIBRATION_STEPS=0, LEARNING_RATE=1e-3, MIN_LOSS_DROP=0.1, OUTPUT_DIR=str(out),
    )
    result = run_with_papermill("notebooks/sft/chat_sft.ipynb", out / "chat_sft.ipynb", params, timeout=1800, env=env)
    print(result.log_line())
    assert result.ok, result.error
    line = next(l for l in result.stdout().splitlines() if l.startswith("fp16:"))
    print(line)
    assert line.startswith("fp16: 0 of "), line
