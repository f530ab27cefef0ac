"""2-bit and ternary bases in the memory model: bytes computed by hand, the kernels' transients, flags."""

import types

import pytest

from notebookkit.memory import estimate_training_memory, generation_memory, model_shape
from notebookkit.memory.estimate import backward_working_set, estimate_kwargs_from_model
from notebookkit.memory.model_setup import record_base_format

# H=64, L=2, 4 query heads / 2 kv heads of 16, I=192, V=256, untied. Projections [out, in] per layer:
# q 64x64, k 32x64, v 32x64, o 64x64, gate 192x64, up 192x64, down 64x192.
CFG = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, intermediate_size=192, vocab_size=256, tie_word_embeddings=False)
KW = dict(dtype="bfloat16", lora_r=4, batch_size=2, seq_len=32, cuda_context_bytes=0, activation_plan="keep")
# Weights per layer reading 64 inputs: 64*64 + 32*64 + 32*64 + 64*64 + 192*64 + 192*64 = 36864; reading 192: 12288.
IN64, IN192 = 36864, 12288
SMALL = (256 * 64 * 2 + 2 * 2 * 64 + 64) * 2  # embedding + LM head, norms, final norm in bf16


def projections(e):
    return next(v for k, v in e.details.items() if k.startswith("base weights: decoder projections"))


def test_two_bit_base_is_a_quarter_byte_plus_scale_and_zero_per_64():
    e = estimate_training_memory(CFG, load_in_2bit=True, **KW)
    # 2 bits of code + an fp16 scale and an fp16 zero per 64 weights: 0.25 + 4/64 = 0.3125 bytes per weight
    assert projections(e) == 2 * (IN64 + IN192) * 0.3125 == 30720
    assert e.base_weights == 30720 + SMALL
    assert e.inputs["base_format"] == "2bit"
    assert "2-bit" in str(e)


def test_ternary_base_has_one_scale_per_row_so_its_bytes_depend_on_in_features():
    e = estimate_training_memory(CFG, load_in_ternary=True, **KW)
    # four codes a byte, one fp16 scale per row: 0.25 + 2/in bytes per weight.
    # in=64: 36864 * (0.25 + 2/64) = 10368; in=192 (down): 12288 * (0.25 + 2/192) = 3200; two layers.
    assert projections(e) == 2 * (10368 + 3200) == 27136
    assert e.base_weights == 27136 + SMALL


def test_nf4_is_still_half_a_byte_plus_its_double_quantised_absmax():
    e = estimate_training_memory(CFG, load_in_4bit=True, **KW)
    assert projections(e) == int(2 * (IN64 + IN192) * (0.5 + 1 / 64 + 4 / (64 * 256)))


def test_the_in_tile_kernels_add_one_fresh_input_gradient_and_no_dense_weight():
    kw = dict(batch_size=2, seq_len=32, dtype_bytes=2)
    plain = backward_working_set(model_shape(CFG), **kw)
    # q2_matmul / ternary_matmul write each input gradient to a fresh [N, in] buffer: the second of gate/up
    # (and of q/k/v) lives until it is added to the first: N * H * s = 64 * 64 * 2 = 8192 more, nothing else.
    for flag in ("load_in_2bit", "load_in_ternary"):
        ws = backward_working_set(model_shape(CFG), **kw, **{flag: True})
        assert ws["mlp"] - plain["mlp"] == 8192
        assert ws["attention"] - plain["attention"] == 8192
    # NF4 dequantises the whole weight for each product: the largest, 192 * 64 * 2 bytes.
    nf4 = backward_working_set(model_shape(CFG), load_in_4bit=True, **kw)
    assert nf4["mlp"] - plain["mlp"] == 192 * 64 * 2


def test_generation_at_two_bit_makes_no_dense_copy():
    shape = model_shape(CFG)
    plain = generation_memory(shape, 2, 40, 2, prompt_len=24)
    assert generation_memory(shape, 2, 40, 2, prompt_len=24, load_in_2bit=True).prefill == plain.prefill
    assert generation_memory(shape, 2, 40, 2, prompt_len=24, load_in_4bit=True).prefill == plain.prefill + 192 * 64 * 2


def test_conflicting_flags_are_refused_with_what_to_keep():
    with pytest.raises(ValueError, match=r"load_in_4bit=True and load_in_2bit=True .*Keep one flag"):
        estimate_training_memory(CFG, load_in_4bit=True, load_in_2bit=True, **KW)
    with pytest.raises(ValueError, match="load_in_2bit=True and load_in_ternary=True"):
        generation_memory(model_shape(CFG), 1, 8, load_in_2bit=True, load_in_ternary=True)


def test_a_loaded_model_tells_its_base_format_through_the_loaders_mark():
    model = types.SimpleNamespace(config=types.SimpleNamespace(quantization_config=None))
    record_base_format(model, "ternary")
    kwargs = estimate_kwargs_from_model(model)
    assert kwargs.get("load_in_ternary") is True and not kwargs.get("load_in_4bit")
    record_base_format(model, "2bit")
    assert estimate_kwargs_from_model(model).get("load_in_2bit") is True
    record_base_format(model, "5bit")
    with pytest.raises(ValueError, match="does not know"):
        estimate_kwargs_from_model(model)


def test_the_vision_tower_linears_follow_the_same_record():
    from notebookkit.memory import KNOWN_VLMS

    qwen = KNOWN_VLMS["Qwen/Qwen2.5-VL-7B-Instruct"]
    v = qwen.vision
    shapes = [*v.block_linear_shapes().values()] * v.num_layers + [*v.projector_linear_shapes().values()]
    two = estimate_training_memory(qwen, load_in_2bit=True, seq_len=1024)
    assert two.details["base weights: vision tower linears (2-bit)"] == int(sum(i * o for i, o in shapes) * 0.3125)
    ternary = estimate_training_memory(qwen, load_in_ternary=True, seq_len=1024)
    assert ternary.details["base weights: vision tower linears (ternary)"] == int(sum(i * o * (0.25 + 2 / i) for i, o in shapes))


def test_from_256_tokens_a_low_bit_product_holds_one_dense_chunk():
    # 2 x 128 = 256 tokens: cuBLAS on dense chunks (kernels/chunked_dequant_matmul.py); the largest projection
    # here (192 x 64 x 2 bytes) is below the 32 MiB chunk, so the chunk is that whole weight.
    kw = dict(batch_size=2, seq_len=128, dtype_bytes=2)
    plain = backward_working_set(model_shape(CFG), **kw)
    for flag in ("load_in_2bit", "load_in_ternary"):
        ws = backward_working_set(model_shape(CFG), **kw, **{flag: True})
        assert ws["mlp"] - plain["mlp"] == 192 * 64 * 2 + 256 * 64 * 2
    fewer = backward_working_set(model_shape(CFG), batch_size=1, seq_len=255, dtype_bytes=2, load_in_2bit=True)
    assert fewer["mlp"] - backward_working_set(model_shape(CFG), batch_size=1, seq_len=255, dtype_bytes=2)["mlp"] \
        == 255 * 64 * 2
