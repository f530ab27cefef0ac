"""merged_4bit_forced: notebookkit's NF4 quantiser against the format's definition (tests/nf4_format.py,
never bitsandbytes' CPU decode), and the 4-bit folder as transformers + bitsandbytes load it."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from notebookkit.export.checks import ExportError
from notebookkit.export.merge import plan_merged_tensors
from notebookkit.export.merged_4bit import lora_update_norms
from notebookkit.export.nf4_quantize import NF4Weight, dynamic_map, quantize_nf4
from notebookkit.export.verify import check_merged_folder, reload_merged_folder
from notebookkit.kernels.nf4 import dequantize_nf4
from tests.nf4_format import assert_packing_is_nearest_level, decode_nf4_by_definition

SHAPES = [(48, 80), (37, 129), (5, 3), (129, 200)]  # rows not whole blocks, odd n, one block, two nested blocks


def test_dynamic_map_from_its_definition():
    """256 sorted distinct values in [-1, 1] with 0 and 1; the same table bitsandbytes builds."""
    import bitsandbytes.functional as bnbF

    table = dynamic_map()
    assert table.shape == (256,) and table.dtype == torch.float32
    assert bool((table[1:] > table[:-1]).all()) and float(table[0]) > -1 and float(table[-1]) == 1.0 and 0.0 in table.tolist()
    assert torch.equal(table, bnbF.create_dynamic_map(signed=True))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantiser_is_nearest_level_and_decodes_by_definition(shape, dtype):
    gen = torch.Generator().manual_seed(hash(shape) % 2**31)
    w = (torch.randn(shape, generator=gen) * 0.03).to(dtype)
    w.view(-1)[:64] = 0  # a block of zeros: absmax 0 decodes to 0
    q = quantize_nf4(w, chunk=256)  # several chunks, the last one short
    assert q.packed.dtype == torch.uint8 and q.packed.shape == ((w.numel() + 1) // 2, 1) and q.dtype == dtype
    assert_packing_is_nearest_level(w, q.packed, q)
    reference = decode_nf4_by_definition(q.packed, q, out_dtype=torch.float32)
    assert torch.equal(dequantize_nf4(q.packed, q, out_dtype=torch.float32), reference)
    assert torch.count_nonzero(reference.view(-1)[:64]) == 0
    error = float(((reference.double() - w.double()) ** 2).sum())
    assert q.squared_error == pytest.approx(error, rel=1e-9, abs=1e-30)
    assert q.squared_norm == pytest.approx(float((w.double() ** 2).sum()), rel=1e-12)
    assert torch.equal(quantize_nf4(w).packed, q.packed), "the chunk size changed the codes"


def test_swapped_nibbles_fail_the_definition():
    """Negative control: the definition's check catches a packing with the nibbles the other way round."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    q = quantize_nf4(w)
    swapped = ((q.packed & 0xF) << 4) | (q.packed >> 4)
    with pytest.raises(AssertionError, match="not a nearest NF4 level"):
        assert_packing_is_nearest_level(w, swapped, q)


def _merged_fp32(model) -> dict[str, torch.Tensor]:
    return {t.name: t.make(torch.device("cpu")) for t in plan_merged_tensors(model, torch.float32)}


@pytest.mark.parametrize("family, load_in_4bit", [("llama", True), ("qwen3", False)])
def test_4bit_folder_loads_in_transformers_with_the_nearest_levels(family, load_in_4bit, tmp_path):
    from tests.export.conftest import lora_model

    model, tokenizer = lora_model(family, load_in_4bit=load_in_4bit)
    out = tmp_path / "nf4"
    with pytest.warns(UserWarning, match=r"changed them by \d+\.\d\d% .*LoRA update itself.*merged_16bit' is the lossless choice"):
        result = model.save_pretrained_merged(out, tokenizer, save_method="merged_4bit_forced", verbose=False)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["load_in_4bit"] and config["bnb_4bit_quant_type"] == "nf4" and config["bnb_4bit_use_double_quant"]

    merged = _merged_fp32(model)
    reloaded = reload_merged_folder(out)
    four_bit = {name: m for name, m in reloaded.named_modules() if type(m).__name__ == "Linear4bit"}
    linears = {name for name, m in reloaded.named_modules() if isinstance(m, torch.nn.Linear)} - {"lm_head"}
    assert set(four_bit) == linears and len(four_bit) == 7 * reloaded.config.num_hidden_layers
    error = norm = 0.0
    for name, module in four_bit.items():  # what transformers loaded: the nearest NF4 levels of the merge
        w = merged[name + ".weight"]
        assert_packing_is_nearest_level(w, module.weight.data, module.weight.quant_state)
        decoded = decode_nf4_by_definition(module.weight.data, module.weight.quant_state, out_dtype=torch.float32)
        error += float(((decoded.double() - w.double()) ** 2).sum())
        norm += float((w.double() ** 2).sum())
    assert result.measurements["nf4_relative_error"] == pytest.approx(math.sqrt(error / norm), rel=1e-9)
    assert 0.05 < result.measurements["nf4_relative_error"] < 0.15  # NF4 on Gaussian-like weights: about 9-10%
    norm_layer = reloaded.model.layers[0].input_layernorm.weight
    assert torch.equal(norm_layer, merged["model.layers.0.input_layernorm.weight"].to(norm_layer.dtype))

    check = check_merged_folder(model, out, tokenizer, n_tokens=8)
    print(f"{family} merged_4bit_forced: max |logit diff| {check.max_abs_diff:.3f} (rel {check.relative_diff:.3f}), "
          f"greedy equal {check.greedy_equal}/{check.prompts}, weights {result.measurements}")
    assert check.ok and check.weights_exact and check.tolerance is None and check.dtype == "nf4"
    assert check.relative_diff > 2.0**-6  # the rounding is visible in the logits: stated, not hidden
    from notebookkit import FastLanguageModel

    again, _ = FastLanguageModel.from_pretrained(str(out), show_banner=False)  # the user's way back: 4-bit as written
    assert sum(type(m).__name__ == "Linear4bit" for m in again.modules()) == len(four_bit)


