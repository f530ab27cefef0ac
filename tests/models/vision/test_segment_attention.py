"""Attention within segments (Qwen2.5-VL's windows): the batched op against the per-segment loop of
transformers, forward and backward, on odd shapes and mixed segment lengths; and the patched vision
tower against the stock one on a grid whose edge windows are smaller than the others; and the patched attention
called as older transformers call it (rotation angles, not cos/sin tables) against the stock math of those versions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from notebookkit.kernels.testing import rel_err
from notebookkit.models.vision.segment_attention import segment_attention, segment_plan

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def loop_reference(q, k, v, cu_seqlens, scale):
    """transformers' loop: one SDPA call per segment, in fp64."""
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            q_s, k_s, v_s = (t[start:end].double().transpose(0, 1) for t in (q, k, v))  # [H, L, d]
            outs.append(F.scaled_dot_product_attention(q_s, k_s, v_s, scale=scale).transpose(0, 1))
    return torch.cat(outs)


BOUNDS = {
    "equal": [0, 7, 14, 21, 28],
    "mixed": [0, 9, 13, 22, 22, 31, 35, 36],  # lengths 9, 4, 9, (empty), 9, 4, 1
    "sorted runs": [0, 11, 22, 27],
}


#: relative error allowed against the fp64 loop, per dtype (16-bit: the rounding of the inputs' products)
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # measured: 2e-3, 2.5e-4


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(BOUNDS))
def test_matches_the_loop_forward_and_backward(case, device, dtype):
    torch.manual_seed(len(case))
    cu = torch.tensor(BOUNDS[case], dtype=torch.int32, device=device)
    n, heads, d = BOUNDS[case][-1], 3, 10
    qkv = torch.randn(n, 3, heads, d, device=device, dtype=dtype, requires_grad=True)
    q, k, v = qkv.unbind(1)  # strided views, as the model's qkv output
    got = segment_attention(q, k, v, cu, d ** -0.5)
    want = loop_reference(q, k, v, cu, d ** -0.5)
    assert got.shape == (n, heads, d) and got.dtype == dtype
    assert rel_err(got, want) < TOLERANCE[dtype]
    grad = torch.randn_like(got)
    (dqkv,) = torch.autograd.grad(got, qkv, grad)
    qkv64 = qkv.detach().double().requires_grad_()
    (dqkv_ref,) = torch.autograd.grad(loop_reference(*qkv64.unbind(1), cu, d ** -0.5), qkv64, grad.double())
    assert rel_err(dqkv, dqkv_ref) < 2 * TOLERANCE[dtype]


def test_plan_is_read_once_per_tensor_and_groups_lengths():
    cu = torch.tensor(BOUNDS["mixed"])
    plan = segment_plan(cu)
    assert segment_plan(cu) is plan  # cached: no second host read
    assert plan.groups == ((9, 3), (4, 2), (1, 1))
    assert sorted(plan.order.tolist()) == list(range(36))
    assert torch.equal(plan.order[plan.inverse], torch.arange(36))
    assert segment_plan(torch.tensor(BOUNDS["equal"])).order is None  # one length: a view, no gather
    assert segment_plan(torch.tensor(BOUNDS["sorted runs"])).order is None


def test_rows_that_the_boundaries_do_not_cover_are_refused():
    q = torch.randn(10, 2, 4)
    with pytest.raises(ValueError, match="covers 8 rows, but the queries have 10"):
        segment_attention(q, q, q, torch.tensor([0, 4, 8]), 0.5)


def _tower_run(tower, pixels, grid):
    tower.zero_grad(set_to_none=True)
    out = tower(pixels, grid_thw=grid)
    out = getattr(out, "pooler_output", out)
    out.float().pow(2).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in tower.named_parameters() if p.grad is not None}
    return out.detach(), grads


