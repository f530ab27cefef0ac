"""On the GPU: the memory model's predicted peak against the measured peak of real training steps.

A Llama-3.2-1B-shaped model (4 of its 16 layers, random weights, saved as a HF folder) is loaded
through FastLanguageModel, LoRA r=16 on all seven projections, AdamW, batch 2 x 2048 random tokens.
``torch.cuda.max_memory_allocated`` over a step (after optimizer states exist) is compared with
``estimate_training_memory(...).peak_allocated`` for each activation mode and for NF4. The issue
asks for 15% on the benchmark rows; this test holds the model to the same bound.
"""

import pytest

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
             max_position_embeddings=4096)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama1b4")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(path)
    # a tokenizer is not needed for random tokens, but the loader may want one
    try:
        from notebookkit.data.tiny import ensure_tiny_model
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(ensure_tiny_model("notebookkit/tiny-llama")).save_pretrained(path)
    except Exception:
        pass
    return path


def _measure(folder, mode, load_in_4bit, batch=2, seq=2048, steps=3):
    import torch

    from notebookkit import FastLanguageModel

    torch.cuda.empty_cache()
    model, _ = FastLanguageModel.from_pretrained(str(folder), max_seq_length=seq, dtype=torch.bfloat16,
                                                 load_in_4bit=load_in_4bit, show_banner=False)
    ckpt = {"keep": False, "recompute": True, "offload": "offload"}[mode]
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0, bias="none",
                                             use_gradient_checkpointing=ckpt)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, SHAPE["vocab_size"], (batch, seq), device="cuda")
    peak = 0
    for step in range(steps):
        if step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del model, opt, loss
    torch.cuda.empty_cache()
    return peak


@pytest.mark.parametrize("mode,load_in_4bit", [("keep", False), ("recompute", False), ("offload", False),
                                               ("recompute", True)])
def test_predicted_peak_within_15_percent(folder, mode, load_in_4bit):
    from notebookkit.memory import estimate_training_memory

    measured = _measure(folder, mode, load_in_4bit)
    est = estimate_training_memory(dict(SHAPE, model_type="llama"), load_in_4bit=load_in_4bit, dtype="bfloat16",
                                   lora_r=16, optimizer="adamw", batch_size=2, seq_len=2048, activation_plan=mode,
                                   cuda_context_bytes=0)
    ratio = est.peak_allocated / measured
    print(f"{mode} 4bit={load_in_4bit}: predicted {est.peak_allocated / 2**30:.2f} GiB, "
          f"measured {measured / 2**30:.2f} GiB, ratio {ratio:.3f}\n{est}")
    assert 0.85 <= ratio <= 1.15
