"""MoE expert MLP (``notebookkit.kernels.moe_experts``) against Hugging Face's own sparse blocks with PEFT's
``target_parameters`` adapters: a tiny Qwen3-MoE block (SwiGLU, ``[gate; up]``, softmax-top-k-renormalised
router) and a tiny gpt-oss block (biases, interleaved gate/up, clamped activation at a small limit so the
clamps bind, top-k-then-softmax router), forward and backward (``x`` through the router too, the router's
weight through ``topk_w``, every LoRA factor in PEFT's own parameters), the Triton kernels under the
interpreter and the reference path, fp32 and fp16 (bf16 ``tl.dot`` is garbage under triton 3.9's
interpreter: GPU only), each against the float64 copy of the same module. Then an expert without tokens and
one with more rows than a block, inference without a saved activation, and bad input. 37 tokens, hidden
48, intermediate 40 (two column tiles and two K steps at the interpreter's 32-tiles), 8 experts, top-2."""

from __future__ import annotations

import copy

import pytest
import torch

from notebookkit.kernels.moe_experts import expert_lora, moe_expert_mlp, moe_expert_mlp_reference, peft_expert_lora
from notebookkit.kernels.runtime import interpreter_on, use_triton
from notebookkit.kernels.testing import assert_close

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PATHS = ["reference",
         pytest.param("triton", marks=pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1"))]
DTYPES = [torch.float32, torch.float16]
T, H, I, E, K, R = 37, 48, 40, 8, 2, 4
TARGETS = ["experts.gate_up_proj", "experts.down_proj"]


def _adapt(block: torch.nn.Module, router: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights everywhere (the bare modules start from torch.empty), PEFT adapters on both stacked
    weights, random B too (no zero init: the adapters must matter), the router trainable."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    config = peft.LoraConfig(r=R, lora_alpha=8, target_modules=[], target_parameters=TARGETS, init_lora_weights=False)
    block = peft.inject_adapter_in_model(config, block)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    router.requires_grad_(True)
    return block


def _wrappers(experts) -> tuple:
    """(gate_up ParamWrapper, down ParamWrapper, the experts module) of PEFT's nested wrappers."""
    found = {}
    layer = experts
    while hasattr(layer, "parameter_name"):
        found[layer.parameter_name] = layer
        layer = layer.base_layer
    return found["gate_up_proj"], found["down_proj"], layer


def _qwen_block(seed=0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                         norm_topk_prob=True)
    cfg._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(cfg)
    return _adapt(block, block.gate, seed)


def _gpt_oss_block(seed=0, limit=0.6):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=12, swiglu_limit=limit)
    cfg._experts_implementation = "eager"
    block = GptOssMLP(cfg)
    return _adapt(block, block.router, seed)


def _experts(family, block, x, idx, w):
    """moe_expert_mlp on the block's experts (PEFT's parameters) for the routing ``idx``, ``w``."""
    gu_w, d_w, base = _wrappers(block.experts)
    loras = dict(gate_up_lora=peft_expert_lora(gu_w), down_lora=peft_expert_lora(d_w))
    if family == "qwen3_moe":
        return moe_expert_mlp(x, idx, w, base.gate_up_proj, base.down_proj, **loras)
    return moe_expert_mlp(x, idx, w, base.gate_up_proj.transpose(1, 2), base.down_proj.transpose(1, 2),
                          base.gate_up_proj_bias, base.down_proj_bias, **loras, activation="gpt_oss",
                          alpha=base.alpha, limit=base.limit)


def _ours(family, block, x, path):
    """The block with its experts replaced by moe_expert_mlp (HF's router)."""
    with use_triton(path == "triton"):
        _, w, idx = (block.gate if family == "qwen3_moe" else block.router)(x)
        return _experts(family, block, x, idx, w)


def _hf(family, block, x):
    y = block(x[None])
    return (y if family == "qwen3_moe" else y[0])[0]


def _grads(block, x):
    return {"x": x.grad, **{n: p.grad for n, p in block.named_parameters() if p.requires_grad}}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_matches_hugging_face_block(family, path, dtype, one_thread):
    # gpt-oss: the clamps bind at limit 0.6 in fp32; in fp16 the pre-activations are rounded (as in HF's fp16
    # module) and a value within half an fp16 ulp of a limit lands on the other side of the clamp than in the
    # float64 oracle, where its gradient is all or nothing: there the default limit 7.0, not reached here.
    block = _qwen_block() if family == "qwen3_moe" else _gpt_oss_block(limit=0.6 if dtype == torch.float32 else 7.0)
    block = block.to(dtype)
    oracle = copy.deepcopy(block).double()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    x64 = x.double().requires_grad_()
    y64 = _hf(family, oracle, x64)
    y64.backward(dy.double())
    want = _grads(oracle, x64)
    # x, the router's weight (and gpt-oss's router bias), lora_A and lora_B of both stacked weights
    assert len(want) == (6 if family == "qwen3_moe" else 7)
    if family == "gpt_oss" and dtype == torch.float32:  # the clamps bind: the gate's, both sides of the up's
        gu = x64 @ oracle.experts.base_layer.base_layer.gate_up_proj[0]
        assert (gu[:, 0::2] > 0.6).any() and (gu[:, 1::2] > 0.6).any() and (gu[:, 1::2] < -0.6).any()
    xl = x.clone().requires_grad_()
    y = _ours(family, block, xl, path)
    y.backward(dy)
    got = _grads(block, xl)
    assert y.dtype == dtype and y.shape == (T, H)
    assert_close(y, y64, dtype, "y")
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == dtype, name
        assert_close(got[name], want[name], dtype, name)


@pytest.mark.parametrize("path", PATHS)
def test_empty_expert_and_long_expert(path, one_thread):
    """Expert 5 gets no token (its factor gradients are exact zeros), expert 0 every token's first slot
    (48 rows: two row blocks), 11 tokens pick the same expert twice; fp16 activations and weights with the
    adapters and ``topk_w`` in fp32 (PEFT's mixed precision: cast for the GEMMs, gradients in fp32); against
    the float64 reference, ``topk_w``'s gradient directly."""
    g = torch.Generator().manual_seed(3)
    second = torch.randint(1, E - 1, (T,), generator=g)
    second[second >= 5] += 1
    idx = torch.stack([torch.zeros(T, dtype=torch.long), second], 1)
    idx[:11, 1] = 0
    w = torch.rand(T, K, generator=g)
    x = torch.randn(T, H, generator=g).half()
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.1).half()
    down = (torch.randn(E, H, I, generator=g) * 0.1).half()
    factors = [torch.randn(s, generator=g) * 0.1 for s in ((R * E, H), (2 * I, R * E), (R * E, I), (H, R * E))]
    dy = torch.randn(T, H, generator=g).half()

    def run(cast, triton):
        leaves = [cast(t).detach().requires_grad_() for t in (x, w, *factors)]
        with use_triton(triton):
            y = moe_expert_mlp(leaves[0], idx, leaves[1], cast(gate_up), cast(down),
                               gate_up_lora=expert_lora(leaves[2], leaves[3], E, 2.0),
                               down_lora=expert_lora(leaves[4], leaves[5], E, 2.0))
        y.backward(cast(dy))
        return [y] + [t.grad for t in leaves]

    got, want = run(lambda t: t, path == "triton"), run(torch.Tensor.double, False)
    names = ["y", "x", "topk_w", "A_gate_up", "B_gate_up", "A_down", "B_down"]
    for name, a, b, dtype in zip(names, got, want, [torch.float16] * 2 + [torch.float32] * 5):
        assert a.dtype == dtype, name
        assert_close(a, b, torch.float16, name)
    empty_rows = slice(5 * R, 6 * R)  # A_e: rows e r .. e r + r - 1; B_e: columns j E + e
    for a, b in ((got[3], got[4]), (got[5], got[6])):
        assert torch.equal(a[empty_rows], torch.zeros_like(a[empty_rows]))
        assert torch.equal(b[:, 5::E], torch.zeros_like(b[:, 5::E]))
        assert a[:R].abs().sum() > 0 and b[:, 0::E].abs().sum() > 0


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
def test_inference_without_adapters(one_thread):
    """No adapter, no gradient: the forward alone (nothing saved), bit for bit the training forward's."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, H, generator=g).half()
    idx = torch.randint(0, E, (5, K), generator=g)
    w = torch.rand(5, K, generator=g)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.1).half()
    down = (torch.randn(E, H, I, generator=g) * 0.1).half()
    with use_triton(True):
        with torch.no_grad():
            y = moe_expert_mlp(x, idx, w, gate_up, down)
        y_train = moe_expert_mlp(x, idx, w.requires_grad_(), gate_up, down)
    assert torch.equal(y, y_train.detach())
    assert_close(y, moe_expert_mlp_reference(x.double(), idx, w.double(), gate_up.double(), down.double()),
                 torch.float16, "y")


def test_errors_are_explained():
    x, idx, w = torch.randn(3, H), torch.zeros(3, K, dtype=torch.long), torch.rand(3, K)
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    with pytest.raises(ValueError, match="do not fit"):
        moe_expert_mlp(x, idx, w, gate_up.transpose(1, 2), down)
    with pytest.raises(ValueError, match="activation"):
        moe_expert_mlp(x, idx, w, gate_up, down, activation="geglu")
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        moe_expert_mlp(x, idx + E, w, gate_up, down)
    with pytest.raises(ValueError, match="frozen"):
        moe_expert_mlp(x, idx, w, gate_up.requires_grad_(), down)
    with pytest.raises(ValueError, match="factors of one rank-r adapter"):
        expert_lora(torch.randn(R * E + 1, H), torch.randn(2 * I, R * E + 1), E, 1.0)


# ------------------------------------------------------------------------------------------------
# GPU only: bf16, a few thousand tokens, the compiled kernels
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_matches_hugging_face_experts_cuda(family, dtype):
    """The experts alone (the routing from the float64 router, so a near-tie cannot pick other experts in
    16 bits) for 3001 tokens: forward, dx, d topk_w and the factors' gradients against the float64 module."""
    block = (_qwen_block() if family == "qwen3_moe" else _gpt_oss_block(limit=7.0)).to("cuda", dtype)
    oracle = copy.deepcopy(block).double()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3001, H, generator=g).to("cuda", dtype)
    dy = torch.randn(3001, H, generator=g).to("cuda", dtype)
    with torch.no_grad():
        _, w64, idx = (oracle.gate if family == "qwen3_moe" else oracle.router)(x.double())
    x64, w64 = x.double().requires_grad_(), w64.clone().requires_grad_()
    oracle.experts(x64, idx, w64).backward(dy.double())
    want = {"x": x64.grad, "topk_w": w64.grad, **{n: p.grad for n, p in oracle.experts.named_parameters()
                                                 if p.requires_grad}}
    xl, wl = x.clone().requires_grad_(), w64.detach().float().requires_grad_()
    y = _experts(family, block, xl, idx, wl)
    y.backward(dy)
    with torch.no_grad():
        assert_close(y, oracle.experts(x.double(), idx, w64), dtype, "y")
    got = {"x": xl.grad, "topk_w": wl.grad, **{n: p.grad for n, p in block.experts.named_parameters()
                                              if p.requires_grad}}
    assert set(got) == set(want) and len(want) == 6
    for name in want:
        assert_close(got[name], want[name], dtype, name)


@pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("num_experts,pairs,block_m", [(6, 67, 32), (128, 16 * 8, 64), (32, 4096, 64), (3, 5, 32)],
                         ids=["E6", "E128-decode", "E32-train", "E3-few"])
def test_block_schedule_kernel_is_the_reference(num_experts, pairs, block_m):
    """The block schedule in one launch equals the tensor arithmetic it replaced, int for int: experts without rows
    (no block), experts of more rows than a block (several), the blocks past the last (expert -1)."""
    import notebookkit.kernels.moe_experts as kernel
    from notebookkit.kernels.moe_experts_grouped import expert_segments

    g = torch.Generator().manual_seed(num_experts + pairs)
    idx = torch.randint(0, max(1, num_experts - 2), (pairs, 1), generator=g)  # the last two experts get no rows
    idx[: pairs // 3] = 1  # one expert with many rows
    _, _, starts, ends = expert_segments(idx, num_experts)
    with use_triton(True):
        rt = kernel._routing(idx, num_experts, block_m)
    want = kernel._block_schedule_reference(starts.long(), ends.long(), rt.blk_expert.numel(), block_m)
    for got, ref, name in zip((rt.blk_expert, rt.blk_start, rt.blk_end), want, ("expert", "start", "end")):
        assert got.dtype == torch.int32 and torch.equal(got, ref), name
    assert (rt.blk_expert == -1).any() and int((rt.blk_expert == 1).sum()) >= (pairs // 3) // block_m
