"""The memory model's mixture-of-experts terms are what the fused MoE path really holds, and the widget's
verdict for the two curated MoE shapes.

* A kept decoder layer of the tiny Qwen3-MoE (fp32: the fused attention and norms, the fp32 router, the grouped
  kernel's ``gu``, rank-space products, permutation and block schedule) and of the tiny gpt-oss (bf16: its fused
  attention with sinks, its norms with fp32 weights, PEFT's casts of the attention adapters' inputs, the kernel's
  casts of the expert adapters) is run on the CUDA code path under the Triton interpreter (the kernel's CUDA
  tiles, ``BLOCK_M = 64``), every storage saved for backward counted once and compared byte for byte with
  ``layer_activation_bytes``; the LoRA count is PEFT's (``ParamWrapper``: ``lora_A [r E, in]``, ``lora_B
  [out, r E]``, Qwen3-MoE's gate_up at ``2 r``) and the experts' and routers' bytes are the model's.
* The widget's verdict for Qwen3-30B-A3B and gpt-oss-20b (NF4, 2048 tokens) on a T4 and a 24 GB card (NF4
  experts under ``load_in_4bit``: gpt-oss-20b fits 24 GB), and the NF4 experts' bytes of a loaded tiny model.
"""

from __future__ import annotations

import pytest
import torch

from notebookkit.memory import (estimate_for_model, estimate_training_memory, layer_activation_bytes, lora_param_count,
                                model_shape)
from notebookkit.memory import moe as moe_terms
from notebookkit.memory.estimate import SINKS_MASK_KINDS, shared_mask_bytes

from .activation_probe import cuda_like, decoder_layers, saved_bytes_by_layer

B, T, R = 2, 16, 8


def test_block_m_is_the_kernels():
    """The memory model's row block is the smallest the kernels use on CUDA (its schedule, ``cdiv(n, BLOCK_M) + E``
    blocks, then bounds theirs) and its column tile every configuration's."""
    from notebookkit.kernels import moe_experts

    configs = [moe_experts._CUDA_CONFIG, moe_experts._SM90_CONFIG, moe_experts._SM90_LONG_CONFIG]
    assert moe_terms.BLOCK_M == min(cfg.block_m for cfg in configs)
    assert {cfg.block_n for cfg in configs} == {moe_terms.BLOCK_N}


