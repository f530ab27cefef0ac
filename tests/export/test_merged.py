"""merged_16bit / lora exports: streamed shards, exact merge arithmetic, plain-transformers reload."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from notebookkit.export.checks import ExportError
from notebookkit.export.merge import plan_merged_tensors
from notebookkit.export.verify import check_merged_folder
from notebookkit.kernels.nf4 import NF4_LEVELS


def _nf4_decoded_float64(weight) -> torch.Tensor:
    """NF4 decoded from the format's definition, in float64 (independent of notebookkit's decode)."""
    qs = weight.quant_state
    flat = weight.data.reshape(-1).to(torch.int64)
    codes = torch.stack((flat >> 4, flat & 15), 1).reshape(-1)
    n = qs.shape[0] * qs.shape[1]
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float64)[codes[:n]]
    if qs.state2 is not None:
        s2 = qs.state2
        absmax = s2.code.double()[qs.absmax.long()] * s2.absmax.double().repeat_interleave(s2.blocksize)[: qs.absmax.numel()]
        absmax = absmax.float().double() + float(qs.offset)  # bitsandbytes rounds the product to fp32
    else:
        absmax = qs.absmax.double()
    return (levels * absmax.float().double().repeat_interleave(qs.blocksize)[:n]).reshape(qs.shape)


def _read(folder, name):
    index = os.path.join(folder, "model.safetensors.index.json")
    shard = json.load(open(index))["weight_map"][name] if os.path.exists(index) else "model.safetensors"
    with safe_open(os.path.join(folder, shard), "pt") as f:
        return f.get_tensor(name)


def test_merged_weights_equal_float64_merge_rounded_once(llama_nf4, tmp_path):
    """Each merged projection is fp64(W) + s*B@A rounded to the written dtype: within 1 ulp of it
    (the fp32 sum may round the other way at a bf16 boundary), exact in the NF4 decode."""
    model, tokenizer = llama_nf4
    out = tmp_path / "merged"
    model.save_pretrained_merged(out, tokenizer, dtype=torch.bfloat16, verbose=False)
    layer = model.get_base_model().model.layers[1].mlp.down_proj
    w64 = _nf4_decoded_float64(layer.base_layer.weight)
    a, b = layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double()
    expected = (w64 + layer.scaling["default"] * b @ a).to(torch.bfloat16)
    written = _read(out, "model.layers.1.mlp.down_proj.weight")
    assert written.dtype == torch.bfloat16 and written.shape == expected.shape
    ulp = (written.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert int(ulp.max()) <= 1 and float((ulp > 0).float().mean()) < 0.01
    assert not torch.equal(written, w64.to(torch.bfloat16)), "the LoRA update is missing from the merged weight"


@pytest.mark.parametrize("setting", ["global", "legacy"])
def test_merge_products_are_ieee_fp32_under_a_tf32_setting(llama_nf4, tmp_path, setting):
    """With TF32 on (``tf32=True`` training sets ``torch.backends.fp32_precision = "tf32"`` through transformers;
    older notebooks call ``set_float32_matmul_precision("high")``) the merge's B @ A still runs at full fp32
    precision, the merge does not raise on the mixed settings, and the user's setting is back afterwards."""
    from notebookkit.export import merge

    model, tokenizer = llama_nf4
    matmuls = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    saved = (torch.backends.fp32_precision, *(m.fp32_precision for m in matmuls))
    try:
        if setting == "global":
            torch.backends.fp32_precision = "tf32"
        else:
            torch.set_float32_matmul_precision("high")
        user = [m.fp32_precision for m in matmuls]
        assert user == ["tf32", "tf32"]
        with merge.ieee_fp32_matmul():
            assert [m.fp32_precision for m in matmuls] == ["ieee", "ieee"]
        assert [m.fp32_precision for m in matmuls] == user
        model.save_pretrained_merged(tmp_path / "merged", tokenizer, dtype=torch.bfloat16, verbose=False)
        assert [m.fp32_precision for m in matmuls] == user
    finally:
        torch.backends.fp32_precision = saved[0]
        for m, p in zip(matmuls, saved[1:]):
            m.fp32_precision = p


def test_shards_follow_max_shard_size_and_index(llama_nf4, tmp_path):
    model, tokenizer = llama_nf4
    out = tmp_path / "sharded"
    result = model.save_pretrained_merged(out, tokenizer, max_shard_size="1MB", verbose=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    plan = plan_merged_tensors(model, torch.float32)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in plan)
    largest = max(t.nbytes for t in plan)
    for shard in shards:  # every shard under the limit unless it holds one tensor larger than it
        with safe_open(out / shard, "pt") as f:
            keys = list(f.keys())
        assert (out / shard).stat().st_size <= max(10**6, largest) + 8 * 2**10 or len(keys) == 1
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once, as the embedding
    assert result.merged_on == {"cpu": len(plan)}


def test_merged_folder_reloads_in_plain_transformers(llama_nf4, tmp_path):
    model, tokenizer = llama_nf4
    out = tmp_path / "reload"
    model.save_pretrained_merged(out, tokenizer, verbose=False)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    check = check_merged_folder(model, out, tokenizer)
    assert check.ok, check
    assert check.greedy_equal == check.prompts
    gen = json.loads((out / "generation_config.json").read_text())
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert eot in (gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]])
    assert (out / "tokenizer.json").exists() and "<|start_header_id|>" in (out / "chat_template.jinja").read_text()


def test_bf16_merge_within_stated_tolerance(llama_nf4, tmp_path):
    model, tokenizer = llama_nf4
    out = tmp_path / "bf16"
    model.save_pretrained_merged(out, tokenizer, dtype="bfloat16", verbose=False)
    check = check_merged_folder(model, out, tokenizer)
    assert check.dtype == "bfloat16" and check.ok, check
    assert check.relative_diff > 0  # bf16 rounding is visible: the check compares different arithmetic


def test_lora_form_is_peft_adapter(llama_nf4, tmp_path):
    from peft import PeftConfig

    model, tokenizer = llama_nf4
    out = tmp_path / "adapter"
    model.save_pretrained_merged(out, tokenizer, save_method="lora")
    assert PeftConfig.from_pretrained(out).r == 8
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k for k in keys)


def test_unknown_save_method(llama_nf4, tmp_path):
    model, tokenizer = llama_nf4
    with pytest.raises(ExportError, match="'merged_16bit', 'lora', 'merged_4bit_forced'"):
        model.save_pretrained_merged(tmp_path / "x", tokenizer, save_method="fp8")
    assert not (tmp_path / "x").exists()


def test_failed_export_leaves_no_folder(llama_nf4, tmp_path, monkeypatch):
    """An error mid-way (here: the third tensor) removes the partial folder; nothing named like the target."""
    import notebookkit.export.safetensors_stream as stream

    model, tokenizer = llama_nf4
    real = stream._write_tensor
    calls = {"n": 0}

    def failing(fh, tensor, planned):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("disk went away")
        real(fh, tensor, planned)

    monkeypatch.setattr(stream, "_write_tensor", failing)
    with pytest.raises(RuntimeError, match="disk went away"):
        model.save_pretrained_merged(tmp_path / "half", tokenizer, verbose=False)
    assert list(tmp_path.iterdir()) == []
