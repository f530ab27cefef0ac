"""The decode step's RoPE + KV-cache write in one kernel: the Triton kernel (interpreter on CPU, CUDA on the GPU
machine) against a float64 oracle and against the unfused step it replaces (``apply_rope``, then two
``index_copy_`` at the slot); strided q/k/v as the projections hand them over, grouped-query heads, a cache
with more rows than the batch, every other slot and row left untouched, an out-of-range slot, and (GPU) a
captured CUDA graph whose slot advances on the device.

The interpreter of triton 3.9 rounds fp32 -> bf16 by truncation (CUDA rounds to nearest even), so the
bit-exact comparison with the unfused step runs in bf16 on the GPU only."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from notebookkit.kernels.rope import apply_rope, rope_reference
from notebookkit.kernels.rope_cache_write import rope_cache_write
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU = pytest.param("cpu", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1"))
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
DEVICES = [CPU, CUDA]
# (B, Hq, Hkv, D, cache rows, slots, slot, shared table): head_dim 10 (half 5), a cache with a spare row
SHAPES = [(3, 6, 2, 10, 4, 7, 5, False), (1, 3, 1, 16, 1, 5, 0, True)]
SENTINEL = 7.0  # what the cache holds before the write: every element but the written ones must keep it


def _tables(positions: torch.Tensor, head_dim: int, dtype):
    """HF-style ``cos``/``sin`` ``[B, 1, D]`` of one position per row."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    emb = positions.double()[:, None, None] * inv_freq
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _inputs(b, hq, hkv, d, rows, slots, slot, shared, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    # [B, 1, H, D] projection outputs viewed as [B, H, 1, D], as cached_forward hands them over
    q = torch.randn(b, 1, hq, d, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(b, 1, hkv, d, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(b, 1, hkv, d, generator=g).to(dtype).transpose(1, 2)
    positions = torch.randint(0, 300, (1 if shared else b,), generator=g)
    cos, sin = _tables(positions, d, dtype)
    if shared:
        cos, sin = cos[0], sin[0]  # [1, D]
    caches = [torch.full((rows, hkv, slots, d), SENTINEL, dtype=dtype) for _ in range(2)]
    to = lambda x: x.to(device)  # noqa: E731
    return to(q), to(k), to(v), to(cos), to(sin), to(caches[0]), to(caches[1]), to(torch.tensor([slot]))


def _fused(q, k, v, cos, sin, key_cache, value_cache, slot):
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    with use_triton(True):
        q_rot = rope_cache_write(q, k, v, cos, sin, key_cache, value_cache, slot)
    return q_rot, key_cache, value_cache


def _unfused(q, k, v, cos, sin, key_cache, value_cache, slot):
    """What the decode step did before: the RoPE kernel, then ``index_copy_`` of k and v at the slot."""
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    b, d = q.shape[0], q.shape[3]
    with use_triton(True):
        q_rot, k_rot = apply_rope(q, k, cos.reshape(-1, 1, d), sin.reshape(-1, 1, d))
    key_cache[:b].index_copy_(2, slot, k_rot)
    value_cache[:b].index_copy_(2, slot, v)
    return q_rot, key_cache, value_cache


def _check_against_oracle(got, q, k, v, cos, sin, slot, dtype, factor=1.0):
    q_rot, key_cache, value_cache = got
    b, d, t = q.shape[0], q.shape[3], int(slot)
    q64, k64 = rope_reference(q.double(), k.double(), cos.double().reshape(-1, 1, d), sin.double().reshape(-1, 1, d))
    assert q_rot.shape == q.shape and q_rot.dtype == dtype and q_rot.is_contiguous()
    assert_close(q_rot, q64, dtype, "q_rot", factor)
    assert_close(key_cache[:b, :, t:t + 1], k64, dtype, "keys at the slot", factor)
    assert torch.equal(value_cache[:b, :, t:t + 1], v), "values are copied as they are"
    for name, cache in (("keys", key_cache), ("values", value_cache)):
        untouched = torch.ones(cache.shape, dtype=torch.bool, device=cache.device)
        untouched[:b, :, t] = False
        assert (cache[untouched] == SENTINEL).all(), f"{name}: a slot or row other than [:B, :, slot] was written"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_matches_float64(device, dtype, shape):
    args = _inputs(*shape, dtype, device)
    q, k, v, cos, sin, _, _, slot = args
    _check_against_oracle(_fused(*args), q, k, v, cos, sin, slot, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_same_as_the_unfused_rope_and_cache_write(device, dtype):
    args = _inputs(*SHAPES[0], dtype, device, seed=1)
    fused, unfused = _fused(*args), _unfused(*args)
    for name, a, b in zip(("q_rot", "key_cache", "value_cache"), fused, unfused):
        if device == "cuda" or dtype != torch.bfloat16:
            assert torch.equal(a, b), name
        else:
            assert_close(a, b, dtype, name)


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
def test_reference_path_is_the_unfused_step():
    args = _inputs(*SHAPES[0], torch.float16, "cpu", seed=2)
    key_cache, value_cache = args[5].clone(), args[6].clone()
    with use_triton(False):
        q_rot = rope_cache_write(*args[:5], key_cache, value_cache, args[7])
    for a, b in zip((q_rot, key_cache, value_cache), _unfused(*args)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_a_slot_outside_the_cache_writes_nothing(device):
    q, k, v, cos, sin, key_cache, value_cache, _ = _inputs(*SHAPES[0], torch.float32, device, seed=3)
    for slot in (7, -1):
        q_rot, keys, values = _fused(q, k, v, cos, sin, key_cache, value_cache, torch.tensor([slot], device=device))
        assert (keys == SENTINEL).all() and (values == SENTINEL).all(), slot
        assert_close(q_rot, _unfused(q, k, v, cos, sin, key_cache, value_cache, torch.tensor([0], device=device))[0],
                     torch.float32, "q_rot")


def test_shape_errors_are_explained():
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 1, 8)
    cache = torch.zeros(1, 1, 4, 8)
    slot = torch.tensor([0])
    with pytest.raises(ValueError, match="one new token a row"):
        rope_cache_write(torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8),
                         torch.randn(3, 8), torch.randn(3, 8), cache, cache.clone(), slot)
    with pytest.raises(ValueError, match="is not a"):
        rope_cache_write(q, k, k.clone(), torch.randn(1, 8), torch.randn(1, 8), torch.zeros(1, 2, 4, 8),
                         cache, slot)
    with pytest.raises(ValueError, match="one-element integer"):
        rope_cache_write(q, k, k.clone(), torch.randn(1, 8), torch.randn(1, 8), cache, cache.clone(),
                         torch.tensor([0.0]))


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
@settings(max_examples=6, deadline=None, database=None)
@given(
    b=st.integers(1, 3),
    hkv=st.integers(1, 3),
    rep=st.integers(1, 3),
    half=st.integers(1, 20),
    slots=st.integers(1, 9),
    dtype=st.sampled_from(DTYPES),
    shared=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_shapes_and_dtypes(b, hkv, rep, half, slots, dtype, shared, seed):
    slot = seed % slots
    args = _inputs(b, hkv * rep, hkv, 2 * half, b + seed % 2, slots, slot, shared, dtype, "cpu", seed=seed)
    q, k, v, cos, sin, _, _, slot_t = args
    _check_against_oracle(_fused(*args), q, k, v, cos, sin, slot_t, dtype, factor=2.0)


# ------------------------------------------------------------------------------------------------
# GPU only: Llama-3-8B's decode shapes in the two 16-bit dtypes, and capture in a CUDA graph
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_shapes_cuda(batch, dtype):
    args = _inputs(batch, 32, 8, 128, batch + 1, 4096, 4000, False, dtype, "cuda", seed=4)
    q, k, v, cos, sin, _, _, slot = args
    fused = _fused(*args)
    _check_against_oracle(fused, q, k, v, cos, sin, slot, dtype)
    for name, a, b in zip(("q_rot", "key_cache", "value_cache"), fused, _unfused(*args)):
        assert torch.equal(a, b), name


@pytest.mark.gpu
def test_captured_in_a_cuda_graph_the_slot_advances_on_the_device():
    dtype = torch.float16
    q, k, v, cos, sin, key_cache, value_cache, slot = _inputs(2, 8, 2, 64, 2, 16, 3, False, dtype, "cuda", seed=5)
    want_q, want_keys, want_values = _unfused(q, k, v, cos, sin, key_cache, value_cache, slot)
    rope_cache_write(q, k, v, cos, sin, key_cache.clone(), value_cache.clone(), slot)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_rot = rope_cache_write(q, k, v, cos, sin, key_cache, value_cache, slot)
    for step in (3, 4, 9):  # each replay writes at the slot it finds on the device
        key_cache.fill_(SENTINEL)
        value_cache.fill_(SENTINEL)
        slot.fill_(step)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(q_rot, want_q)
        for cache, want in ((key_cache, want_keys), (value_cache, want_values)):
            assert torch.equal(cache[:, :, step], want[:, :, 3]), step
            others = torch.cat([cache[:, :, :step], cache[:, :, step + 1:]], dim=2)
            assert (others == SENTINEL).all(), step
