"""Merged exports from a 2-bit or ternary base (``load_in_2bit`` / ``load_in_ternary``).

The embedded tiny-llama on each base, LoRA on every projection but ``down_proj`` (a packed layer without
an adapter) with a non-zero ``B``:

* ``merged_16bit``: every projection written is ``dtype(fp32 deq(W) + s B @ A)`` (``down_proj``: ``dtype(deq(W))``),
  against ``deq`` computed here from the format's definition (codes unpacked by hand) in float64; no
  packed tensor is written (the folder holds the dense checkpoint's names); ``config.json`` has no
  low-bit record; the folder reloads in plain transformers with the logits of the low-bit model within
  the written dtype's rounding (:func:`notebookkit.export.verify.check_merged_folder`), and in
  FastLanguageModel as a 16-bit model;
* the plan: the dense checkpoint's names and shapes (so the disk-space check and the shards count the
  dense bytes), the memory model's working set per layer, each packed layer decoded once, while
  writing, and no two decoded weights alive at a time;
* ``merged_4bit_forced`` from a 2-bit base: every projection in the folder (the one without an adapter too)
  holds the nearest NF4 levels of the merge computed here, and the check finds the export's own merge.

GGUF from a low-bit base: tests/export/test_gguf_llama_cpp.py (it needs llama-cpp-python).
"""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from safetensors import safe_open

from notebookkit.base_layers.low_bit_linear import is_low_bit_linear
from notebookkit.embedded.tiny import ensure_tiny_model
from notebookkit.export.merge import plan_merged_tensors
from notebookkit.export.verify import check_merged_folder, reload_merged_folder
from notebookkit.memory import merge_working_bytes
from tests.export.conftest import LOW_BIT_TARGETS, low_bit_lora_model
from tests.nf4_format import assert_packing_is_nearest_level

@pytest.fixture(scope="module")
def low_bit():
    """``low_bit(base_format)``: tiny-llama on that base with LoRA (conftest's ``low_bit_lora_model``), built once."""
    built: dict[str, tuple] = {}

    def get(base_format: str):
        if base_format not in built:
            built[base_format] = low_bit_lora_model("notebookkit/tiny-llama", base_format)
        return built[base_format]

    return get


def _dense_checkpoint() -> dict[str, tuple[int, ...]]:
    """Names and shapes of tiny-llama's own 16-bit checkpoint."""
    with safe_open(ensure_tiny_model("notebookkit/tiny-llama") / "model.safetensors", "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def _decoded_by_definition(layer) -> torch.Tensor:
    """``deq(W)`` of a 2-bit / ternary layer in float64, from its format's definition: column ``4j + t`` of a
    row in bits ``2t, 2t + 1`` of byte ``j``; 2-bit ``(code - zero) * scale``, ternary ``scale * (code - 1)``,
    one ``scale`` (and ``zero``) per group of ``group_size`` columns."""
    k = layer.in_features
    packed = layer.qweight.to(torch.int64)
    codes = ((packed.unsqueeze(-1) >> torch.tensor([0, 2, 4, 6])) & 3).reshape(packed.shape[0], -1)[:, :k].double()

    def per_column(t: torch.Tensor) -> torch.Tensor:
        return t.double().repeat_interleave(layer.group_size, dim=1)[:, :k]

    if layer.base_format == "2bit":
        return (codes - per_column(layer.zero)) * per_column(layer.scale)
    return per_column(layer.scale) * (codes - 1)


def _merges_by_definition(model) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """For each packed projection (by module name): ``deq(W)`` by definition, the LoRA update ``s B @ A`` (zeros
    without an adapter), ``|deq(W)| + s |B| @ |A|`` and the rank, all float64."""
    merges = {}
    for name, module in model.get_base_model().named_modules():
        lora = hasattr(module, "lora_A")
        layer = module.base_layer if lora else module
        if not is_low_bit_linear(layer) or name.endswith(".base_layer"):
            continue
        w64 = _decoded_by_definition(layer)
        if lora:
            a, b = module.lora_A["default"].weight.detach().double(), module.lora_B["default"].weight.detach().double()
            s = module.scaling["default"]
            assert float((s * b).abs().max()) > 1e-3, "the test's LoRA update is too small to see"
            merges[name] = (w64, s * b @ a, w64.abs() + s * b.abs() @ a.abs(), a.shape[0])
        else:
            merges[name] = (w64, torch.zeros_like(w64), w64.abs(), 0)
    return merges


def _assert_rounded_once(written: torch.Tensor, w64: torch.Tensor, delta: torch.Tensor, bound: torch.Tensor,
                         rank: int, name: str) -> None:
    """``written`` is ``w64 + delta`` (float64) rounded to its dtype: within half an ulp, plus fp32's rounding of
    the decode (two operations) and of the sum of ``rank + 1`` terms (``bound``: ``|w| + s |B| @ |A|``)."""
    info = torch.finfo(written.dtype)
    exact = w64 + delta
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(info.tiny)))) * info.eps  # subnormals: tiny * eps
    excess = (written.double() - exact).abs() - (0.5 * ulp * (1 + 2.0**-8) + (rank + 3) * 2.0**-24 * bound)
    worst = int(excess.argmax())
    assert float(excess.max()) <= 0, (f"{name} element {worst}: written {float(written.flatten()[worst])!r}, "
                                      f"exact {float(exact.flatten()[worst])!r}; {int((excess > 0).sum())} outside")


