"""The export's working set in the memory model, and the GPU budget the merge keeps to."""

from __future__ import annotations

import pytest
import torch

from notebookkit.export.merge import plan_merged_tensors
from notebookkit.memory import export_memory, merge_working_bytes, model_shape


def test_llama_8b_working_set_is_one_mlp_projection():
    shape = model_shape("meta-llama/Llama-3.1-8B-Instruct")
    mem = export_memory(shape, r=16)
    assert mem.device_peak_bytes == 14336 * 4096 * 6 + 16 * (14336 + 4096) * 4  # gate/up/down: fp32 + bf16 + factors
    assert mem.host_peak_bytes == 128256 * 4096 * 2  # the embedding (and the untied head), one at a time
    assert 15.5e9 < mem.total_bytes < 16.2e9  # ~8.03 B parameters in bf16


def test_plan_uses_the_memory_model(llama_nf4):
    model, _ = llama_nf4
    plan = plan_merged_tensors(model, torch.bfloat16)
    proj = [t for t in plan if t.name.endswith("_proj.weight")]
    assert len(proj) == 7 * model.get_base_model().config.num_hidden_layers
    for t in proj:
        assert t.working_bytes == merge_working_bytes(t.shape[0], t.shape[1], 8, 2)
    shape = model_shape(model.get_base_model().config)
    assert export_memory(shape, r=8).device_peak_bytes == max(t.working_bytes for t in plan)


@pytest.mark.gpu
@pytest.mark.parametrize("fraction", [0.5, 0.02])
def test_gpu_merge_stays_under_budget(fraction, tmp_path):
    """On the GPU: peak allocated during the export stays under fraction x the card; with a budget
    smaller than the loaded model every tensor merges on the CPU instead."""
    from tests.export.conftest import lora_model

    model, tokenizer = lora_model("llama", load_in_4bit=True)
    device = next(model.parameters()).device
    assert device.type == "cuda"
    result = model.save_pretrained_merged(tmp_path / "m", tokenizer, maximum_memory_usage=fraction, verbose=False)
    budget = torch.cuda.get_device_properties(device).total_memory * fraction
    if torch.cuda.memory_allocated(device) > budget:
        assert set(result.merged_on) == {"cpu"}
    else:
        assert result.gpu_peak_bytes <= budget and result.merged_on.get("cuda", 0) > 0
