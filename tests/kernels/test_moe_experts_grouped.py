"""The experts on PyTorch's ``grouped_mm`` (``notebookkit.kernels.moe_experts_grouped``) against the reference
path (``moe_expert_mlp_reference``), forward and every gradient (``x``, the routing weights, the four LoRA
factors in PEFT's layout): Qwen3-MoE's layout (SwiGLU, ``[gate; up]``) and gpt-oss's (interleaved, transposed
weights, biases, clamps at 0.5 so they bind), 16-bit and NF4 experts (decoded two experts a chunk, with the segment
bounds read on the host or kept on the device), two experts without rows (their factors' gradients exact zeros,
their NF4 chunk never decoded when the host has the bounds).

CPU: fp32, ``grouped_mm``'s CPU loop and the row kernels under the interpreter. GPU: bf16 on sm_90 at training
size through ``moe_expert_mlp`` itself, which must pick this path (and the Triton kernels with the switch off),
each path's error against the reference in fp32 math on the same bf16 inputs."""

from __future__ import annotations

import pytest
import torch

import notebookkit.kernels.moe_experts_grouped as grouped
from notebookkit import expert_chunks
from notebookkit.export.nf4_quantize import quantize_nf4
from notebookkit.kernels.moe_experts import ACTIVATIONS, expert_lora, moe_expert_mlp, moe_expert_mlp_reference
from notebookkit.kernels.nf4_stacked import NF4Stacked, nf4_stacked
from notebookkit.kernels.runtime import interpreter_on
from notebookkit.kernels.testing import assert_close, rel_err

H, I, E, K, R = 32, 48, 6, 2, 8
EMPTY = (2, 3)  # the experts no token picks: one chunk of two


def _case(family: str, dtype: torch.dtype, nf4: bool, tokens: int, device: str = "cpu", limit: float = 0.5,
          hidden: int = H, inter: int = I, rank: int = R) -> dict:
    g = torch.Generator().manual_seed(11)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(device)

    logits = rnd(tokens, E)
    logits[:, list(EMPTY)] = -1e9
    w, idx = torch.softmax(logits, -1).topk(K, -1)
    if family == "gpt_oss":  # stored [E, H, 2I] / [E, I, H], passed transposed; biases
        ws = 0.2 * (H / hidden) ** 0.5  # pre-activations of unit scale: gpt-oss's own limit 7 never binds on the GPU
        gate_up, down = rnd(E, hidden, 2 * inter, scale=ws).transpose(1, 2), rnd(E, inter, hidden, scale=ws).transpose(1, 2)
        biases = rnd(E, 2 * inter, scale=0.1).to(dtype), rnd(E, hidden, scale=0.1).to(dtype)
    else:
        gate_up, down = rnd(E, 2 * inter, hidden, scale=0.2), rnd(E, hidden, inter, scale=0.2)
        biases = None, None
    if nf4:
        gate_up, down = (nf4_stacked(q.packed, q).transpose(1, 2) if family == "gpt_oss" else nf4_stacked(q.packed, q)
                         for q in (quantize_nf4(gate_up.transpose(1, 2).contiguous() if family == "gpt_oss" else gate_up),
                                   quantize_nf4(down.transpose(1, 2).contiguous() if family == "gpt_oss" else down)))
    else:
        gate_up, down = gate_up.to(dtype), down.to(dtype)
    factors = [rnd(*shape, scale=0.2).requires_grad_() for shape in
               ((rank * E, hidden), (2 * inter, rank * E), (rank * E, inter), (hidden, rank * E))]
    return dict(x=rnd(tokens, hidden).to(dtype).requires_grad_(), idx=idx, w=w.clone().requires_grad_(),
                gate_up=gate_up, down=down, biases=biases, factors=factors, dy=rnd(tokens, hidden).to(dtype),
                act="gpt_oss" if family == "gpt_oss" else "swiglu", limit=limit)


def _grads(c: dict, fn) -> dict:
    loras = expert_lora(*c["factors"][:2], E, 0.75), expert_lora(*c["factors"][2:], E, 1.5)
    y = fn(c["x"], c["idx"], c["w"], c["gate_up"], c["down"], *c["biases"], *loras, activation=c["act"],
           limit=c["limit"])
    leaves = [c["x"], c["w"], *c["factors"]]
    grads = torch.autograd.grad(y, leaves, c["dy"])
    return dict(zip(["y", "x", "w", "Agu", "Bgu", "Ad", "Bd"], [y.detach(), *grads]))