def _read_all(folder) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize("base_format, dtype", [("2bit", torch.bfloat16), ("ternary", torch.float16)])
def test_merged_16bit_from_a_low_bit_base(base_format, dtype, low_bit, tmp_path):
    from notebookkit import FastLanguageModel
    from notebookkit.memory.model_setup import base_format_of

    model, tokenizer = low_bit(base_format)
    out = tmp_path / "merged"
    model.save_pretrained_merged(out, tokenizer, dtype=dtype, verbose=False)
    config = json.loads((out / "config.json").read_text())
    assert "notebookkit_base_format" not in config and "quantization_config" not in config
    written = _read_all(out)
    assert {n: tuple(t.shape) for n, t in written.items()} == _dense_checkpoint()  # no qweight / scale / zero

    merges = _merges_by_definition(model)
    assert sum(rank > 0 for *_, rank in merges.values()) == len(LOW_BIT_TARGETS) * model.config.num_hidden_layers
    for name, (w64, delta, bound, rank) in merges.items():
        assert name.endswith(".down_proj") == (rank == 0)
        _assert_rounded_once(written[name + ".weight"], w64, delta, bound, rank, name)

    reloaded = reload_merged_folder(out)  # plain transformers
    assert all(type(m) is torch.nn.Linear for n, m in reloaded.named_modules() if n.endswith("_proj"))
    check = check_merged_folder(model, out, tokenizer, n_tokens=8)
    print(f"{base_format} merged_16bit ({check.dtype}): rel logit diff {check.relative_diff:.2e} (tolerance "
          f"{check.tolerance:.2e}), greedy equal {check.greedy_equal}/{check.prompts}")
    assert check.ok, check
    again, _ = FastLanguageModel.from_pretrained(str(out), load_in_4bit=False, show_banner=False)
    assert base_format_of(again) == "16bit"


@pytest.mark.parametrize("base_format", ["2bit", "ternary"])
def test_plan_of_a_low_bit_base_is_the_dense_checkpoint_streamed(base_format, low_bit, tmp_path, monkeypatch):
    """Names and shapes as the dense checkpoint (the disk-space check and shards count dense bytes), each weight
    of a linear layer with the memory model's working set, nothing decoded while planning, and while writing
    each packed layer decoded once with no earlier decoded weight still alive."""
    model, tokenizer = low_bit(base_format)
    layer_class = type(next(m for m in model.modules() if is_low_bit_linear(m)))
    real = layer_class.dequantized_weight
    decoded: list[weakref.ref] = []
    alive_at_each: list[int] = []

    def watched(self, dtype=None, device=None):
        alive_at_each.append(sum(ref() is not None for ref in decoded))
        weight = real(self, dtype, device)
        decoded.append(weakref.ref(weight))
        return weight

    monkeypatch.setattr(layer_class, "dequantized_weight", watched)
    plan = plan_merged_tensors(model, torch.bfloat16)
    assert not decoded, "planning decoded a weight"
    assert {t.name: t.shape for t in plan} == _dense_checkpoint()
    assert all(t.dtype == torch.bfloat16 for t in plan)
    layers = model.get_base_model().config.num_hidden_layers
    projections = [t for t in plan if t.linear_rank is not None]
    assert len(projections) == 7 * layers
    for t in projections:
        rank = 0 if t.name.endswith("down_proj.weight") else 8
        assert t.linear_rank == rank and t.working_bytes == merge_working_bytes(t.shape[0], t.shape[1], rank, 2)
    result = model.save_pretrained_merged(tmp_path / "m", tokenizer, dtype=torch.bfloat16, verbose=False)
    assert len(decoded) == 7 * layers and alive_at_each == [0] * len(decoded), alive_at_each
    assert result.merged_on == {"cpu": len(plan)}


def test_merged_4bit_forced_from_a_2bit_base(low_bit, tmp_path):
    """Every projection (the packed one without an adapter too) is written as the NF4 quantisation of its merge."""
    model, tokenizer = low_bit("2bit")
    out = tmp_path / "nf4"
    with pytest.warns(UserWarning, match="merged_16bit' is the lossless choice"):
        model.save_pretrained_merged(out, tokenizer, save_method="merged_4bit_forced", verbose=False)
    assert "notebookkit_base_format" not in json.loads((out / "config.json").read_text())
    reloaded = reload_merged_folder(out)
    four_bit = {n: m for n, m in reloaded.named_modules() if type(m).__name__ == "Linear4bit"}
    merges = _merges_by_definition(model)
    assert set(four_bit) == set(merges) and len(merges) == 7 * reloaded.config.num_hidden_layers
    for name, (w64, delta, _, _) in merges.items():  # the nearest NF4 levels of the merge computed here
        module = four_bit[name]
        assert_packing_is_nearest_level((w64 + delta).float(), module.weight.data, module.weight.quant_state)
    check = check_merged_folder(model, out, tokenizer, n_tokens=4)
    print(f"2bit merged_4bit_forced: rel logit diff {check.relative_diff:.3f}, greedy {check.greedy_equal}/{check.prompts}")
    assert check.ok and check.weights_exact
