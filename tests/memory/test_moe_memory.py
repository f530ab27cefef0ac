"""The memory model's mixture-of-experts terms are what the fused MoE path really holds, and the widget's
verdict for the two curated MoE shapes.

* A kept decoder layer of the tiny Qwen3-MoE (fp32: the fused attention and norms, the fp32 router, the grouped
  kernel's ``gu``, rank-space products, permutation and block schedule) and of the tiny gpt-oss (bf16: its stock
  eager attention with sinks, fp32-weighted norms, PEFT's casts of the attention adapters' inputs, the kernel's
  casts of the expert adapters) is run on the CUDA code path under the Triton interpreter (the kernel's CUDA
  tiles, ``BLOCK_M = 64``), every storage saved for backward counted once and compared byte for byte with
  ``layer_activation_bytes``; the LoRA count is PEFT's (``ParamWrapper``: ``lora_A [r E, in]``, ``lora_B
  [out, r E]``, Qwen3-MoE's gate_up at ``2 r``) and the experts' and routers' bytes are the model's.
* The widget's verdict for Qwen3-30B-A3B and gpt-oss-20b (NF4, 2048 tokens) on a T4 and a 24 GB card.
"""

from __future__ import annotations

import pytest
import torch

from notebookkit.memory import (estimate_for_model, estimate_training_memory, layer_activation_bytes, lora_param_count,
                                model_shape)
from notebookkit.memory import moe as moe_terms

from .activation_probe import cuda_like, decoder_layers, saved_bytes_by_layer

B, T, R = 2, 16, 8


def test_block_m_is_the_kernels():
    from notebookkit.kernels.moe_experts import _config

    cfg = _config(torch.device("cuda"))
    assert (moe_terms.BLOCK_M, moe_terms.BLOCK_N) == (cfg.block_m, cfg.block_n)


