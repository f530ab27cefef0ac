"""Host time of one LoRA training step on a 32-layer, 64-wide llama (CPU, fp32, LoRA r=16 everywhere): the 8B's module
count at no compute, a proxy of the per-step host cost. argv[1]: a pstats sort key to profile 5 steps."""
import os, statistics, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
folder = "/tmp/host-proxy-llama"
if not os.path.exists(folder):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=32, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(0); LlamaForCausalLM(cfg).save_pretrained(folder)
from notebookkit import FastLanguageModel
model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=256, load_in_4bit=os.environ.get("NF4") == "1",
                                             show_banner=False)
model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"],
                                         use_gradient_checkpointing=os.environ.get("CKPT", "unsloth"), show_banner=False)
model.train()
ids = torch.randint(3, 1000, (1, 64))
opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
def step():
    t = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t
for _ in range(3): step()
ts = [step() for _ in range(15)]
print(f"step ms: median {statistics.median(ts)*1e3:.1f} min {min(ts)*1e3:.1f}")
if len(sys.argv) > 1:
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable()
    for _ in range(5): step()
    pr.disable(); pstats.Stats(pr).sort_stats(sys.argv[1]).print_stats(40)
if len(sys.argv) > 2:
    pstats.Stats(pr).print_callers(sys.argv[2])
