"""The decode step's split attention (flash-decoding) against a float64 oracle: grouped query heads, odd head_dim
and slot counts, a view of a longer cache, masks that hide whole splits, left padding; fp32 and fp16 under the
interpreter (its ``tl.dot`` on bf16 is wrong), bf16 too on the GPU."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.decode_attention import decode_attention, decode_attention_splits
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_close

CPU = pytest.param("cpu", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1"))
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
# (B, Hkv, R, D, S, capacity): Llama's 4 query heads a key/value head; head_dim 24 (padded to 32); 201 slots of a
# 256-slot cache (4 splits on the interpreter's 132 SMs); 7 query heads a group; one slot; 33 row-heads, whose 8
# splits of 520 slots take two tiles each (the online softmax's rescaling; fp16 only, for CI's time)
SHAPES = [(2, 2, 4, 24, 201, 256), (1, 1, 7, 16, 70, 70), (3, 2, 1, 32, 1, 5), (3, 11, 2, 16, 520, 520)]


def _oracle(q, keys, values, bias, scale):
    z = scale * q.double() @ keys.double().transpose(2, 3) + bias.double()[:, None, None, :]
    return torch.softmax(z, dim=-1) @ values.double()


def _inputs(b, hkv, r, d, s, capacity, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv, r, d, generator=g).to(dtype).to(device)
    cache_k = torch.randn(b, hkv, capacity, d, generator=g).to(dtype).to(device)
    cache_v = torch.randn(b, hkv, capacity, d, generator=g).to(dtype).to(device)
    # row 0 sees its last 3 slots and every slot it is padded past is hidden; other rows see slots from their padding
    # on: whole splits hidden in some rows, none in others
    visible = torch.ones(b, s, dtype=torch.bool)
    visible[0, : max(0, s - 3)] = False
    for row in range(1, b):
        visible[row, : (row * 37) % s] = False
    bias = torch.zeros(b, s).masked_fill_(~visible, float("-inf")).to(dtype).to(device)
    return q, cache_k[:, :, :s], cache_v[:, :, :s], bias


def _cases():
    """(device, dtype, shape): bf16 on the GPU only (the interpreter's tl.dot on bf16 is wrong); the two-tile splits
    in fp16 only on the CPU (the interpreter's time)."""
    cases = []
    for shape in SHAPES:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            if dtype != torch.bfloat16 and not (dtype == torch.float32 and shape[4] > 256):
                cases.append(pytest.param(CPU.values[0], dtype, shape, marks=CPU.marks))
            cases.append(pytest.param(CUDA.values[0], dtype, shape, marks=CUDA.marks))
    return cases


@pytest.mark.parametrize("device,dtype,shape", _cases(),
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v).replace("torch.", ""))
def test_split_attention_equals_the_oracle(device, dtype, shape):
    q, keys, values, bias = _inputs(*shape, dtype, device)
    scale = shape[3] ** -0.5
    with use_triton(True):
        out = decode_attention(q, keys, values, bias, scale)
    assert out.shape == q.shape and out.dtype == dtype
    # the probabilities are rounded to the dtype before p V (flash attention's rounding): two roundings' worth
    assert_close(out.double().cpu(), _oracle(q, keys, values, bias, scale).cpu(), dtype, "decode attention",
                 factor=4.0)


def test_enough_splits_for_two_programs_an_sm_and_never_under_a_tile():
    assert decode_attention_splits(8, 4096, 132) == 64  # 8 row-heads x 64 >= 2 x 132 would need 33: capped at 64
    assert decode_attention_splits(8, 384, 132) == 8  # 384 slots, 6 tiles: 8 asked (the launch makes 6 of a tile)
    assert decode_attention_splits(64, 4096, 132) == 8  # a batch of 8: 64 row-heads x 8 >= 264
    assert decode_attention_splits(8, 64, 132) == 1


def test_bad_inputs_say_what_to_pass():
    q, keys, values, bias = _inputs(1, 1, 4, 16, 8, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"bias must be the additive mask \[B, S\]"):
        decode_attention(q, keys, values, bias[:, :4], 0.25)
    with pytest.raises(ValueError, match="at most 16 query heads"):
        decode_attention(torch.zeros(1, 1, 17, 16), keys, values, bias, 0.25)