def _grouped_fn(x, idx, w, gate_up, down, gb, db, lgu, ld, activation, limit):
    meta = (lgu.scaling, ld.scaling, ACTIVATIONS[activation], activation == "gpt_oss", 1.702, limit)
    return grouped.moe_expert_mlp_grouped(x, idx, w, gate_up, down, gb, db, lgu.A.to(x.dtype), lgu.B.to(x.dtype),
                                          ld.A.to(x.dtype), ld.B.to(x.dtype), meta)


def _expert_rows(grad: torch.Tensor, name: str, e: int) -> torch.Tensor:
    """Expert ``e``'s part of a PEFT factor's gradient (``A``: rows ``e r ..``; ``B``: columns ``j E + e``)."""
    return grad[e * R:(e + 1) * R] if name.startswith("A") else grad.reshape(grad.shape[0], R, E)[:, :, e]


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("nf4, per_chunk, on_device", [(False, 2, False), (True, 2, False), (True, 2, True),
                                                       (True, E, False)],
                         ids=["16-bit", "nf4-chunks", "nf4-chunks-device-bounds", "nf4-one-chunk"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_grouped_path_matches_the_reference(family, nf4, per_chunk, on_device, monkeypatch, one_thread):
    monkeypatch.setattr(expert_chunks, "DECODE_CHUNK_BYTES", per_chunk * 2 * I * H * 4)  # experts a chunk (gate_up)
    monkeypatch.setenv("NOTEBOOKKIT_MOE_DEVICE_BOUNDS", "1" if on_device else "0")
    decoded, host_reads = [], []
    real = NF4Stacked.decode_experts
    monkeypatch.setattr(NF4Stacked, "decode_experts",
                        lambda self, lo, hi, dtype: decoded.append((lo, hi)) or real(self, lo, hi, dtype))
    c = _case(family, torch.float32, nf4, tokens=67)
    want = _grads(c, moe_expert_mlp_reference)
    decoded.clear()
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: host_reads.append(self.shape) or tolist(self))
    got = _grads(c, _grouped_fn)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    assert bool(host_reads) == (nf4 and not on_device)  # the segment bounds read on the host, or not at all
    if family == "gpt_oss":  # the clamps bind
        assert (c["x"].detach() @ c["gate_up"].dequantize(torch.float32)[0].t() if nf4 else
                c["x"].detach() @ c["gate_up"][0].t()).abs().max() > c["limit"]
    for name, ref in want.items():
        assert ref.abs().sum() > 0, name
        assert_close(got[name], ref, torch.float32, name)
        if name[0] in "AB":  # the expert without rows: exact zeros, not an empty reduction's leftovers
            assert all(torch.count_nonzero(_expert_rows(got[name], name, e)) == 0 for e in EMPTY), name
    # NF4, each chunk once per GEMM that reads its weight (forward, and backward's G or dx): gate_up two experts a
    # chunk, [2, 4) never decoded; down (half the size) fits four a chunk, so two chunks filled evenly, [0, 3) and
    # [3, 6); or every expert in one chunk
    chunks = [(0, 2)] * 2 + [(0, 3)] * 2 + [(3, 6)] * 2 + [(4, 6)] * 2 if per_chunk == 2 else [(0, E)] * 4
    if on_device:  # without the host's bounds every chunk is decoded, rows or not
        chunks = sorted(chunks + [(2, 4)] * 2)
    assert sorted(decoded) == (chunks if nf4 else [])


def test_grouped_mm_is_not_chosen_off_hopper_or_in_fp16(monkeypatch):
    x = torch.zeros(4096, 64, dtype=torch.bfloat16)
    assert not grouped.grouped_mm_applies(x, 4096 * 2, 8, (64, 64, 16))  # a CPU tensor
    monkeypatch.setenv("NOTEBOOKKIT_MOE_GROUPED_MM", "0")
    assert not grouped.grouped_mm_applies(x, 4096 * 2, 8, (64, 64, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("nf4, per_chunk, on_device", [(False, 2, False), (True, 2, False), (True, 2, True),
                                                       (True, E, False)],
                         ids=["16-bit", "nf4-chunks", "nf4-chunks-device-bounds", "nf4-one-chunk"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_grouped_path_on_the_gpu(family, nf4, per_chunk, on_device, monkeypatch):
    """bf16, 1,200 tokens (400 rows an expert): ``moe_expert_mlp`` takes ``grouped_mm`` on sm_90 and newer. Its
    error against the reference is within bf16's bound and at most twice the Triton kernels' (a few more
    roundings: each GEMM's output rounds before the next addition); NF4 experts two a chunk (the segment bounds
    read on the host or kept on the device), or all in one."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("grouped_mm's fast path needs sm_90")
    monkeypatch.setattr(expert_chunks, "DECODE_CHUNK_BYTES", per_chunk * 2 * 128 * 256 * 2)
    monkeypatch.setenv("NOTEBOOKKIT_MOE_DEVICE_BOUNDS", "1" if on_device else "0")
    c = _case(family, torch.bfloat16, nf4, tokens=1200, device="cuda", limit=7.0, hidden=256, inter=128, rank=R)
    assert grouped.grouped_mm_applies(c["x"], 1200 * K, E, (256, 128, R))
    calls = []
    real = grouped._MoEGroupedFunction.apply
    monkeypatch.setattr(grouped._MoEGroupedFunction, "apply", lambda *a: calls.append(1) or real(*a))
    want = _grads(c, moe_expert_mlp_reference)
    got = _grads(c, moe_expert_mlp)
    assert calls, "moe_expert_mlp did not take grouped_mm"
    monkeypatch.setenv("NOTEBOOKKIT_MOE_GROUPED_MM", "0")
    triton_path = _grads(c, moe_expert_mlp)
    assert len(calls) == 1
    for name, ref in want.items():
        assert ref.abs().sum() > 0, name
        assert_close(got[name], ref, torch.bfloat16, name)
        assert rel_err(got[name], ref) <= 2 * rel_err(triton_path[name], ref) + 1e-3, name
        if name[0] in "AB":
            assert all(torch.count_nonzero(_expert_rows(got[name], name, e)) == 0 for e in EMPTY), name


@pytest.mark.parametrize("num_experts", [6, 256, 300], ids=lambda e: f"E{e}")
def test_expert_segments_sort_narrow_keys(num_experts):
    """The pairs sorted by expert on uint8 keys (int16 past 256 experts): the stable order and the segments of a
    sort of the int64 ids, experts without rows included."""
    g = torch.Generator().manual_seed(num_experts)
    idx = torch.randint(0, num_experts - 1, (97, 4), generator=g)  # the last expert gets no row
    seg = grouped.expert_segments(idx, num_experts)
    order = torch.sort(idx.reshape(-1), stable=True)
    assert torch.equal(seg.perm, order.indices) and torch.equal(seg.expert.long(), order.values)
    counts = torch.bincount(idx.reshape(-1), minlength=num_experts)
    assert torch.equal(seg.ends.long() - seg.starts.long(), counts) and int(seg.ends[-1]) == idx.numel()
    assert seg.expert.dtype == (torch.uint8 if num_experts <= 256 else torch.int16)


def test_the_zero_mask_is_skipped_where_the_host_bounds_show_every_expert_has_rows():
    """The weight gradients' mask of experts without rows is made unless the host's NF4 bounds show every expert
    has rows (no bounds: 16-bit experts, always made)."""
    ends = torch.tensor([3, 5, 5, 9], dtype=torch.int32)
    assert not grouped._every_expert_has_rows(grouped._Segments(None, None, ends, [0, 3, 5, 5, 9]))
    assert not grouped._every_expert_has_rows(grouped._Segments(None, None, ends, None))
    assert grouped._every_expert_has_rows(grouped._Segments(None, None, ends, [0, 3, 5, 7, 9]))


def test_chunk_offsets_are_each_chunks_segment_ends_in_one_kept_buffer(monkeypatch):
    """Each chunk's offsets count its experts' segment ends from the chunk's first row, chunk after chunk, written
    into one buffer a device that later calls reuse (and that grows when a call needs more)."""
    monkeypatch.setattr(grouped, "_OFFSETS", {})
    bounds = [0, 3, 5, 5, 9, 12]  # five experts; the third has no rows
    offs = grouped._chunk_offsets(bounds, [(0, 2), (3, 5)], torch.device("cpu"))
    assert offs.tolist() == [3, 5, 4, 7]  # experts 0-1 from row 0; experts 3-4 from row 5
    again = grouped._chunk_offsets(bounds, [(0, 5)], torch.device("cpu"))
    assert again.tolist() == [3, 5, 5, 9, 12] and again.data_ptr() == offs.data_ptr()
    wide = grouped._chunk_offsets(list(range(301)), [(0, 300)], torch.device("cpu"))
    assert wide.tolist() == list(range(1, 301)) and grouped._OFFSETS[torch.device("cpu")].numel() == 300
