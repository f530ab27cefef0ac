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


# ---------------------------------------------------------------------------------- GPU, real layer sizes

#: Llama-3.1-8B's layer (the largest merge working set, 14336 x 4096) in two layers, small vocabulary.
EIGHT_B_LAYERS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096)
T4_BYTES = 15 * 2**30


@pytest.fixture
def memory_cap():
    """``cap(bytes)`` sets this process's CUDA memory fraction; restored afterwards."""
    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(device).total_memory
    before = torch.cuda.get_per_process_memory_fraction(device)

    def cap(n_bytes: int) -> None:
        torch.cuda.empty_cache()  # blocks cached by loading would count against the new cap
        torch.cuda.set_per_process_memory_fraction(min(1.0, n_bytes / total), device)

    yield cap
    torch.cuda.set_per_process_memory_fraction(before, device)
    torch.cuda.empty_cache()


def _nf4_model_with_8b_layers(folder):
    from transformers import LlamaConfig, LlamaForCausalLM

    from notebookkit import FastLanguageModel
    from notebookkit.embedded.tiny import load_corpus
    from tests.export.sentencepiece_models import build_tokenizer

    if not (folder / "config.json").exists():
        tokenizer = build_tokenizer("llama2", load_corpus("train")[:500])
        config = LlamaConfig(**EIGHT_B_LAYERS, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    model, tokenizer = FastLanguageModel.from_pretrained(str(folder), load_in_4bit=True, dtype=torch.bfloat16, show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, show_banner=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.01).to(p.dtype))
    return model, tokenizer


def _check_one_projection(model, folder):
    """The written down projection of layer 1 against fp64(NF4 decoded by definition) + s*B@A: <= 1 bf16 ulp."""
    import json

    from safetensors import safe_open

    from tests.nf4_format import decode_nf4_by_definition

    layer = model.get_base_model().model.layers[1].mlp.down_proj
    w64 = decode_nf4_by_definition(layer.base_layer.weight, out_dtype=torch.float32).double()
    a, b = layer.lora_A["default"].weight.detach().double().cpu(), layer.lora_B["default"].weight.detach().double().cpu()
    expected = (w64 + layer.scaling["default"] * b @ a).to(torch.bfloat16)
    name = "model.layers.1.mlp.down_proj.weight"
    index = folder / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors"
    with safe_open(folder / shard, "pt") as f:
        written = f.get_tensor(name)
    ulp = (written.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert int(ulp.max()) <= 1 and float((ulp > 0).float().mean()) < 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("cap", ["none", "t4", "tight"])
def test_gpu_merged_16bit_8b_layers_under_budget_and_cap(cap, tmp_path_factory, memory_cap):
    """merged_16bit of NF4 layers of Llama-3.1-8B's size with maximum_memory_usage=0.5: the GPU peak stays
    under 0.5 x the card, under a T4's 15 GiB cap (set_per_process_memory_fraction), and under a cap
    that leaves less than one MLP projection's working set above the loaded model (those merge on
    the CPU, the smaller ones on the GPU); the merged weights are right either way."""
    from notebookkit.export.merged import MergeDevice

    folder = tmp_path_factory.getbasetemp() / "nf4-8b-layers"
    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(device).total_memory
    model, tokenizer = _nf4_model_with_8b_layers(folder)
    loaded = torch.cuda.memory_allocated(device)
    largest = max(t.working_bytes for t in plan_merged_tensors(model, torch.bfloat16))
    cap_bytes = {"none": None, "t4": T4_BYTES, "tight": loaded + largest // 2}[cap]
    if cap_bytes is not None:
        memory_cap(cap_bytes)
    budget = min(0.5 * total, cap_bytes or float("inf"))
    assert MergeDevice(0.5).budget(device) == pytest.approx(budget, rel=1e-6)
    out = tmp_path_factory.mktemp(f"merged-{cap}")
    result = model.save_pretrained_merged(out / "m", tokenizer, maximum_memory_usage=0.5, verbose=False)
    print(f"cap {cap}: loaded {loaded / 2**30:.2f} GiB, peak {result.gpu_peak_bytes / 2**30:.2f} GiB, budget "
          f"{budget / 2**30:.2f} GiB, merged on {result.merged_on}, {result.seconds:.1f} s")
    assert result.gpu_peak_bytes <= budget
    if cap == "tight":
        assert result.merged_on.get("cpu", 0) > 0 and result.merged_on.get("cuda", 0) > 0
    else:
        assert set(result.merged_on) == {"cuda"}
    _check_one_projection(model, out / "m")