@pytest.mark.parametrize("family, dtype", [("qwen3_moe", torch.float32), ("gpt_oss", torch.bfloat16)])
def test_kept_moe_layer_saves_exactly_what_the_model_says(family, dtype, monkeypatch, one_thread):
    import notebookkit.kernels.moe_experts as kernel
    from notebookkit import FastLanguageModel
    from notebookkit.embedded.tiny import ensure_tiny_model
    from notebookkit.memory.grouped_kv import sdpa_repeats_kv

    monkeypatch.setattr(kernel, "_config", lambda *_: kernel._CUDA_CONFIG)  # the row blocks a GPU schedules
    path = str(ensure_tiny_model(f"notebookkit/tiny-{family}"))
    # gpt-oss with four layers (two of each kind, the extra two randomly initialised): its layers share two masks
    deeper = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2) if family == "gpt_oss" else {}
    model, _ = FastLanguageModel.from_pretrained(path, max_seq_length=T, dtype=dtype, load_in_4bit=False,
                                                 show_banner=False, **deeper)
    model = FastLanguageModel.get_peft_model(model, r=R, lora_alpha=R, use_gradient_checkpointing=False,
                                             show_banner=False).train()
    shape, s = model_shape(model), dtype.itemsize
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
                                       kv_repeated=repeats, grouped_mm=False)  # the CPU runs the Triton kernels
    # the attention with sinks saves one boolean mask of each kind for all layers: charged to the first layer
    # of each kind that saves it (the probe counts a storage once), counted once by the model
    shared = sum(shared_mask_bytes(shape, ("keep",) * len(layers), B, T, s).values())
    first_of_kind = B * T * T if shape.attention_sinks else 0
    assert [saved[i].get("bool", 0) for i in range(len(layers))] == [first_of_kind] * SINKS_MASK_KINDS + [0] * (
        len(layers) - SINKS_MASK_KINDS)
    assert sum(saved[i].get("bool", 0) for i in range(len(layers))) == shared
    measured = saved[len(layers) - 1]
    assert sum(measured.values()) == predicted, (family, dict(measured), predicted)
    # the kernel's int32 bookkeeping: the permutation, expert offsets and the block schedule
    n = B * T * shape.experts_per_token
    assert measured["int32"] == 4 * n + 8 * shape.num_experts + 12 * (-(-n // 64) + shape.num_experts)


VERDICTS = {  # (model, card, dtype, load_in_4bit): what the panel's headline says, with its predicted peak
    # (the 24 GiB rows rose 0.01 GiB in session 46: the training stream's cuBLAS workspace, 8.125 MiB off sm_90)
    ("Qwen/Qwen3-30B-A3B", "t4", "float16", True): "26.66 GiB of 14.75 GiB (Tesla T4 16GB) — does not fit",
    ("Qwen/Qwen3-30B-A3B", "rtx4090", "bfloat16", True): "26.79 GiB of 23.64 GiB (GeForce RTX 4090 24GB) — does not fit",  # bf16: the larger of the Triton and grouped_mm paths (the estimate does not know the card)
    # gpt-oss: attention with sinks on the fused kernels (Hugging Face's eager one gave 18.79, 21.93 and 46.06 GiB:
    # its [B, heads, T, T + 1] probabilities and their gradients); and its norms on the fused kernel (Hugging
    # Face's saved fp32 inputs: 15.12, 22.42 and 42.46 GiB); its boolean masks shared by the layers (one a layer:
    # 15.08, 22.55 and 42.41 GiB, without Hugging Face's masks that the recompute's checkpoints hold)
    ("openai/gpt-oss-20b", "t4", "float16", True): "15.12 GiB of 14.75 GiB (Tesla T4 16GB) — does not fit",
    ("openai/gpt-oss-20b", "rtx4090", "bfloat16", True): "22.44 GiB of 23.64 GiB (GeForce RTX 4090 24GB) — fits",
    # 16-bit experts (before NF4 experts, load_in_4bit gave 45.21 GiB here: NF4 attention, 16-bit experts)
    ("openai/gpt-oss-20b", "rtx4090", "bfloat16", False): "42.46 GiB of 23.64 GiB (GeForce RTX 4090 24GB) — does not fit",
}


ADVICE = {  # what the panel says to change where it does not fit at the default rank 16
    ("Qwen/Qwen3-30B-A3B", "t4", "float16", True): "every layer recomputed",
    ("Qwen/Qwen3-30B-A3B", "rtx4090", "bfloat16", True): "NF4 (4-bit): fits with LoRA r≤10",
    # (with Hugging Face's eager attention: "does not fit at any LoRA rank (about 16.09 GiB at r=1")
    ("openai/gpt-oss-20b", "t4", "float16", True): "What to change: offload_embedding=True (input embedding in host RAM) "
                                                   "(about 14.04 GiB)",
    ("openai/gpt-oss-20b", "rtx4090", "bfloat16", False): "What to change: load_in_4bit=True (NF4 (4-bit) base)",
}


@pytest.mark.parametrize("name, card, dtype, nf4", list(VERDICTS))
def test_widget_verdict_for_the_moe_shapes(name, card, dtype, nf4):
    """Under load_in_4bit the experts are NF4 (the loader's own step; bitsandbytes quantises nn.Linear only):
    gpt-oss-20b now fits a 24 GB card (a few layers kept, the rest recomputed), and what does not fit says
    how much its experts take and in which format; in 16-bit neither fits."""
    import html
    import re

    from notebookkit.widgets.model_panel import ModelChoice, compute_estimate, estimate_html

    res = compute_estimate(ModelChoice(model_name=name, card=card, dtype=dtype, load_in_4bit=nf4, max_seq_length=2048))
    text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", estimate_html(res))))
    assert VERDICTS[(name, card, dtype, nf4)] in text, text
    experts = [k for k in res.estimate.details if k.startswith("base weights: experts")]
    assert experts == ["base weights: experts (NF4)" if nf4 else "base weights: experts (compute dtype)"]
    if "does not fit" in VERDICTS[(name, card, dtype, nf4)]:
        held = "in NF4 (load_in_4bit)" if nf4 else "in the compute dtype (load_in_4bit=True would hold them in NF4"
        assert held in text and ADVICE[(name, card, dtype, nf4)] in text, text
        assert set(res.estimate.plan) == {"recompute"}
    else:
        assert "keep" in res.estimate.plan and "offload" not in res.estimate.plan


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_nf4_experts_take_what_the_model_says(family, monkeypatch, one_thread):
    """Loaded with load_in_4bit, the experts' and routers' bytes (codes, absmax codes, second-level scales,
    offset, the two tables; routers in the compute dtype) are the memory model's, byte for byte; the kernels'
    view of them decodes chunks as large as the card holding them allows (an 80 GiB card's here), or as the
    ``"auto"`` plan counted (a cap's) until a mode chosen by hand; the Trainer's re-apply keeps the plan's."""
    from notebookkit import FastLanguageModel
    from notebookkit.base_layers.nf4_experts import NF4ExpertParam
    from notebookkit.embedded.tiny import ensure_tiny_model

    path = str(ensure_tiny_model(f"notebookkit/tiny-{family}"))
    model, _ = FastLanguageModel.from_pretrained(path, max_seq_length=T, dtype=torch.float32, load_in_4bit=True,
                                                 show_banner=False)
    held = 0
    for layer in decoder_layers(model):
        for name, t in layer.mlp.named_parameters():
            if isinstance(t, NF4ExpertParam):
                q = t.quant_state
                held += sum(x.numel() * x.element_size() for x in (t.data, q.absmax, q.offset.reshape(1), q.code,
                                                                   q.state2.absmax, q.state2.code))
            else:
                held += t.numel() * t.element_size()
    weights = estimate_training_memory(model_shape(path), dtype=torch.float32, seq_len=T, load_in_4bit=True).details
    assert "base weights: experts (NF4)" in weights
    assert held == sum(v for k, v in weights.items() if "experts" in k or "routers" in k)
    from notebookkit import expert_chunks
    from notebookkit.families import for_model_type
    from notebookkit.models.patching import checkpointing, patch_moe

    monkeypatch.setattr(expert_chunks, "process_card_bytes", lambda device: 80 * 2**30)

    def chunks() -> set[int]:
        views = [patch_moe.experts_view(layer.mlp.experts, for_model_type(family).moe)[0]
                 for layer in decoder_layers(model)]
        return {w.chunk_bytes for view in views for w in (view.gate_up, view.down)}

    assert chunks() == {320 * 2**20}
    layers = len(decoder_layers(model))
    monkeypatch.setattr(checkpointing, "auto_plan", lambda *a, **k: (["recompute"] * layers, "planned", 200 * 2**20))
    checkpointing.apply_checkpointing(model, "auto", seq_len=T)
    model.gradient_checkpointing_enable()  # a Trainer's: re-applies the recorded plan
    assert chunks() == {200 * 2**20}
    checkpointing.apply_checkpointing(model, True)
    assert chunks() == {320 * 2**20}


def test_the_decode_chunk_budget_grows_with_the_card():
    """The least (128 MiB) up to 32 GiB, a 256th of the card above, at most 1 GiB; the planner and the widget
    count the chunks of the card they plan for (a named card's; the verdicts above are a T4's and a 24 GiB
    card's, which keep the least), and an 80 GiB card's chunk makes the step's peak larger than a T4's."""
    from notebookkit.expert_chunks import DECODE_CHUNK_BYTES, decode_chunk_bytes
    from notebookkit.memory import plan_activations
    from notebookkit.memory.cards import CARDS

    budgets = {key: decode_chunk_bytes(CARDS[key].memory_bytes) for key in ("t4", "rtx4090", "a100-40gb", "h100")}
    assert budgets == {"t4": DECODE_CHUNK_BYTES, "rtx4090": DECODE_CHUNK_BYTES, "a100-40gb": 40536 * 2**20 // 256,
                       "h100": 81000 * 2**20 // 256}
    assert decode_chunk_bytes(None) == DECODE_CHUNK_BYTES and decode_chunk_bytes(2**40) == 2**30
    shape = model_shape("Qwen/Qwen3-30B-A3B")
    kw = dict(load_in_4bit=True, dtype="bfloat16", seq_len=2048)
    plan = plan_activations(shape, card="h100", **kw)
    assert plan.estimate.cublas_workspace == CARDS["h100"].cublas_workspace_bytes == 32 * 2**20  # the card's too
    at = {chunk: estimate_training_memory(shape, activation_plan=list(plan.modes), expert_chunk_bytes=chunk,
                                          cublas_workspace_bytes=32 * 2**20, **kw).peak_allocated
          for chunk in (None, budgets["h100"])}
    assert plan.estimate.peak_allocated == at[budgets["h100"]] > at[None]
    assert plan.estimate.inputs["expert_chunk_bytes"] == budgets["h100"]
    # a cap on that card plans the cap's chunks (the kernels then decode with the plan's: test above)
    capped = plan_activations(shape, max_memory="40GiB", card="h100", **kw)
    assert capped.estimate.inputs["expert_chunk_bytes"] == 40 * 2**30 // 256


@pytest.mark.parametrize("dtype, nf4, grouped, adapters, per_chunk, on_device", [
    (torch.float32, False, False, torch.float32, 3, False), (torch.bfloat16, False, False, torch.float32, 3, False),
    (torch.bfloat16, True, False, torch.float32, 3, False), (torch.bfloat16, False, True, torch.float32, 3, False),
    (torch.bfloat16, True, True, torch.float32, 3, False), (torch.bfloat16, True, True, torch.float32, 3, True),
    (torch.bfloat16, True, True, torch.float32, 8, False), (torch.bfloat16, False, True, torch.bfloat16, 3, False)],
    ids=["float32", "bfloat16", "bfloat16-nf4-chunks", "bfloat16-grouped-mm", "bfloat16-nf4-grouped-mm",
         "bfloat16-nf4-grouped-mm-device-bounds", "bfloat16-nf4-grouped-mm-one-chunk",
         "bfloat16-grouped-mm-bf16-adapters"])
def test_sparse_block_working_sets_are_what_it_allocates(dtype, nf4, grouped, adapters, per_chunk, on_device,
                                                         monkeypatch, one_thread):
    """One grouped call (Qwen3-MoE layout, adapters at ranks 2r / r, fp32 or in the compute dtype) under
    ``LiveBytes``, launch arguments released as a GPU would: what is alive after the forward is what it saved plus
    ``y``, and the forward's and the backward's peaks above that are
    :func:`~notebookkit.memory.moe.sparse_block_working_sets`, byte for byte. ``nf4-chunks``: NF4 experts decoded
    three at a time (16 rows an expert, the chunk made small), the decoded chunk counted by
    :func:`~notebookkit.memory.moe.expert_decode_chunk_bytes`; ``one-chunk``: the budget holds every expert, so
    each GEMM's product is its output; ``device-bounds``: the chunks read gathered rows, the segment bounds kept on
    the device. ``bf16-adapters``: no cast, so the grouped path copies PEFT's strided ``B`` views itself."""
    import notebookkit.kernels.moe_experts as kernel
    from notebookkit import expert_chunks
    from notebookkit.export.nf4_quantize import quantize_nf4
    from notebookkit.kernels.nf4_stacked import nf4_stacked
    from notebookkit.memory.shapes import ModelShape

    from .activation_probe import LiveBytes

    monkeypatch.setattr(kernel, "_config", lambda device, pairs=0, experts=1, quantised=False: kernel._CUDA_CONFIG
                        ._replace(chunked=quantised and expert_chunks.decodes_in_chunks(pairs, experts)))
    monkeypatch.setattr(kernel, "grouped_mm_applies", lambda *args: grouped)
    monkeypatch.setenv("NOTEBOOKKIT_MOE_DEVICE_BOUNDS", "1" if on_device else "0")
    tokens, H, I, E, k, r = 128, 64, 96, 8, 2, 8 if grouped else 4  # grouped_mm: 16-byte strides
    s = dtype.itemsize
    monkeypatch.setattr(expert_chunks, "DECODE_CHUNK_BYTES", per_chunk * 2 * I * H * s)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, H, generator=g).to(dtype).requires_grad_()
    w, idx = torch.softmax(torch.randn(tokens, E, generator=g), -1).topk(k, -1)
    if nf4 and grouped:  # every row in the first chunk: its GEMMs' outputs at their bound (every row)
        idx = torch.arange(k).expand(tokens, k)
    w.requires_grad_()
    gate_up, down = (0.1 * torch.randn(E, 2 * I, H, generator=g)).to(dtype), (0.1 * torch.randn(E, H, I, generator=g)).to(dtype)
    if nf4:
        gate_up, down = (nf4_stacked(q.packed, q) for q in (quantize_nf4(gate_up), quantize_nf4(down)))
    factors = [(0.1 * torch.randn(*shape, generator=g)).to(adapters).requires_grad_()
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
    a = adapters.itemsize
    saved = moe_terms.sparse_block_saved_bytes(shape, tokens=tokens, s=s, ranks=ranks, grouped=grouped,
                                               adapter_bytes=a)["experts"]
    ws = moe_terms.sparse_block_working_sets(shape, tokens=tokens, s=s, ranks=ranks, nf4=nf4, grouped=grouped,
                                             adapter_bytes=a)
    assert (moe_terms.expert_decode_chunk_bytes(shape, tokens=tokens, s=s, nf4=nf4) > 0) == nf4
    assert after_forward == saved + tokens * H * s  # what it saved for backward, and y
    assert forward_peak - (after_forward - tokens * H * s) == ws["forward"]  # beyond what it saved (y comes last)
    assert backward_peak - after_forward == ws["backward"]


EXPLICIT_PARAMETERS = [["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], ["mlp.experts.gate_up_proj"],
                       ["mlp.experts.down_proj"]]


@pytest.mark.parametrize("target_parameters", EXPLICIT_PARAMETERS, ids=["both", "gate_up", "down"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_explicit_target_parameters_count_the_adapters_peft_makes(family, target_parameters, one_thread):
    """``get_peft_model(target_parameters=[...])`` names the stacked weights itself: PEFT adapts each at ``r``
    (Qwen3-MoE's gate_up too, not at the ``2 r`` of PEFT's own gate_proj + up_proj mapping) and only those named
    (gpt-oss: not both whenever one is). The estimate's adapter count and bytes (weights, gradients, optimizer
    states) are PEFT's, read off the model, and the count is the same given the names."""
    from notebookkit import FastLanguageModel
    from notebookkit.embedded.tiny import ensure_tiny_model

    path = str(ensure_tiny_model(f"notebookkit/tiny-{family}"))
    model, _ = FastLanguageModel.from_pretrained(path, max_seq_length=T, dtype=torch.float32, load_in_4bit=False,
                                                 show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=R, lora_alpha=R, target_modules=["q_proj", "v_proj"],
                                             target_parameters=target_parameters, use_gradient_checkpointing=False,
                                             show_banner=False)
    adapters = [p for p in model.parameters() if p.requires_grad]
    adapted = {n.split(".")[-1] for n in target_parameters}
    assert any(getattr(m, "parameter_name", None) in adapted for m in model.modules())  # PEFT wrapped them
    estimate = estimate_for_model(model, seq_len=T, optimizer="adamw")
    assert estimate.inputs["lora_params"] == sum(p.numel() for p in adapters)
    fp32 = sum(p.numel() * p.element_size() for p in adapters)
    details = estimate.details
    assert details["adapters + optimizer: LoRA weights"] == fp32
    assert details["adapters + optimizer: gradients"] == fp32
    assert details["adapters + optimizer: optimizer states"] == 2 * fp32  # AdamW's two fp32 moments
    # the same names given to the memory model directly (before loading anything), as get_peft_model takes them
    named = estimate_training_memory(path, dtype=torch.float32, seq_len=T, lora_r=R,
                                     target_modules=["q_proj", "v_proj"], target_parameters=target_parameters)
    assert named.inputs["lora_params"] == sum(p.numel() for p in adapters)


@pytest.mark.parametrize("family, dtype, top_k", [("qwen3_moe", torch.float32, 2), ("gpt_oss", torch.bfloat16, 2),
                                                  ("gpt_oss", torch.bfloat16, 4)])
def test_reference_forward_of_a_moe_layer_is_what_it_allocates(family, dtype, top_k, monkeypatch, one_thread):
    """DPO's reference pass: the last decoder layer of a tiny MoE run again with its adapters off and no gradient
    (the training path: gpt-oss's eager attention with sinks, the grouped kernel) under ``LiveBytes``, its input
    and mask already there. The sparse block's peak is :func:`~notebookkit.memory.moe.sparse_block_generation_bytes`
    byte for byte, gpt-oss's whole layer is the reference term (``layer_working_set(..., training_path=True)``,
    the attention at 2 a token, the block at 4) byte for byte; Qwen3-MoE's fused attention is counted with the dense
    formula, which holds more here (98,816 bytes measured, 131,072 predicted)."""
    import notebookkit.kernels.moe_experts as kernel
    from notebookkit import FastLanguageModel
    from notebookkit.embedded.tiny import ensure_tiny_model
    from notebookkit.memory.generation import layer_working_set

    from .activation_probe import LiveBytes

    monkeypatch.setattr(kernel, "_config", lambda *_: kernel._CUDA_CONFIG)
    path = str(ensure_tiny_model(f"notebookkit/tiny-{family}"))
    model, _ = FastLanguageModel.from_pretrained(path, max_seq_length=T, dtype=dtype, load_in_4bit=False,
                                                 show_banner=False, num_experts_per_tok=top_k)
    model = FastLanguageModel.get_peft_model(model, r=R, lora_alpha=R, use_gradient_checkpointing=False,
                                             show_banner=False).train()
    shape, s = model_shape(model.config), dtype.itemsize
    assert shape.experts_per_token == top_k
    layer = decoder_layers(model)[-1]
    seen = {}
    hook = layer.register_forward_pre_hook(lambda m, a, kw: seen.update(args=a, kwargs=kw), with_kwargs=True)
    ids = torch.randint(0, shape.vocab_size, (B, T))
    with cuda_like(release_launch_args=True), torch.no_grad(), model.disable_adapter():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))  # also compiles the kernels
        hook.remove()
        x = layer.post_attention_layernorm(seen["args"][0] if seen["args"] else seen["kwargs"]["hidden_states"])
        peaks = {}
        for part, run in (("block", lambda: layer.mlp(x)), ("layer", lambda: layer(*seen["args"], **seen["kwargs"]))):
            probe = LiveBytes()
            with probe:
                out = run()
            peaks[part] = probe.peak
            del out
    N, H = B * T, shape.hidden_size
    block = moe_terms.sparse_block_generation_bytes(shape, tokens=N, s=s)
    assert peaks["block"] == block - 2 * N * H * s  # its input x and the residual were there already
    reference = layer_working_set(shape, B, T, T, s, False, "auto", training_path=True)
    # through the block the layer's input and mask stay held
    in_layer = block + N * H * s + B * T * T * s
    held = N * H * s + B * T * T * s  # the layer's input and mask were there already
    assert in_layer - held <= peaks["layer"] <= reference - held, peaks


@pytest.mark.parametrize("name", ["openai/gpt-oss-20b", "Qwen/Qwen3-30B-A3B"])
def test_dpo_and_grpo_estimates_for_the_moe_shapes(name):
    """DPO and GRPO estimate (no longer refused): DPO's step is ORPO's (the same rows and log-prob buffers) with the
    reference pass's layer on top of the end-of-forward peak; GRPO holds generation as for a dense model; both say
    that TRL's default router loss leaves the fused path."""
    from notebookkit.memory import generation_memory
    from notebookkit.memory.generation import layer_working_set

    shape = model_shape(name)
    kw = dict(load_in_4bit=True, dtype="float16", lora_r=8, seq_len=1024, batch_size=1, activation_plan="keep")
    orpo = estimate_training_memory(name, method="orpo", **kw)
    dpo = estimate_training_memory(name, method="dpo", **kw)
    reference = layer_working_set(shape, 2, 1024, 1024, 2, True, "auto", training_path=True)
    assert reference > moe_terms.sparse_block_generation_bytes(shape, tokens=2048, s=2)
    over = lambda e: e.temporaries - e.cuda_context - e.cublas_workspace  # noqa: E731
    assert over(dpo) == max(over(orpo), reference) and dpo.total - orpo.total == max(0, reference - over(orpo))
    assert any("DPOConfig(router_aux_loss_coef=0.0)" in n for n in dpo.notes)
    grpo = estimate_training_memory(name, method="grpo", completion_len=256, **kw)
    held = generation_memory(shape, 1, 1024, 2, prompt_len=768, load_in_4bit=True).held
    assert grpo.inputs["generation"]["keep_cache"] and grpo.generation >= held > 0
    assert any("GRPOConfig(router_aux_loss_coef=0.0)" in n for n in grpo.notes)
    sft = estimate_training_memory(name, **kw)  # SFT keeps the fused loss with TRL's router loss, and counts it
    assert any("router load-balancing loss on by default" in n for n in sft.notes)
    assert sft.details["logits / loss: router logits and their fp32 softmax (load-balancing loss)"] == \
        shape.num_layers * kw.get("batch_size", 1) * kw["seq_len"] * shape.num_experts * (2 + 4)


@pytest.mark.parametrize("method", ["dpo", "grpo"])
def test_widget_verdict_for_moe_dpo_and_grpo(method):
    """The model panel's verdict for gpt-oss-20b (NF4, r=8, 1,024 tokens, batch 1) on a T4 now has numbers for DPO
    and GRPO; DPO's pairs hold more than SFT's single rows."""
    from types import SimpleNamespace

    from notebookkit.widgets.model_panel import ModelChoice, compute_estimate
    from notebookkit.widgets.training_panel import TrainingChoice

    model = ModelChoice(model_name="openai/gpt-oss-20b", card="t4", dtype="float16", load_in_4bit=True,
                        max_seq_length=1024)
    lora = SimpleNamespace(r=8, activation_mode="recompute")
    sft = compute_estimate(model, lora, TrainingChoice(per_device_train_batch_size=1))
    res = compute_estimate(model, lora, TrainingChoice(per_device_train_batch_size=1, method=method))
    assert res.estimate.inputs["method"] == method and res.estimate.total > 0
    assert (res.estimate.total > sft.estimate.total) if method == "dpo" else res.estimate.total >= sft.estimate.total
