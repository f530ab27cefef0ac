"""On the GPU: ``use_gradient_checkpointing="auto"`` with ``max_memory`` trains within the cap.

A 4-layer, random-weight Llama-3.2-1B-shaped model, batch 8 x 2048 tokens. Free VRAM (139 GiB on the
H200) lets the planner keep every layer; a cap between the all-recompute and the all-keep estimate
must make it recompute or offload some layers, and the measured step (allocator peak plus the CUDA
context the cap also covers) must stay under the cap.
"""

import gc
import shutil

import pytest

pytestmark = pytest.mark.gpu

SHAPE = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
             max_position_embeddings=4096, rope_theta=500000.0, hidden_size=2048, intermediate_size=8192,
             num_hidden_layers=4, tie_word_embeddings=True)
BATCH, SEQ = 8, 2048


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from notebookkit.embedded.tiny import ensure_tiny_model

    path = tmp_path_factory.mktemp("llama-1b-4l")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(ensure_tiny_model("notebookkit/tiny-llama")).save_pretrained(path)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _train(folder, max_memory):
    import torch

    from notebookkit import FastLanguageModel
    from notebookkit.memory.model_setup import recorded_activation_plan

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    model, _ = FastLanguageModel.from_pretrained(str(folder), max_seq_length=SEQ, dtype=torch.bfloat16,
                                                 load_in_4bit=False, show_banner=False)
    model = FastLanguageModel.get_peft_model(model, use_gradient_checkpointing="auto", planning_batch_size=BATCH,
                                             max_memory=max_memory, show_banner=False)
    plan = recorded_activation_plan(model.get_base_model())  # "none" when every layer keeps
    plan = ["keep"] * SHAPE["num_hidden_layers"] if plan == "none" else list(plan)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(3, SHAPE["vocab_size"], (BATCH, SEQ), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return plan, peak


def test_auto_keeps_everything_on_a_large_card_and_fits_a_cap(folder):
    import torch

    from notebookkit.memory.estimate import estimate_training_memory

    plan_free, peak_free = _train(folder, None)
    assert plan_free == ["keep"] * 4, plan_free

    kw = dict(load_in_4bit=False, dtype="bfloat16", lora_r=16, batch_size=BATCH, seq_len=SEQ)
    keep = estimate_training_memory(SHAPE | {"model_type": "llama"}, activation_plan="keep", **kw).total
    recompute = estimate_training_memory(SHAPE | {"model_type": "llama"}, activation_plan="recompute", **kw).total
    cap = (keep + recompute) // 2
    plan_cap, peak_cap = _train(folder, cap)
    context = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0] - torch.cuda.memory_reserved()
    print(f"\nfree VRAM: {plan_free} peak {peak_free / 2**30:.2f} GiB; cap {cap / 2**30:.2f} GiB: {plan_cap} "
          f"peak {peak_cap / 2**30:.2f} GiB (+ about {max(context, 0) / 2**30:.2f} GiB outside the allocator)")
    assert plan_cap.count("keep") < 4, plan_cap
    assert peak_cap < cap
    assert peak_cap < peak_free
