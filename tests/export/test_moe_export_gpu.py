"""The mixture-of-experts families' exports on the GPU (#36): merged 16-bit in shards reloads in plain transformers
with the adapter model's logits, and the 16-bit GGUF holds the merged experts in llama.cpp's layout.

Per family (Qwen3-MoE, gpt-oss) and 16-bit dtype (bf16, and fp16 where the family's record allows it), the tiny
default on the device with LoRA r=8 on the attention and on both stacked expert weights (random ``B``,
``tests/export/conftest.lora_model_from``):

* ``merged_16bit`` with a 1 MB shard limit (2-3 shards) reloads with ``AutoModelForCausalLM`` on the same device in
  the same dtype (HF's eager expert loop: its reference; ``grouped_mm``, its CUDA default, is another kernel). Its
  logits on the export checks' prompts are the adapter model's within :class:`~notebookkit.export.verify.MergedCheck`'s
  rule: the written dtype's tolerance (``MERGED_TOLERANCE``, relative to the largest logit: ``2^-6`` in bf16, ``2^-9``
  in fp16) plus twice the 16-bit arithmetic's own noise, measured here as the same folder reloaded in that dtype
  against it reloaded in fp32. On a CPU: bf16 0.7-0.9% against a bound of 2.8%, fp16 0.08-0.14% against 0.34-0.35%;
  with the experts' LoRA left out of the merge 13% (Qwen3-MoE) and 44% (gpt-oss).
* GGUF in the same 16-bit type (``bf16`` / ``f16``), read back with the ``gguf`` package (llama.cpp is not on the GPU
  machine; ``test_gguf_llama_cpp.py`` runs the MoE files in it on the CPU): each layer's ``ffn_{gate,up,down}_exps``
  (and gpt-oss's biases) under llama.cpp's names and shapes hold the merged folder's experts, to one unit in the
  last place (bit for bit on a CPU; the GGUF merges each stack in one batched product, Qwen3-MoE's folder one
  expert at a time, and a GPU may sum those in another order). Planted once each on a CPU, gate and up swapped in
  the GGUF, or the experts' LoRA left out of the batched merge alone (the GGUF's; Qwen3-MoE's folder keeps it), fail.
* Every token goes to every expert (``num_experts_per_tok`` raised to the expert count in a copy of the tiny
  default): with the tiny defaults' top-2 of 4 or 8 random experts, 16-bit rounding decides the router's near-ties
  either way, and one token sent to another expert moves the logits by 15-44% of the largest (tiny gpt-oss on a
  CPU), about what a missing adapter does. With all experts routed there is no choice to flip and every expert's
  adapter reaches the logits. Routing itself is ``tests/models/test_moe*.py``'s to test.
* NF4 bases are not here: a merged export of NF4 experts is refused (``notebookkit.export.merge_experts``), and the
  NF4 load needs bitsandbytes.

The CPU cases run the same bodies (a few seconds each); ``test_merged_moe.py`` holds the fp32 merge to PEFT's own.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from notebookkit.embedded.tiny import ensure_tiny_model
from notebookkit.export.verify import MERGED_TOLERANCE, adapter_logits, prompt_ids
from notebookkit.families import FAMILIES
from tests.export.conftest import lora_model_from
from tests.export.gguf_reading import dense, read_gguf

CASES = [(family, dtype) for family, row in FAMILIES.items() if row.moe is not None
         for dtype in (torch.bfloat16, torch.float16) if dtype == torch.bfloat16 or row.fp16_overflow is None]
DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu), "cpu"]
GGUF_METHOD = {torch.bfloat16: "bf16", torch.float16: "f16"}


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module", params=CASES, ids=lambda case: f"{case[0]}-{str(case[1]).split('.')[-1]}")
def exported(request, device, tmp_path_factory):
    """``(family, dtype, device, adapter model, tokenizer, merged folder)``; the folder written in 1 MB shards."""
    family, dtype = request.param
    moe = FAMILIES[family].moe
    folder = tmp_path_factory.mktemp(family) / "every-expert"
    shutil.copytree(ensure_tiny_model(f"notebookkit/tiny-{family}"), folder)
    config = AutoConfig.from_pretrained(folder)
    config.num_experts_per_tok = getattr(config, moe.num_experts)  # module docstring: no routing choice to flip
    config.save_pretrained(folder)
    placement = {"cuda": None, "cpu": "cpu"}[device]  # None: the loader's default, this process's GPU
    model, tokenizer = lora_model_from(folder, load_in_4bit=False, dtype=dtype, device_map=placement)
    assert next(model.parameters()).device.type == device
    assert any(".experts." in name for name, _ in model.named_parameters() if "lora_B" in name)
    merged = folder.parent / "merged"
    result = model.save_pretrained_merged(merged, tokenizer, max_shard_size="1MB", verbose=False)
    shards = set(json.loads((merged / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) >= 2, result.notes
    return family, dtype, device, model, tokenizer, merged


def test_merged_folder_reloads_on_the_device_with_the_adapter_models_logits(exported):
    family, dtype, device, model, tokenizer, folder = exported
    reload = {dt: AutoModelForCausalLM.from_pretrained(folder, dtype=dt, device_map={"": device},
                                                       experts_implementation="eager").eval()
              for dt in (dtype, torch.float32)}
    assert reload[dtype].model.layers[0].mlp.experts.gate_up_proj.device.type == device
    diff = noise = scale = 0.0
    for ids in prompt_ids(tokenizer):
        ours = adapter_logits(model, ids)
        theirs, exact = adapter_logits(reload[dtype], ids), adapter_logits(reload[torch.float32], ids)
        diff = max(diff, float((ours - theirs).abs().max()))
        noise = max(noise, float((theirs - exact).abs().max()))
        scale = max(scale, float(ours.abs().max()))
    bound = MERGED_TOLERANCE[dtype] * scale + 2 * noise
    print(f"{family} {dtype} on {device}: relative difference {diff / scale:.2e}, noise {noise / scale:.2e}, "
          f"bound {bound / scale:.2e}")
    assert diff <= bound


def _experts_in_llama_cpp_layout(weights: dict, layer: int, moe, num_experts: int) -> dict:
    """Layer ``layer``'s experts in the merged folder's ``weights`` as llama.cpp stores them (PyTorch's axis order):
    ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]``, ``ffn_down_exps`` ``[E, H, I]``, gpt-oss's biases ``[E, I]`` /
    ``[E, H]``."""
    prefix, blk = f"model.layers.{layer}.mlp.experts", f"blk.{layer}.ffn"
    if moe.saved_per_expert:  # Qwen3-MoE's checkpoints: one linear layer ([out, in]) an expert and projection
        return {f"{blk}_{short}_exps.weight": torch.stack([weights[f"{prefix}.{e}.{name}.weight"]
                                                          for e in range(num_experts)])
                for short, name in zip(("gate", "up", "down"), moe.saved_per_expert)}
    # gpt-oss: stacked [E, in, out], gate and up interleaved along the output axis (gate first), with biases
    gate_up, gate_up_bias = weights[f"{prefix}.gate_up_proj"].transpose(1, 2), weights[f"{prefix}.gate_up_proj_bias"]
    return {f"{blk}_gate_exps.weight": gate_up[:, 0::2], f"{blk}_up_exps.weight": gate_up[:, 1::2],
            f"{blk}_down_exps.weight": weights[f"{prefix}.down_proj"].transpose(1, 2),
            f"{blk}_gate_exps.bias": gate_up_bias[:, 0::2], f"{blk}_up_exps.bias": gate_up_bias[:, 1::2],
            f"{blk}_down_exps.bias": weights[f"{prefix}.down_proj_bias"]}


def test_gguf_experts_are_the_merged_folders(exported):
    pytest.importorskip("gguf")
    family, dtype, _, model, tokenizer, folder = exported
    (result,) = model.save_pretrained_gguf(folder.parent / "gguf", tokenizer, GGUF_METHOD[dtype], modelfile=False,
                                           verbose=False)
    tensors, _ = read_gguf(result.path)
    weights = {}
    for shard in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(shard))
    config, moe = model.get_base_model().config, FAMILIES[family].moe
    want = {}
    for layer in range(config.num_hidden_layers):
        want.update(_experts_in_llama_cpp_layout(weights, layer, moe, getattr(config, moe.num_experts)))
    assert {name for name in tensors if "_exps." in name} == set(want)
    for name, merged in want.items():
        got = torch.from_numpy(dense(tensors[name]).copy())
        # one unit in the last place of the tensor's largest element: the folder's merge and the GGUF's
        # batched one sum W + s B A in another order on the GPU, and where the two terms nearly cancel an
        # element's own last place is far finer than the rounding of its terms (H200: 7e-10 off an
        # element of 1.5e-8 in Qwen3-MoE's down experts)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got, merged.float(), rtol=eps, atol=eps * float(merged.float().abs().max()),
                                   msg=lambda m: f"{name}: {m}")
