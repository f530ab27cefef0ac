"""merged_16bit of the mixture-of-experts families (Qwen3-MoE, gpt-oss), fp32 tiny models with random LoRA on
the attention and on the stacked experts (PEFT ``target_parameters``): the folder is written in shards in the
family's checkpoint layout (Qwen3-MoE one expert at a time, gpt-oss stacked), reloads in plain transformers
with the adapter model's logits and greedy tokens, and holds the weights PEFT's own ``merge_and_unload`` makes."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from notebookkit.export.checks import ExportError
from notebookkit.export.verify import check_merged_folder, reload_merged_folder
from notebookkit.families import FAMILIES
from tests.export.conftest import lora_model

MOE_FAMILIES = [name for name, row in FAMILIES.items() if row.moe is not None]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_merged_folder_reloads_with_the_adapter_models_logits(family, tmp_path):
    model, tokenizer = lora_model(family, load_in_4bit=False)
    moe = FAMILIES[family].moe
    out = tmp_path / "merged"
    result = model.save_pretrained_merged(out, tokenizer, max_shard_size="1MB", verbose=False)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1 and not list(tmp_path.glob(".*partial*")), result
    names = set(weight_map)
    if moe.saved_per_expert:  # the published checkpoints' layout: experts.{e}.gate_proj.weight ...
        gate, up, down = moe.saved_per_expert
        assert {f"model.layers.1.mlp.experts.7.{p}.weight" for p in (gate, up, down)} <= names
        assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)
    else:
        assert {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj_bias"} <= names

    check = check_merged_folder(model, out, tokenizer, n_tokens=8)
    print(family, check)
    assert check.ok and check.greedy_equal == check.prompts, check

    # every tensor is PEFT's own merge (ParamWrapper.get_delta_weight for the experts), and the experts' LoRA is in it
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    reloaded = reload_merged_folder(out).state_dict()
    assert reloaded.keys() == reference.keys()
    for name, want in reference.items():
        assert torch.allclose(reloaded[name], want.float(), rtol=0, atol=1e-6), name
    experts = model.get_base_model().model.layers[1].mlp.experts.base_layer.base_layer
    assert not torch.allclose(reloaded["model.layers.1.mlp.experts.gate_up_proj"], experts.gate_up_proj.float())


def test_moe_merged_4bit_forced_refuses_saying_what_to_do(tmp_path):
    model, tokenizer = lora_model("gpt_oss", load_in_4bit=False)
    with pytest.raises(ExportError, match="mixture-of-experts.*merged_16bit.*load_in_4bit=True"):
        model.save_pretrained_merged(tmp_path / "nf4", tokenizer, save_method="merged_4bit_forced", verbose=False)
    assert not (tmp_path / "nf4").exists()
