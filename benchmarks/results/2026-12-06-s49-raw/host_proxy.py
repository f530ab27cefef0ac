"""Host time of generate(max_new_tokens=1) on a 32-layer, 64-wide llama with LoRA r=16 on every projection (CPU,
fp32): the 8B's module count at no compute, a proxy of the per-call host cost."""
import os, statistics, sys, tempfile, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
folder = "/tmp/host-proxy-llama"
if not os.path.exists(folder):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=32, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(0); LlamaForCausalLM(cfg).save_pretrained(folder)
    import shutil, glob
    for f in glob.glob("/root/.cache/notebookkit/tiny/tiny-llama-2aae6a8e078f/*token*") + glob.glob("/root/.cache/notebookkit/tiny/tiny-llama-2aae6a8e078f/*.model"): shutil.copy(f, folder)
from notebookkit import FastLanguageModel
model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=256, load_in_4bit=False, show_banner=False)
model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"], show_banner=False)
FastLanguageModel.for_inference(model)
ids = torch.randint(3, 1000, (1, 16))
def call(n):
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t
for _ in range(3): call(1)
one = [call(1) for _ in range(15)]
print(f"generate(1) ms: median {statistics.median(one)*1e3:.1f} min {min(one)*1e3:.1f}")
if len(sys.argv) > 1:
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable()
    for _ in range(5): call(1)
    pr.disable(); pstats.Stats(pr).sort_stats(sys.argv[1]).print_stats(28)
