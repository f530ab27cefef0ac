"""The MoE expert kernel reading NF4 stacked weights (``notebookkit.kernels.nf4_stacked``) against
dequantise-then-reference: the same call with the dense weights decoded by the NF4 format's own reference
(:func:`notebookkit.kernels.nf4.dequantize_nf4_reference`, whole tensor, independent of the tile decode), in
the same dtype, forward and backward (``x``, ``topk_w`` and every LoRA factor).

Odd shapes: 23 tokens, hidden 45, intermediate 27, 5 experts, top-2, rank 3: the 64-element NF4 blocks straddle
rows and experts, the down weight has an odd number of elements (6075: the last byte's low nibble is padding),
and the interpreter's 32-tiles take several column tiles, K steps and a partial tile. Both layouts: Qwen3-MoE
(``[gate; up]``, stored ``[E, 2I, H]``) and gpt-oss (interleaved, biases, clamps at a small limit, stored
``[E, H, 2I]`` and passed as the transposed view); nested (double-quantised) absmax as the loader writes it, and
plain fp32 absmax. fp32 and fp16 (bf16 ``tl.dot`` is wrong under the interpreter).

The reference path decodes one expert at a time and must equal the dense reference bit for bit (same sums in
the same order); the Triton path is held to the dtype's bound of :func:`~notebookkit.kernels.testing.assert_close`.
"""

from __future__ import annotations

import pytest
import torch

from notebookkit.export.nf4_quantize import quantize_nf4
from notebookkit.kernels.moe_experts import expert_lora, moe_expert_mlp
from notebookkit.kernels.nf4 import dequantize_nf4_reference
from notebookkit.kernels.nf4_stacked import NF4Stacked, nf4_stacked
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_close

_needs_interp = pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
#: (path, dtype, nested absmax): both paths in both dtypes with the nested absmax the loader writes; the plain
#: absmax (the kernel's other address arithmetic) once, on the Triton path in fp32
CASES = [pytest.param(path, dtype, True, id=f"{path}-{str(dtype)[6:]}-nested",
                      marks=[_needs_interp] if path == "triton" else [])
         for path in ("reference", "triton") for dtype in (torch.float32, torch.float16)]
CASES.append(pytest.param("triton", torch.float32, False, id="triton-float32-plain", marks=[_needs_interp]))
T, H, I, E, K, R = 23, 45, 27, 5, 2, 3


class _PlainAbsmax:
    """A non-nested quant state (fp32 absmax) of the same codes: what bitsandbytes writes without double quant."""

    def __init__(self, q):
        scale2 = q.state2.absmax.repeat_interleave(q.state2.blocksize)[: q.absmax.numel()]
        self.absmax = q.state2.code[q.absmax.long()] * scale2 + q.offset
        self.shape, self.dtype, self.blocksize, self.quant_type = q.shape, q.dtype, q.blocksize, "nf4"
        self.state2 = self.offset = None


def _quantised(stored: torch.Tensor, transposed: bool, nested: bool) -> tuple[NF4Stacked, torch.Tensor]:
    """(the NF4 view the kernel reads, the dense ``[E, out, in]`` weight decoded by the format's reference)."""
    q = quantize_nf4(stored)
    state = q if nested else _PlainAbsmax(q)
    dense = dequantize_nf4_reference(q.packed, state, out_dtype=stored.dtype)
    return nf4_stacked(q.packed, state, transposed=transposed), (dense.transpose(1, 2) if transposed else dense)


