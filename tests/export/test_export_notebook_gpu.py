"""The export notebook on its GPU defaults (run on the GPU machine: `pytest -m gpu tests/export`).

GPU defaults: 4-bit loading, the dtype picked for the card (bf16 on the H200), the merge on the GPU
under the panel's budget, then every reload check as in CI (merged folder in fp32 on the CPU, GGUF
in llama.cpp on the CPU). The model is a tiny default (nothing is downloaded on the GPU machine);
the GGUF form runs where llama-cpp-python is installed there. The executed notebook is kept in
runs/gpu-export/.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.notebooks.papermill_run import run_with_papermill

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.parametrize("model_name", ["notebookkit/tiny-llama", "notebookkit/tiny-qwen3"])
def test_export_notebook_on_gpu_defaults(model_name, monkeypatch):
    monkeypatch.chdir(ROOT)
    gguf = importlib.util.find_spec("llama_cpp") is not None
    forms = ["lora", "merged_16bit"] + (["gguf"] if gguf else [])
    out = ROOT / "runs" / "gpu-export"
    stem = model_name.split("/")[-1]
    params = {"MODEL_NAME": model_name, "EXPORT_FORMS": forms, "GGUF_METHODS": ["q8_0"],
              "OUTPUT_DIR": str(out / stem)}
    result = run_with_papermill("notebooks/export/export.ipynb", out / f"{stem}.ipynb", params, timeout=900)
    print(result.log_line(), "| GGUF form:", "yes" if gguf else "no (llama-cpp-python is not installed here)")
    assert result.ok, result.error