def test_update_norm_without_the_dense_product(llama_nf4):
    model, _ = llama_nf4
    norms = lora_update_norms(model)
    layer = model.get_base_model().model.layers[1].self_attn.v_proj
    b, a = layer.lora_B["default"].weight.detach().double(), layer.lora_A["default"].weight.detach().double()
    dense = layer.scaling["default"] * b @ a
    assert norms["model.layers.1.self_attn.v_proj.weight"] == pytest.approx(float((dense**2).sum()), rel=1e-10)


def test_check_fails_when_the_folder_holds_other_codes(llama_nf4, tmp_path, monkeypatch):
    """Negative control: a writer that swaps the nibbles still loads, but the check finds other weights."""
    model, tokenizer = llama_nf4
    real = NF4Weight.state_dict

    def swapped(self, name):
        parts = real(self, name)
        parts[name] = ((self.packed & 0xF) << 4) | (self.packed >> 4)
        return parts

    monkeypatch.setattr(NF4Weight, "state_dict", swapped)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained_merged(tmp_path / "bad", tokenizer, save_method="merged_4bit_forced", verbose=False)
    check = check_merged_folder(model, tmp_path / "bad", tokenizer, n_tokens=4)
    assert check.weights_exact is False and not check.ok


def test_merged_4bit_refused_with_the_alternatives(llama_nf4, tmp_path):
    model, tokenizer = llama_nf4
    with pytest.raises(ExportError, match=r"merged_4bit' re-quantises.*'merged_16bit' \(lossless.*'merged_4bit_forced'"):
        model.save_pretrained_merged(tmp_path / "x", tokenizer, save_method="merged_4bit")
    assert not (tmp_path / "x").exists()


@pytest.mark.gpu
def test_4bit_folder_quantised_on_the_gpu(tmp_path):
    """On CUDA the merge and the quantiser run on the GPU: the folder still holds the nearest NF4 levels
    of the merge (tests/nf4_format's definition), loads in 4-bit with FastLanguageModel, and the check
    finds exactly the merge's quantisation."""
    from notebookkit import FastLanguageModel
    from tests.export.conftest import lora_model

    model, tokenizer = lora_model("llama", load_in_4bit=True)
    assert next(model.parameters()).is_cuda
    with pytest.warns(UserWarning, match="merged_16bit' is the lossless choice"):
        result = model.save_pretrained_merged(tmp_path / "nf4", tokenizer, save_method="merged_4bit_forced", verbose=False)
    assert result.merged_on.get("cuda", 0) > 0
    merged = _merged_fp32(model)
    reloaded = reload_merged_folder(tmp_path / "nf4")
    for name, module in reloaded.named_modules():
        if type(module).__name__ == "Linear4bit":
            assert_packing_is_nearest_level(merged[name + ".weight"], module.weight.data, module.weight.quant_state)
    check = check_merged_folder(model, tmp_path / "nf4", tokenizer, n_tokens=8)
    print(f"GPU merged_4bit_forced: rel logit diff {check.relative_diff:.3f}, greedy {check.greedy_equal}/{check.prompts}")
    assert check.ok and check.weights_exact
    again, _ = FastLanguageModel.from_pretrained(str(tmp_path / "nf4"), show_banner=False)
    assert sum(type(m).__name__ == "Linear4bit" for m in again.modules()) == len(
        [n for n in merged if n.endswith("_proj.weight")])
