"""GGUF files as written (read back with the gguf package): names, types, layout conversions, tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from notebookkit.export.checks import ExportError
from notebookkit.export.gguf_arch import llama3_rope_factors, permute_for_llama_rope
from notebookkit.export.gguf_file import normalize_quantization_methods
from tests.export.conftest import lora_model
from tests.export.gguf_reading import dense, read_gguf

gguf = pytest.importorskip("gguf")


def test_permutation_moves_halves_to_adjacent_pairs():
    """Row 2i of a permuted head is row i of the original, row 2i+1 is row i + d/2 (two heads, d=4)."""
    w = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    p = permute_for_llama_rope(w, n_heads=2)
    for h in range(2):
        for i in range(2):
            assert torch.equal(p[h * 4 + 2 * i], w[h * 4 + i])
            assert torch.equal(p[h * 4 + 2 * i + 1], w[h * 4 + i + 2])


def test_llama3_rope_factors_against_transformers():
    """llama.cpp divides each frequency by the factor; transformers' llama3 init gives the divided
    frequencies directly: base frequencies / factors must equal them."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32, rope_parameters=rope)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / (500000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32))
    mine = base / llama3_rope_factors(32, rope).double()
    torch.testing.assert_close(mine, inv_freq.double(), rtol=1e-6, atol=0)
    assert 1.0 < float(llama3_rope_factors(32, rope).max()) <= 8.0


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_tensors_and_metadata(family, tmp_path):
    model, tokenizer = lora_model(family, load_in_4bit=family == "llama")
    result = model.save_pretrained_gguf(tmp_path, tokenizer, ["f32", "q8_0"], verbose=False)
    f32, q8 = (r.path for r in result)
    tensors, value = read_gguf(f32)
    config = model.get_base_model().config
    base = model.get_base_model().model
    assert value("general.architecture") == {"llama": "llama", "gemma2": "gemma2"}[family]
    assert value(f"{value('general.architecture')}.block_count") == config.num_hidden_layers
    assert "output.weight" not in tensors  # tied embeddings
    # merged q projection, permuted for llama (rotary layout), unchanged for gemma2
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    from notebookkit.export.merge import plan_merged_tensors

    merged = {t.name: t for t in plan_merged_tensors(model, torch.float32)}
    q_merged = merged["model.layers.0.self_attn.q_proj.weight"].make(torch.device("cpu"))
    expected = permute_for_llama_rope(q_merged, config.num_attention_heads) if family == "llama" else q_merged
    np.testing.assert_array_equal(dense(tensors["blk.0.attn_q.weight"]), expected.numpy())
    # norms: F32, Gemma's stored as 1 + w
    norm = tensors["blk.0.attn_norm.weight"]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32
    w = base.layers[0].input_layernorm.weight.detach().float().numpy()
    np.testing.assert_array_equal(dense(norm), w + (1.0 if family == "gemma2" else 0.0))
    # tokenizer
    assert value("tokenizer.ggml.model") == "gpt2" and value("tokenizer.ggml.pre") == "gpt-2"
    tokens = value("tokenizer.ggml.tokens")
    assert len(tokens) == config.vocab_size and tokens[tokenizer.eos_token_id] == tokenizer.eos_token
    types = value("tokenizer.ggml.token_type")
    assert types[tokenizer.bos_token_id] == 3 and types[tokenizer.convert_tokens_to_ids("<think>")] == 4
    assert value("tokenizer.ggml.merges")[0] == "Ġ a"
    assert value("tokenizer.ggml.add_bos_token") is True
    assert value("tokenizer.chat_template") == tokenizer.chat_template
    eot = {"llama": "<|eot_id|>", "gemma2": "<end_of_turn>"}[family]
    assert value("tokenizer.ggml.eot_token_id") == tokenizer.convert_tokens_to_ids(eot)
    if family == "llama":
        assert "rope_freqs.weight" in tensors
    else:
        assert value("gemma2.attn_logit_softcapping") == pytest.approx(50.0)
        assert value("gemma2.attention.sliding_window_pattern") == [True, False]
    q8_tensors, _ = read_gguf(q8)
    assert q8_tensors["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert q8_tensors["blk.0.ffn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    modelfile = (tmp_path / "Modelfile").read_text()
    assert f"FROM ./{f32.name}" in modelfile and f'PARAMETER stop "{eot}"' in modelfile


def _hf_row_order(stored: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (``convert_hf_to_gguf.py``'s ``permute``): within each head of
    ``head_dim`` rows, stored row ``2i`` is Hugging Face's row ``i`` and row ``2i+1`` its row ``i + head_dim/2``."""
    rows = np.arange(stored.shape[0])
    head, j = np.divmod(rows, head_dim)
    i, second_half = np.divmod(j, 2)
    hf = np.empty_like(stored)
    hf[head * head_dim + second_half * (head_dim // 2) + i] = stored
    return hf


def _decoded_in_hf_layout(path, config, hf_names) -> dict:
    """The file's tensors under ``hf_names``, decoded by this test alone: llama.cpp names from the ``gguf``
    package's table, q/k rows of the ``llama`` architecture put back by :func:`_hf_row_order`, Gemma's norms
    (stored as ``1 + w``) less 1."""
    tensors, value = read_gguf(path)
    arch_name = value("general.architecture")
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    decoded = {}
    for name in hf_names:
        values = dense(tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))])
        if arch_name == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            values = _hf_row_order(values, config.head_dim)
        if arch_name.startswith("gemma") and name.endswith("norm.weight"):
            values = values - 1.0
        decoded[name] = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy
    return decoded


def test_q_and_k_rows_decode_to_the_merged_hf_weights(tmp_path):
    """Every layer's q/k/v/o in an f32 file, with q and k put back in Hugging Face's row order by the lines
    above (heads of ``config.head_dim`` rows, so a wrong head count in the writer shows), equal ``W + s B A``
    computed here from the adapter's own tensors (GQA: 4 query heads, 2 KV heads)."""
    model, tokenizer = lora_model("llama", load_in_4bit=False)
    (result,) = model.save_pretrained_gguf(tmp_path, tokenizer, "f32", verbose=False)
    tensors, _ = read_gguf(result.path)
    config = model.get_base_model().config
    assert config.num_key_value_heads < config.num_attention_heads
    for i, layer in enumerate(model.get_base_model().model.layers):
        for name, short, permuted in (("q_proj", "q", True), ("k_proj", "k", True), ("v_proj", "v", False),
                                      ("o_proj", "output", False)):
            proj = getattr(layer.self_attn, name)
            a, b = proj.lora_A["default"].weight.float(), proj.lora_B["default"].weight.float()
            merged = (proj.base_layer.weight.float() + proj.scaling["default"] * (b @ a)).detach().numpy()
            stored = dense(tensors[f"blk.{i}.attn_{short}.weight"])
            decoded = _hf_row_order(stored, config.head_dim) if permuted else stored
            np.testing.assert_allclose(decoded, merged, rtol=1e-5, atol=1e-6, err_msg=f"layer {i} {name}")


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ExportError) as err:
        normalize_quantization_methods(["q8_0", "q3_k_xl"])
    message = str(err.value)
    assert "'q3_k_xl'" in message
    from notebookkit.export_forms import GGUF_TYPES

    assert "Valid: " + ", ".join(GGUF_TYPES) in message  # every type of the record, in its order
    assert normalize_quantization_methods(["Q8_0", "quantized", "fast_quantized"]) == ["q8_0", "q4_k_m"]


@pytest.mark.parametrize("family, method", [("llama", "q8_0"), ("llama", "bf16"), ("gemma2", "q4_0")])
def test_file_holds_the_rounded_reference(family, method, tmp_path):
    """The reference the llama.cpp checks use (merged weights rounded by gguf.quants, in Hugging Face's
    layout) is exactly what the file stores, once its tensors are decoded and mapped back
    (un-permuted, Gemma's +1 removed), by the writer's own table and by this test's: the writer adds no
    rounding of its own, loses no tensor and puts every row where llama.cpp reads it."""
    from notebookkit.export.gguf_rounding import _from_file, rounded_reference_model

    model, tokenizer = lora_model(family, load_in_4bit=family == "llama")
    (result,) = model.save_pretrained_gguf(tmp_path, tokenizer, method, verbose=False)
    reference = rounded_reference_model(model, method).state_dict()
    from_file: dict = {}
    _from_file(model, result.path, from_file)
    from notebookkit.export.merge import plan_merged_tensors

    assert set(from_file) == {t.name for t in plan_merged_tensors(model, torch.float32)}  # every tensor, once
    for name, values in from_file.items():
        assert torch.equal(values, reference[name]), name
    # the same, decoded without the writer's table (its head counts, its name mapping)
    config = model.get_base_model().config
    for name, values in _decoded_in_hf_layout(result.path, config, from_file).items():
        assert torch.equal(values.reshape(reference[name].shape), reference[name]), name