def _case(family: str, dtype: torch.dtype, nested: bool = True, seed: int = 0, device: str = "cpu", T: int = T):
    g = torch.Generator().manual_seed(seed)
    gpt = family == "gpt_oss"

    def draw(*shape, scale=1.0, rand=torch.randn):
        return (rand(*shape, generator=g) * scale).to(device, dtype)

    stored_gu = draw(*((E, H, 2 * I) if gpt else (E, 2 * I, H)), scale=0.15)
    stored_d = draw(*((E, I, H) if gpt else (E, H, I)), scale=0.15)
    gu_q, gu_dense = _quantised(stored_gu, gpt, nested)
    d_q, d_dense = _quantised(stored_d, gpt, nested)
    x = draw(T, H)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[:4] = torch.tensor([0, 3])  # expert 0 and 3 get more rows; expert 4 may get none
    idx = idx.to(device)
    w = draw(T, K, rand=torch.rand)
    factors = [draw(*s, scale=0.2) for s in ((R * E, H), (2 * I, R * E), (R * E, I), (H, R * E))]
    biases = (draw(E, 2 * I, scale=0.1), draw(E, H, scale=0.1)) if gpt else (None, None)
    dy = draw(T, H)
    return dict(gu_q=gu_q, gu_dense=gu_dense, d_q=d_q, d_dense=d_dense, x=x, idx=idx, w=w, factors=factors,
                biases=biases, dy=dy, activation="gpt_oss" if gpt else "swiglu")


def _run(c, gate_up, down, triton: bool, limit: float = 0.5):
    leaves = [t.detach().clone().requires_grad_() for t in (c["x"], c["w"], *c["factors"])]
    with use_triton(triton):
        y = moe_expert_mlp(leaves[0], c["idx"], leaves[1], gate_up, down, *c["biases"],
                           gate_up_lora=expert_lora(leaves[2], leaves[3], E, 2.0),
                           down_lora=expert_lora(leaves[4], leaves[5], E, 2.0),
                           activation=c["activation"], alpha=1.702, limit=limit)
    y.backward(c["dy"])
    return {"y": y.detach(), **{n: t.grad for n, t in zip(["x", "topk_w", "A_gu", "B_gu", "A_d", "B_d"], leaves)}}


def test_decode_of_one_expert_is_the_format(one_thread):
    """``NF4Stacked.expert`` (the reference path's scratch) and the transposed view decode the format's values."""
    for nested in (True, False):
        for transposed in (False, True):
            stored = torch.randn(E, 2 * I, H, generator=torch.Generator().manual_seed(5)) * 0.1
            view, dense = _quantised(stored, transposed, nested)
            assert view.shape == tuple(dense.shape)
            assert torch.equal(view.dequantize(torch.float32), dense)
            assert torch.equal(view.expert(3, torch.float16), dense[3].half())


def test_decode_of_a_range_of_experts_is_the_format(one_thread):
    """``NF4Stacked.decode_experts`` (the chunks a training-sized call decodes) equals the whole decode's experts
    for ranges that start and end inside a group of block scales: 9 experts of 47 x 83 span three groups of
    64 x 256 nested scales, and their blocks straddle experts."""
    g = torch.Generator().manual_seed(11)
    for nested in (True, False):
        for transposed in (False, True):
            view, dense = _quantised(torch.randn(9, 47, 83, generator=g) * 0.1, transposed, nested)
            for lo, hi in ((0, 1), (2, 5), (4, 9), (8, 9), (0, 9)):
                got = view.decode_experts(lo, hi, torch.float16)
                assert got.shape == dense[lo:hi].shape and got.stride() == dense.stride()
                assert torch.equal(got, dense[lo:hi].half()), (nested, transposed, lo, hi)


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype,nested", [(torch.float16, True), (torch.float32, False)], ids=["fp16-nested",
                                                                                                 "fp32-plain"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_experts_decoded_in_chunks_equal_the_decode_in_the_loads(family, dtype, nested, monkeypatch, one_thread):
    """A training-sized call decodes its NF4 experts two at a time (here forced: 1 row an expert is enough, a
    chunk holds two experts) and runs the 16-bit kernels on each chunk: forward and every gradient bit for bit
    those of the decode in the weight loads (the same values, the same tiles)."""
    from notebookkit import expert_chunks

    c = _case(family, dtype, nested)
    want = _run(c, c["gu_q"], c["d_q"], True)
    monkeypatch.setattr(expert_chunks, "MIN_ROWS_PER_EXPERT", 1)
    monkeypatch.setattr(expert_chunks, "DECODE_CHUNK_BYTES", 2 * 2 * I * H * dtype.itemsize)
    got = _run(c, c["gu_q"], c["d_q"], True)
    for name, ref in want.items():
        assert torch.equal(got[name], ref), name