@pytest.mark.parametrize("device", DEVICES)
def test_patched_tower_matches_stock_with_uneven_windows(device, vlm_folder):
    """A 10x6-patch image: the tiny tower's 4x4-patch windows leave 4x2, 2x4 and 2x2 edge windows."""
    from notebookkit.models import FastVisionModel
    from notebookkit.models.vision.patcher import submodule
    from notebookkit.models.patching.patcher import unpatch_model

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model, _ = FastVisionModel.from_pretrained(vlm_folder("qwen2"), max_seq_length=128, dtype=dtype,
                                               load_in_4bit=False, show_banner=False)
    model.to(device)
    tower = submodule(model, "model.visual").requires_grad_(True)  # loaded frozen
    assert "window/image attentions" in model.notebookkit_banner.line("vision tower")
    grid = torch.tensor([[1, 10, 6], [1, 4, 4]], device=device)
    cfg = tower.config
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    torch.manual_seed(0)
    pixels = torch.randn(int(grid.prod(-1).sum()), width, device=device, dtype=dtype)
    fused, fused_grads = _tower_run(tower, pixels, grid)
    unpatch_model(model)
    stock, stock_grads = _tower_run(tower, pixels, grid)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(fused, stock) < tol
    assert fused_grads.keys() == stock_grads.keys() and fused_grads
    for name, g in stock_grads.items():
        assert rel_err(fused_grads[name], g) < tol * 2, name


def _angles_reference(attn, x, cu_seqlens, theta):
    """The vision attention of transformers versions that pass rotation angles, written out in fp64: q and k
    rotated by ``theta`` ([N, d/2], the same angle for row ``i`` and row ``i + d/2`` of a head:
    ``x cos + rotate_half(x) sin``), softmax attention within each segment, then ``proj``."""
    n = x.shape[0]
    q, k, v = F.linear(x.double(), attn.qkv.weight.double(), attn.qkv.bias.double()).view(n, 3, attn.num_heads, -1).unbind(1)
    angles = theta.double().repeat(1, 2)[:, None, :]  # [N, 1, d]

    def rotate(t):
        half = t.shape[-1] // 2
        return t * angles.cos() + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * angles.sin()

    q, k = rotate(q), rotate(k)
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) * q.shape[-1] ** -0.5
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[start:end])
    return F.linear(out.reshape(n, -1), attn.proj.weight.double(), attn.proj.bias.double())


def test_patched_attention_takes_the_angles_older_transformers_pass():
    """transformers releases that predate the ``(cos, sin)`` tables call the vision attention with the angles as
    ``rotary_pos_emb`` (the third positional argument, or a keyword beside ``position_embeddings=None``). The
    patched forward rotates by them as the stock math did; the reference is first checked against the installed
    stock module fed the tables those versions built (``cat(theta, theta).cos()``, ``.sin()``)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionAttention, Qwen2_5_VLVisionConfig

    from notebookkit.models.vision.tower_attention import patch_segment_attentions

    config = Qwen2_5_VLVisionConfig(hidden_size=48, num_heads=3)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attn = Qwen2_5_VLVisionAttention(config).eval()
    cu_seqlens = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    x = torch.randn(13, 48)
    theta = torch.rand(13, 8) * 6.0  # head_dim / 2 angles per row
    want = _angles_reference(attn, x, cu_seqlens, theta)
    emb = torch.cat((theta, theta), dim=-1)
    with torch.no_grad():
        stock = attn(x, cu_seqlens=cu_seqlens, position_embeddings=(emb.cos(), emb.sin()))
    assert rel_err(stock, want) < 1e-5
    assert patch_segment_attentions(attn) == 1
    with torch.no_grad():
        calls = {
            "positional": attn(x, cu_seqlens, theta),
            "keywords": attn(x, cu_seqlens=cu_seqlens, rotary_pos_emb=theta, position_embeddings=None),
        }
    for call, out in calls.items():
        assert rel_err(out, want) < 1e-5, call
