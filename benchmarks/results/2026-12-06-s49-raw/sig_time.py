import sys, time, torch
sys.path.insert(0, "benchmarks")
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model
from notebookkit.models.generation.state import model_signature
from notebookkit.models.patching.lora_fast_path import views, _build_views
cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256)
with torch.device("meta"):
    m = LlamaForCausalLM(cfg)
m = get_peft_model(m, LoraConfig(r=16, target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]))
m.eval()
causal = m.get_base_model()
print("modules", sum(1 for _ in causal.modules()), "params", sum(1 for _ in causal.parameters()))
for _ in range(2): model_signature(causal)
t=time.perf_counter(); n=10
for _ in range(n): model_signature(causal)
print("model_signature ms", (time.perf_counter()-t)/n*1e3)
t=time.perf_counter()
for _ in range(n): {p.device for p in m.parameters()}
print("devices walk ms", (time.perf_counter()-t)/n*1e3)
layers = causal.model.layers
t=time.perf_counter()
for _ in range(n):
    for L in layers:
        a=L.self_attn; mm=L.mlp
        _build_views((a.q_proj,a.k_proj,a.v_proj), False); _build_views((a.o_proj,), False)
        _build_views((mm.gate_proj,mm.up_proj), False); _build_views((mm.down_proj,), False)
print("views of a forward (4 groups x 32 layers) ms", (time.perf_counter()-t)/n*1e3)
s1 = model_signature(causal); s2 = model_signature(causal)
t=time.perf_counter()
for _ in range(n): s1 == s2
print("compare ms", (time.perf_counter()-t)/n*1e3)
t=time.perf_counter()
for _ in range(n): frozenset(d for *_, d in s1[1])
print("devices from signature ms", (time.perf_counter()-t)/n*1e3)