@pytest.mark.parametrize("path,dtype,nested", CASES)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_nf4_experts_match_dequantise_then_reference(family, path, dtype, nested, one_thread):
    c = _case(family, dtype, nested)
    want = _run(c, c["gu_dense"], c["d_dense"], False)
    got = _run(c, c["gu_q"], c["d_q"], path == "triton")
    if family == "gpt_oss" and dtype == torch.float32:  # the clamps bind on these weights (limit 0.5)
        gu = c["x"].float() @ c["gu_dense"][0].float().t()
        assert (gu[:, 0::2] > 0.5).any() and (gu[:, 1::2].abs() > 0.5).any()
    for name, ref in want.items():
        assert got[name].dtype == ref.dtype, name
        assert ref.abs().sum() > 0, name
        if path == "reference":
            assert torch.equal(got[name], ref), name
        else:
            assert_close(got[name], ref, dtype, name)
    # the 16-bit oracle really differs from the 4-bit weights' source: the test sees the quantisation
    assert not torch.equal(c["gu_dense"], c["gu_dense"].new_zeros(()))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [T, 1601], ids=["in-loads", "chunks"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_nf4_experts_on_the_gpu(family, dtype, tokens, monkeypatch):
    """The compiled kernels reading NF4 stacked experts (the T4's fp16 and bf16) against the reference path on the
    weights they decode, forward and every gradient.

    gpt-oss's clamps at the CPU cases' limit of 0.5 bind on a large share of these pre-activations, and bf16 has
    7 bits below the leading one (a step of 2^-9 at 0.5): two correct sums in another order land on opposite
    sides of the clamp for enough elements that the input gradient (zero where clamped) moves by percents (the
    suite of session 24: 8.2% on ``x``, the forward and the fp16 case within bound). In bf16 the limit is gpt-oss's
    own, 7, where these pre-activations (about unit scale) never reach it; the clamps' math is held to its bound in
    fp16 here and in fp32 / fp16 on the CPU.

    ``chunks``: 1,601 tokens, 640 rows an expert on average: the experts are decoded two at a time (the chunk
    made small) and the 16-bit kernels run with sm_90's 128-row blocks, K steps of 64, another summation order
    than the reference's. At the limit 0.5 the clamps then flip for enough of 1,601 tokens' pre-activations that
    fp16's ``x`` gradient moved by 7.1e-3 against a bound of 2e-3 (the suite of session 26; the forward within
    bound, and bf16 at limit 7 within bound everywhere), so this case runs at gpt-oss's own limit in both dtypes:
    the decode and the layouts are what it checks (the CPU test holds the chunks bit-equal to the decode in
    the loads, clamps binding)."""
    from notebookkit import expert_chunks

    assert expert_chunks.decodes_in_chunks(tokens * K, E) == (tokens > T)
    monkeypatch.setattr(expert_chunks, "DECODE_CHUNK_BYTES", 2 * 2 * I * H * dtype.itemsize)
    c = _case(family, dtype, device="cuda", T=tokens)
    limit = 7.0 if dtype == torch.bfloat16 or tokens > T else 0.5
    want = _run(c, c["gu_dense"], c["d_dense"], False, limit)
    got = _run(c, c["gu_q"], c["d_q"], True, limit)
    for name, ref in want.items():
        assert ref.abs().sum() > 0, name
        assert_close(got[name], ref, dtype, name)


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
def test_nf4_inference_forward_equals_training_forward(one_thread):
    c = _case("qwen3_moe", torch.float16, seed=7)
    with use_triton(True):
        with torch.no_grad():
            y = moe_expert_mlp(c["x"], c["idx"], c["w"], c["gu_q"], c["d_q"])
        y_train = moe_expert_mlp(c["x"], c["idx"], c["w"].clone().requires_grad_(), c["gu_q"], c["d_q"])
    assert torch.equal(y, y_train.detach())


def test_nf4_view_errors_are_explained():
    q = quantize_nf4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="3-D"):
        nf4_stacked(q.packed, q)
    view, _ = _quantised(torch.randn(E, 2 * I, H), False, True)
    with pytest.raises(ValueError, match="last two dimensions"):
        view.transpose(0, 1)
