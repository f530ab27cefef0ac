"""GPU checks of the model layer (run on the GPU machine: ``pytest -m gpu tests/models -s``).

* bf16 parity on a random model shaped like Llama-3.2-1B: 20 LoRA steps, notebookkit vs
  transformers + PEFT on the same weights, seed and batches of a learnable stream (rows walking a
  cycle of 32 token ids, ``benchmarks/learning_check.py``: on uniformly random tokens the loss
  moved 0.1%, so a run whose adapters never updated passed); the loss must fall, the curves agree
  within 1%, and the first step's LoRA gradients and the LoRA updates after 20 steps are no further
  from an fp32 HF+PEFT run than a few times the bf16 HF+PEFT run is (the measured bf16 noise floor).
* the FP8 forward against the bf16 one on the same stream, and ``benchmarks/fp8_quality.py``'s
  check (both curves fall by half, FP8 tracks 16-bit) on a 4-layer model of the 1B shape.
* one training step, memory and time, side by side with plain HF + PEFT (printed).
* offloaded checkpointing: same gradients as recompute, lower peak memory than keeping activations.
* fp16 (T4 dtype) and 4-bit smoke parity.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from notebookkit.kernels.testing import rel_err
from notebookkit.models import FastLanguageModel

from .helpers import train_losses

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fp8_quality  # noqa: E402
from learning_check import cycle_stream, loss_drop, lora_snapshot, lora_updates, update_difference  # noqa: E402

pytestmark = pytest.mark.gpu

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama_1b_config(layers: int = 16):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )


@pytest.fixture(scope="module")
def llama_1b_folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from .helpers import byte_tokenizer

    folder = tmp_path_factory.mktemp("llama-1b-shaped")
    torch.manual_seed(0)
    with torch.device("cuda"):  # its random init on the CPU took 47 s of each worker's setup (session 47)
        model = AutoModelForCausalLM.from_config(llama_1b_config(), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    yield str(folder)
    shutil.rmtree(folder, ignore_errors=True)  # 2.5 GB a worker: module folders otherwise stay to the session's end


def _batches(n, batch, seq, vocab=128256, seed=0):
    """Batches of the learnable cycle stream, the first quarter of each row masked out of the loss."""
    out = []
    for ids in cycle_stream(n, batch, seq, vocab, symbols=32, seed=seed):
        labels = ids.clone()
        labels[:, : seq // 4] = -100
        out.append({"input_ids": ids.cuda(), "attention_mask": torch.ones_like(ids).cuda(), "labels": labels.cuda()})
    return out


def _reference(folder, dtype, load_in_4bit=False):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kw = {}
    if load_in_4bit:
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
        )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map={"": 0}, attn_implementation="sdpa", **kw)
    torch.manual_seed(3407)
    cfg = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, bias="none", target_modules=TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def _ours(folder, dtype, load_in_4bit=False, checkpointing=False, fp8=False):
    from transformers import AutoConfig

    from notebookkit.families import for_model_type

    row = for_model_type(AutoConfig.from_pretrained(folder).model_type)
    if dtype == torch.float16 and row is not None and row.fp16_overflow and not load_in_4bit:
        # the loader refuses fp16 for Gemma 2/3 (real checkpoints overflow it); the tiny random weights do not,
        # so the fused kernels' fp16 arithmetic is still compared here, on a model cast after loading
        model, _ = FastLanguageModel.from_pretrained(folder, dtype=torch.float32, load_in_4bit=False, max_seq_length=4096)
        model.half()
    else:
        model, _ = FastLanguageModel.from_pretrained(folder, dtype=dtype, load_in_4bit=load_in_4bit, max_seq_length=4096)
    return FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, random_state=3407,
                                            use_gradient_checkpointing=checkpointing, fp8_base_matmul=fp8)


def _train(model, batches, steps=20, lr=2e-4):
    return train_losses(model, batches, steps, lr)


def _train_and_record(model, batches, steps=20, lr=2e-4):
    """(losses, the first step's lora_B gradients, the LoRA updates A_final - A_init and B_final - 0)."""
    before = lora_snapshot(model)
    grads: dict = {}
    losses = train_losses(model, batches, steps, lr, first_grads=grads)
    first_b = {n: g for n, g in grads.items() if "lora_B" in n}  # lora_A's are 0 while B is
    updates = lora_updates(before, lora_snapshot(model))
    del model
    torch.cuda.empty_cache()
    return losses, first_b, updates


MIN_FALL = 0.10  # over 20 steps on the cycle stream; on random tokens the loss fell 0.1%


def test_bf16_parity_llama_1b_shape(llama_1b_folder):
    """notebookkit bf16 vs HF+PEFT bf16 on a stream the adapters can learn. The LoRA gradients and
    updates are compared against an fp32 HF+PEFT run: ours may be at most 3x (plus a small absolute
    allowance) as far from it as the bf16 HF+PEFT run is, the noise floor of bf16 training measured
    in this test. A run whose adapters never update is 1.0 away and does not lose its loss."""
    batches = _batches(4, batch=2, seq=512)
    exact = _train_and_record(_reference(llama_1b_folder, torch.float32), batches)
    ref = _train_and_record(_reference(llama_1b_folder, torch.bfloat16), batches)
    ours_model = _ours(llama_1b_folder, None)  # dtype=None -> bf16 on this GPU
    assert next(p for p in ours_model.parameters()).dtype == torch.bfloat16
    ours = _train_and_record(ours_model, batches)
    (ref_losses, ref_grads, ref_updates), (our_losses, our_grads, our_updates) = ref, ours
    diffs = [abs(a - b) / abs(b) for a, b in zip(our_losses, ref_losses)]
    floor_g = update_difference(ref_grads, exact[1])["rel_err"]
    floor_u = update_difference(ref_updates, exact[2])["rel_err"]
    ours_g = update_difference(our_grads, exact[1])
    ours_u = update_difference(our_updates, exact[2])
    print(f"\n[gpu bf16 parity, Llama-3.2-1B shape, cycle stream] loss fell {loss_drop(ref_losses):.1%} (HF+PEFT), "
          f"{loss_drop(our_losses):.1%} (ours); max rel loss diff {max(diffs):.2e}")
    print(f"  first-step lora_B grads vs fp32: HF bf16 {floor_g:.3e}, ours {ours_g['rel_err']:.3e} "
          f"(worst {ours_g['worst'][0]} {ours_g['worst'][1]:.3e})")
    print(f"  LoRA updates after 20 steps vs fp32: HF bf16 {floor_u:.3e}, ours {ours_u['rel_err']:.3e} "
          f"(cosine {ours_u['cosine']:.4f})")
    print("  fp32:", [round(x, 4) for x in exact[0]])
    print("  ref :", [round(x, 4) for x in ref_losses])
    print("  ours:", [round(x, 4) for x in our_losses])
    assert loss_drop(ref_losses) >= MIN_FALL, "the stream did not teach HF+PEFT: the comparison would mean nothing"
    assert loss_drop(our_losses) >= MIN_FALL and loss_drop(our_losses) >= 0.5 * loss_drop(ref_losses)
    assert max(diffs) < 1e-2
    assert ours_g["rel_err"] <= 3 * floor_g + 1e-3, (ours_g, floor_g)
    assert ours_u["rel_err"] <= 3 * floor_u + 1e-2, (ours_u, floor_u)


def _one_step(model, batch):
    model.train()
    for _ in range(2):  # warm-up (Triton compiles, allocator)
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    model(**batch).loss.backward()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() - base
    model.zero_grad(set_to_none=True)
    return dt, peak


@pytest.mark.parametrize("load_in_4bit", [False, True])
def test_single_step_memory_and_time_vs_hf_peft(llama_1b_folder, load_in_4bit):
    batch = _batches(1, batch=4, seq=1024)[0]
    ref = _reference(llama_1b_folder, torch.bfloat16, load_in_4bit)
    ref.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref.get_base_model().enable_input_require_grads()
    t_ref, m_ref = _one_step(ref, batch)
    del ref
    torch.cuda.empty_cache()
    ours = _ours(llama_1b_folder, torch.bfloat16, load_in_4bit, checkpointing=True)
    t_ours, m_ours = _one_step(ours, batch)
    print(
        f"\n[gpu one step, Llama-3.2-1B shape, bf16{' 4-bit' if load_in_4bit else ''}, LoRA r=16, 4x1024 tokens, "
        f"recompute checkpointing] HF+PEFT {t_ref * 1e3:.1f} ms / {m_ref / 2**30:.2f} GiB peak extra; "
        f"notebookkit {t_ours * 1e3:.1f} ms / {m_ours / 2**30:.2f} GiB peak extra"
    )
    assert m_ours < m_ref  # no [N, 128256] fp32 logits


@pytest.mark.parametrize("load_in_4bit", [False, True])
def test_fp8_forward_loss_and_speed_vs_bf16(llama_1b_folder, load_in_4bit):
    """get_peft_model(fp8_base_matmul=True) tracks the bf16 forward's loss curve over 20 steps (same
    weights, seed, batches) by benchmarks/fp8_quality.py's measure: the gap as a fraction of the FIRST
    loss (a gap relative to the current loss explodes as the loss nears 0: 0.0262 against 0.0228 at
    step 20 is 15% of the loss but 0.03% of the first). One-step time of both printed. A GPU before
    sm_89 must refuse."""
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(ValueError, match="fp8_base_matmul=False"):
            _ours(llama_1b_folder, torch.bfloat16, load_in_4bit, checkpointing=True, fp8=True)
        return
    batches = _batches(4, batch=2, seq=512)
    step_batch = _batches(1, batch=4, seq=1024, seed=1)[0]
    results = {}
    for fp8 in (False, True):
        model = _ours(llama_1b_folder, torch.bfloat16, load_in_4bit, checkpointing=True, fp8=fp8)
        t, m = _one_step(model, step_batch)
        model.zero_grad(set_to_none=True)
        results[fp8] = (*_train_and_record(model, batches), t, m)
        del model
        torch.cuda.empty_cache()
    (l16, g16, u16, t16, m16), (l8, g8, u8, t8, m8) = results[False], results[True]
    gaps = [abs(a - b) / l16[0] for a, b in zip(l8, l16)]
    grads, updates = update_difference(g8, g16), update_difference(u8, u16)
    print(
        f"\n[gpu fp8 forward, Llama-3.2-1B shape, bf16{' 4-bit' if load_in_4bit else ''}, 4x1024 tokens, recompute] "
        f"bf16 {t16 * 1e3:.1f} ms / {m16 / 2**30:.2f} GiB; fp8 {t8 * 1e3:.1f} ms / {m8 / 2**30:.2f} GiB; "
        f"loss fell {loss_drop(l16):.1%} (bf16), {loss_drop(l8):.1%} (fp8); loss gap over 20 steps max {max(gaps):.2%}, "
        f"mean {sum(gaps) / len(gaps):.2%} of the first loss; "
        f"first-step lora_B grads cosine {grads['cosine']:.4f}, LoRA updates cosine {updates['cosine']:.4f} "
        f"(rel {updates['rel_err']:.3f})"
    )
    print("  bf16:", [round(x, 4) for x in l16])
    print("  fp8 :", [round(x, 4) for x in l8])
    assert loss_drop(l16) >= MIN_FALL and loss_drop(l8) >= 0.8 * loss_drop(l16)
    assert max(gaps) <= fp8_quality.MAX_GAP and sum(gaps) / len(gaps) <= fp8_quality.MEAN_GAP, gaps
    # The backward reads activations of the FP8 forward (each product ~3.5% off), and the error grows
    # with depth: measured on the H200 (16 layers) first-step lora_B gradient cosine 0.957 / 0.963
    # (bf16 / NF4 base) and 20-step update cosine 0.908 / 0.917, where the 4-layer model of
    # fp8_quality.py reaches 0.99. An update that never happened (adapters frozen) has cosine 0.
    assert grads["cosine"] >= 0.9 and updates["cosine"] >= 0.8, (grads, updates)


def test_fp8_quality_script_fp8_tracks_16bit():
    """benchmarks/fp8_quality.py's check, small enough for the suite (about a minute): a 4-layer model
    of the 1B shape, trained until the 16-bit loss halves; both curves fall by half and FP8 tracks."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 forward needs compute capability 8.9+")
    settings = fp8_quality.Settings(layers=4, batch=2, seq=512, lr=5e-4, max_steps=300, reseed=False)
    result = fp8_quality.run(settings)
    m = result["metrics"]
    print(f"\n[gpu fp8 quality, 1B shape x 4 layers] {m['steps']} steps, loss {m['first_loss_16']:.3f} -> "
          f"{m['last_loss_16']:.3f} (16-bit) / {m['last_loss_fp8']:.3f} (fp8); gap max {m['max_gap']:.2%}, "
          f"mean {m['mean_gap']:.2%} of the first loss; grad cosine {m['grad_cosine']:.4f}: {result['verdict']}")
    assert result["verdict"] == "pass", result["problems"]


@pytest.mark.parametrize("mode", ["offload", "offload_mlp", "spread"])
def test_offload_matches_recompute_and_saves_memory(llama_1b_folder, mode):
    """offload, and offload_mlp (whose backward takes the MLPs' gate/up outputs back from pinned host memory
    instead of recomputing them): the gradients of recompute, at no more memory. "spread": parked layers between
    kept ones (the planner's layout="spread"), whose backward prefetches each parked layer's copies across the
    kept layer above it: the same gradients."""
    batch = _batches(1, batch=2, seq=1024)[0]
    # fp32: offload must do exactly the arithmetic of recompute; in bf16 the comparison would only
    # measure the run-to-run noise of the attention backward.
    ours = _ours(llama_1b_folder, torch.float32, checkpointing=True)
    ours.train()
    out = ours(**batch)
    out.loss.backward()
    g_rec = {n: p.grad.float().clone() for n, p in ours.named_parameters() if p.requires_grad}
    ours.zero_grad(set_to_none=True)
    t_rec, m_rec = _one_step(ours, batch)
    plan = mode
    if mode == "spread":
        from notebookkit.memory.planner import spread_offloaded

        layers = ours.config.num_hidden_layers
        plan = list(spread_offloaded(("offload_mlp",) * (layers // 2) + ("keep",) * (layers - layers // 2)))
        assert plan[:3] == ["offload_mlp", "keep", "offload_mlp"]
    FastLanguageModel.for_training(ours, use_gradient_checkpointing=plan)
    assert "pinned host memory" in str(ours.notebookkit_banner)
    assert ("gate/up" in str(ours.notebookkit_banner)) == (mode != "offload")
    out = ours(**batch)
    out.loss.backward()
    g_off = {n: p.grad.float().clone() for n, p in ours.named_parameters() if p.requires_grad}
    ours.zero_grad(set_to_none=True)
    t_off, m_off = _one_step(ours, batch)
    worst = max(rel_err(g_off[n], g_rec[n]) for n in g_rec)
    print(f"\n[gpu {mode}] grad rel diff vs recompute {worst:.2e}; recompute {t_rec*1e3:.1f} ms "
          f"{m_rec/2**30:.2f} GiB, {mode} {t_off*1e3:.1f} ms {m_off/2**30:.2f} GiB")
    assert worst < 1e-4  # same arithmetic; only reduction order inside attention may differ
    assert m_off <= m_rec or mode == "spread"  # (its kept layers hold their activations)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
def test_small_model_parity_on_gpu(family, dtype):
    from .helpers import tiny_folder
    from .test_training_parity import make_batches

    folder = tiny_folder(family)
    batches = [{k: v.cuda() for k, v in b.items()} for b in make_batches(4, batch=3, seq=24)]
    ref = _reference(folder, dtype)
    ref_losses = _train(ref, batches, lr=5e-3)
    ours = _ours(folder, dtype)
    our_losses = _train(ours, batches, lr=5e-3)
    diffs = [abs(a - b) / abs(b) for a, b in zip(our_losses, ref_losses)]
    print(f"\n[gpu {family} {dtype}] max rel loss diff {max(diffs):.2e}")
    assert max(diffs) < 1e-2


def test_generation_matches_on_gpu():
    from .helpers import tiny_folder

    model, tok = FastLanguageModel.from_pretrained(tiny_folder("gemma3"), dtype=torch.float32, load_in_4bit=False)
    stock, _ = FastLanguageModel.from_pretrained(tiny_folder("gemma3"), dtype=torch.float32, load_in_4bit=False,
                                                 fast_path=False)
    x = tok(["hello there", "a"], return_tensors="pt", padding=True, padding_side="left").to("cuda")
    kw = dict(max_new_tokens=16, do_sample=False)
    assert torch.equal(model.generate(**x, **kw), stock.generate(**x, **kw))
