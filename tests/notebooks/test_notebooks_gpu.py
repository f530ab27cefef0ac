"""GPU run of chat_sft.ipynb on a real-size, random-weight model (run on the GPU machine: `pytest -m gpu`).

The model has the shapes of Llama-3.2-1B (or Llama-3.1-8B with NOTEBOOKKIT_GPU_SHAPE=8b) and random
weights, with the tiny default's tokenizer, so nothing is downloaded. The notebook runs with 4-bit
loading, the 30-step calibration and 60 training steps; the executed notebook and its figures
(dashboard.png, loss_curve.png, calibration.png) are kept in runs/gpu-chat-sft/.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
}


def _random_llama(folder: Path, shape: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from notebookkit.embedded.tiny import resolve_model_name

    tiny = Path(resolve_model_name("notebookkit/tiny-llama"))
    cfg = LlamaConfig(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                      **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, folder / f.name)
    return folder


@pytest.mark.gpu
def test_chat_sft_on_gpu_real_size_random_weights(tmp_path, monkeypatch):
    from notebookkit.train.headless import run_notebook

    shape = os.environ.get("NOTEBOOKKIT_GPU_SHAPE", "1b")
    folder = _random_llama(tmp_path / f"random-llama-{shape}", shape)
    monkeypatch.chdir(ROOT)
    out = ROOT / "runs" / "gpu-chat-sft"
    params = dict(
        MODEL_NAME=str(folder), CHAT_TEMPLATE="llama-3", LOAD_IN_4BIT=True, MAX_STEPS=60, CALIBRATION_STEPS=30,
        LEARNING_RATE=1e-3, MIN_LOSS_DROP=0.1, OUTPUT_DIR=str(out),
    )
    result = run_notebook("notebooks/sft/chat_sft.ipynb", params, out / "chat_sft.ipynb", cell_timeout=1800)
    print(result.log_line())
    assert result.ok, result.error
    assert (out / "dashboard.png").exists() and (out / "calibration.png").exists()


@pytest.mark.gpu
def test_chat_sft_t4_emulation_fp16_under_15_gib(tmp_path, monkeypatch):
    """The T4 path end to end: fp16 weights (HF Trainer fp16=True, GradScaler), a 15 GiB VRAM cap set in the
    kernel before anything else (``set_per_process_memory_fraction``, through a ``sitecustomize`` on its path),
    no optimizer step skipped for overflow, and the notebook's own learning-signal cell passes."""
    import json

    from notebookkit.train.headless import run_notebook

    folder = _random_llama(tmp_path / "random-llama-1b", "1b")
    startup = tmp_path / "startup"
    startup.mkdir()
    (startup / "sitecustomize.py").write_text(
        "import torch\n"
        "total = torch.cuda.get_device_properties(0).total_memory\n"
        "torch.cuda.set_per_process_memory_fraction(min(1.0, 15 * 2**30 / total))\n"
    )
    monkeypatch.chdir(ROOT)
    out = ROOT / "runs" / "gpu-chat-sft-fp16"
    params = dict(
        MODEL_NAME=str(folder), CHAT_TEMPLATE="llama-3", LOAD_IN_4BIT=True, DTYPE="float16", MAX_STEPS=40,
        CALIBRATION_STEPS=0, LEARNING_RATE=1e-3, MIN_LOSS_DROP=0.1, OUTPUT_DIR=str(out),
    )
    env = {"PYTHONPATH": os.pathsep.join([str(startup), os.environ.get("PYTHONPATH", "")])}
    result = run_notebook("notebooks/sft/chat_sft.ipynb", params, out / "chat_sft.ipynb", cell_timeout=1800, env=env)
    print(result.log_line())
    assert result.ok, result.error
    outputs = "".join(  # nbformat keeps a stream's text as one string or as a list of lines
        "".join(o.get("text", "")) for c in json.loads((out / "chat_sft.ipynb").read_text())["cells"]
        if c["cell_type"] == "code" for o in c.get("outputs", [])
    )
    line = next(l for l in outputs.splitlines() if l.startswith("fp16:"))
    print(line)
    assert line.startswith("fp16: 0 of "), line