@pytest.mark.parametrize("family, dtype", [("qwen3_moe", torch.float32), ("gpt_oss", torch.bfloat16)])
def test_kept_moe_layer_saves_exactly_what_the_model_says(family, dtype, monkeypatch, one_thread):
    import notebookkit.kernels.moe_experts as kernel
    from notebookkit import FastLanguageModel
    from notebookkit.embedded.tiny import ensure_tiny_model
    from notebookkit.memory.grouped_kv import sdpa_repeats_kv

    cuda_tiles = kernel._config(torch.device("cuda"))
    monkeypatch.setattr(kernel, "_config", lambda device: cuda_tiles)  # the row blocks a GPU schedules
    path = str(ensure_tiny_model(f"notebookkit/tiny-{family}"))
    model, _ = FastLanguageModel.from_pretrained(path, max_seq_length=T, dtype=dtype, load_in_4bit=False,
                                                 show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=R, lora_alpha=R, use_gradient_checkpointing=False,
                                             show_banner=False).train()
    shape, s = model_shape(path), dtype.itemsize
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert shape.num_experts and trainable == lora_param_count(shape, R)
    assert estimate_for_model(model, seq_len=T).inputs["lora_params"] == trainable  # read off PEFT's config
    layers = decoder_layers(model)
    experts_and_routers = sum(t.numel() * t.element_size() for layer in layers
                              for name, t in layer.mlp.named_parameters() if "lora_" not in name)
    weights = estimate_training_memory(shape, dtype=dtype, seq_len=T).details
    assert experts_and_routers == sum(v for k, v in weights.items() if "experts" in k or "routers" in k)

    ids = torch.randint(0, shape.vocab_size, (B, T))
    with cuda_like():
        saved = saved_bytes_by_layer(model, input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    repeats = sdpa_repeats_kv(on_cuda=True, masked=False, capability=(9, 0), dtype_bytes=s, head_dim=shape.head_dim,
                              grouped=shape.num_kv_heads < shape.num_heads)
    predicted = layer_activation_bytes(shape, "keep", batch_size=B, seq_len=T, dtype_bytes=s, lora_r=R,
                                       kv_repeated=repeats)
    measured = saved[len(layers) - 1]
    assert sum(measured.values()) == predicted, (family, dict(measured))
    # the kernel's int32 bookkeeping: the permutation, expert offsets and the block schedule
    n = B * T * shape.experts_per_token
    assert measured["int32"] == 4 * n + 8 * shape.num_experts + 12 * (-(-n // 64) + shape.num_experts)


VERDICTS = {  # (model, card, dtype): what the panel's headline says, with its predicted peak
    ("Qwen/Qwen3-30B-A3B", "t4", "float16"): "66.66 GiB of 14.75 GiB (Tesla T4 16GB) — does not fit",
    ("Qwen/Qwen3-30B-A3B", "rtx4090", "bfloat16"): "66.66 GiB of 23.64 GiB (GeForce RTX 4090 24GB) — does not fit",
    ("openai/gpt-oss-20b", "t4", "float16"): "45.21 GiB of 14.75 GiB (Tesla T4 16GB) — does not fit",
    ("openai/gpt-oss-20b", "rtx4090", "bfloat16"): "45.21 GiB of 23.64 GiB (GeForce RTX 4090 24GB) — does not fit",
}


@pytest.mark.parametrize("name, card, dtype", list(VERDICTS))
def test_widget_verdict_for_the_moe_shapes(name, card, dtype):
    """NF4 on this branch leaves the experts 16-bit (bitsandbytes quantises nn.Linear only): neither model fits
    either card, and the panel says why and that no LoRA rank fits, every layer recomputed (no offloading)."""
    import html
    import re

    from notebookkit.widgets.model_panel import ModelChoice, compute_estimate, estimate_html

    res = compute_estimate(ModelChoice(model_name=name, card=card, dtype=dtype, load_in_4bit=True, max_seq_length=2048))
    text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", estimate_html(res))))
    assert VERDICTS[(name, card, dtype)] in text, text
    assert "stay in the compute dtype under load_in_4bit" in text and "every layer recomputed" in text, text
    assert set(res.estimate.plan) == {"recompute"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_block_working_sets_are_what_it_allocates(dtype, monkeypatch, one_thread):
    """One grouped call (Qwen3-MoE layout, fp32 adapters at ranks 2r / r) under ``LiveBytes``, launch arguments
    released as a GPU would: what is alive after the forward is what it saved plus ``y``, and the forward's and
    the backward's peaks above that are :func:`~notebookkit.memory.moe.sparse_block_working_sets`, byte for byte."""
    import notebookkit.kernels.moe_experts as kernel
    from notebookkit.memory.shapes import ModelShape

    from .activation_probe import LiveBytes

    cuda_tiles = kernel._config(torch.device("cuda"))
    monkeypatch.setattr(kernel, "_config", lambda device: cuda_tiles)
    tokens, H, I, E, k, r = 128, 64, 96, 8, 2, 4
    s = dtype.itemsize
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, H, generator=g).to(dtype).requires_grad_()
    w, idx = torch.softmax(torch.randn(tokens, E, generator=g), -1).topk(k, -1)
    w.requires_grad_()
    gate_up, down = (0.1 * torch.randn(E, 2 * I, H, generator=g)).to(dtype), (0.1 * torch.randn(E, H, I, generator=g)).to(dtype)
    factors = [(0.1 * torch.randn(*shape, generator=g)).requires_grad_()
               for shape in ((2 * r * E, H), (2 * I, 2 * r * E), (r * E, I), (H, r * E))]
    loras = kernel.expert_lora(*factors[:2], E, 1.0), kernel.expert_lora(*factors[2:], E, 1.0)
    dy = torch.randn(tokens, H, generator=g).to(dtype)

    def run():
        return kernel.moe_expert_mlp(x, idx, w, gate_up, down, None, None, *loras)

    with cuda_like(release_launch_args=True):
        run().backward(dy)  # warm-up: the kernels compiled, the gradients' storages made once
        for p in (x, w, *factors):
            p.grad = None
        probe = LiveBytes()
        with probe:
            y = run()
            forward_peak, after_forward = probe.peak, probe.live
            probe.peak = probe.live
            y.backward(dy)
            backward_peak = probe.peak
    shape = ModelShape("block", "qwen3_moe", H, 1, 4, 2, 16, 0, 100, False, num_experts=E, experts_per_token=k,
                       expert_intermediate_size=I)
    ranks = {"gate_up_proj": 2 * r, "down_proj": r}
    saved = moe_terms.sparse_block_saved_bytes(shape, tokens=tokens, s=s, ranks=ranks)["experts"]
    ws = moe_terms.sparse_block_working_sets(shape, tokens=tokens, s=s, ranks=ranks)
    assert after_forward == saved + tokens * H * s  # what it saved for backward, and y
    assert forward_peak - (after_forward - tokens * H * s) == ws["forward"]  # beyond what it saved (y comes last)
    assert backward_peak - after_forward == ws["backward"]
