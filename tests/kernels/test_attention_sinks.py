"""Attention with sinks (gpt-oss) on PyTorch's fused attention kernels (the CPU's flash kernel; CUDA's
memory-efficient one on the GPU machine) against the eager formula with fp32 scores, forward and backward
(q, k, v and the sinks), on fresh random inputs of odd shapes: grouped heads, causal, a sliding window, a
left-padded row whose queries see no key, a chunk at the end of a cache, one decode query; fp32, fp16 and
bf16; and Hugging Face's own gpt-oss eager attention on the same inputs."""

from __future__ import annotations

import pytest
import torch

from notebookkit.kernels.attention_sinks import attention_with_sinks, attention_with_sinks_reference
from notebookkit.kernels.testing import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# (B, H, Hkv, T, S, D, mask): S > T is a chunk at the end of a cache
CASES = [
    (2, 6, 2, 13, 13, 16, "causal"),
    (2, 4, 4, 11, 11, 32, "window"),
    (3, 4, 2, 9, 9, 16, "left_padded"),
    (1, 6, 3, 5, 12, 8, "causal"),
    (2, 4, 1, 1, 10, 16, None),
]


def _mask(kind, B, T, S, device):
    i = torch.arange(T, device=device)[:, None] + (S - T)
    j = torch.arange(S, device=device)[None]
    if kind == "window":  # Hugging Face's sliding rule: keys in (i - W, i]
        return ((j <= i) & (j > i - 4))[None, None].expand(B, 1, T, S).clone()
    if kind == "left_padded":  # row 0 has 3 padding keys: its first 3 queries see no key at all
        mask = (j <= i)[None, None].repeat(B, 1, 1, 1)
        mask[0, :, :, :3] = False
        return mask
    return None


def _inputs(B, H, Hkv, T, S, D, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    # q as a projection's [B, T, H, D] viewed [B, H, T, D] (strided), as the attention forward hands it
    q = torch.randn(B, T, H, D, generator=g).transpose(1, 2)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    sinks = torch.randn(H, generator=g) * 2
    return [t.to(device=device, dtype=dtype).requires_grad_(True) for t in (q, k, v, sinks)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}h{c[2]}kv-{c[3]}of{c[4]}-d{c[5]}-{c[6]}")
def test_forward_and_backward_match_the_eager_formula(case, dtype, device):
    B, H, Hkv, T, S, D, kind = case
    q, k, v, sinks = _inputs(B, H, Hkv, T, S, D, dtype, device, seed=sum(case[:6]))
    mask = _mask(kind, B, T, S, device)
    causal = kind == "causal"
    out = attention_with_sinks(q, k, v, sinks, D ** -0.5, mask, causal)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    # the oracle in fp32 from the same (rounded) inputs
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v, sinks)]
    ref = attention_with_sinks_reference(*leaves, D ** -0.5, mask, causal)
    want = torch.autograd.grad(ref, leaves, dout.float())
    assert out.dtype == dtype and out.shape == (B, H, T, D)
    assert_close(out, ref, dtype, "output")
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert a.dtype == dtype, name
        assert_close(a, b, dtype, name, factor=2.0)
    if kind == "left_padded":  # a query that sees no key: output 0 and no gradient, the sink takes it all
        assert torch.all(out[0, :, :3] == 0) and torch.all(got[0][0, :, :3] == 0)


def test_it_is_hugging_faces_gpt_oss_eager_attention():
    """The same numbers as transformers' gpt-oss ``eager_attention_forward`` (its additive mask from the boolean
    one), in fp32, with grouped heads and a sliding window."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    B, H, Hkv, T, D = 2, 6, 2, 10, 16
    q, k, v, sinks = _inputs(B, H, Hkv, T, T, D, torch.float32, "cpu", seed=7)
    mask = _mask("window", B, T, T, "cpu")
    module = SimpleNamespace(num_key_value_groups=H // Hkv, sinks=sinks, training=False)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=D ** -0.5)
    out = attention_with_sinks(q, k, v, sinks, D ** -0.5, mask)
    assert_close(out.transpose(1, 2), want, torch.float32, "output")
    dout = torch.randn_like(want)
    got = torch.autograd.grad(out.transpose(1, 2), (q, k, v, sinks), dout)
    expected = torch.autograd.grad(want, (q, k, v, sinks), dout)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, expected):
        assert_close(a, b, torch.float32, name)


def test_bad_arguments_say_what_to_change():
    q, k, v, sinks = _inputs(1, 3, 2, 4, 4, 8, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="3 query heads do not split into groups of 2"):
        attention_with_sinks(q, k, v, sinks, 0.3)
    q, k, v, sinks = _inputs(1, 4, 2, 4, 4, 8, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="boolean mask"):
        attention_with_sinks(q, k, v, sinks, 0.3, torch.zeros(1, 1, 4, 4))
