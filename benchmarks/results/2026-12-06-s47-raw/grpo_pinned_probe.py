"""Where do GRPO's 3 cudaHostAlloc a step come from? Runs the test's setup for 4 steps with a dispatch mode that
reads torch's num_host_alloc around every aten op and logs the op and its Python callers when it grows."""
import sys, traceback, collections, tempfile, pathlib
sys.path.insert(0, str(next(p for p in pathlib.Path(__file__).resolve().parents if (p / "notebookkit").is_dir())))
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TrainerCallback
from tests.train.test_grpo import _trainer, _model, format_reward
from notebookkit import FastLanguageModel
from notebookkit.models.patching import checkpointing as ckpt

def n_alloc():
    return torch.cuda.host_memory_stats()["num_host_alloc"]

def n_free():
    return torch.cuda.host_memory_stats()["num_host_free"]
KEEP = {"keep": True, "free": False, "auto": None}[sys.argv[1] if len(sys.argv) > 1 else "auto"]

STEP = [0]
events = []

class Watch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = n_alloc()
        out = func(*args, **(kwargs or {}))
        after = n_alloc()
        if after > before:
            frames = [f for f in traceback.extract_stack()[:-1]
                      if any(k in f.filename for k in ("notebookkit", "trl", "transformers/generation", "accelerate", "peft", "torch/utils/data"))]
            events.append((STEP[0], str(func) + f" stream={torch.cuda.current_stream().stream_id} capturing={torch.cuda.is_current_stream_capturing()}", after - before, [f"{pathlib.Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-8:]]))
        return out

model, tok = _model(dtype=torch.bfloat16)
FastLanguageModel.for_training(model, "offload")
base = model.get_base_model()
log = []

class PerStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        pool = ckpt._offload_states[base].get("pool")
        log.append(dict(step=STEP[0], host_alloc=n_alloc(), host_free=n_free(),
                        pool_alloc=getattr(pool, "allocations", None),
                        busy=len(pool._busy) if pool else None, free=len(pool._free) if pool else None,
                        sizes=sorted(b.numel() for b, _ in pool._free) if pool else None))
        STEP[0] += 1

tmp = tempfile.mkdtemp()
trainer = _trainer(pathlib.Path(tmp), [format_reward], model=(model, tok), use_cpu=False, bf16=True, max_steps=4, keep_generation_cache=KEEP)
trainer.add_callback(PerStep())
with Watch():
    trainer.train()
for row in log:
    print("STEP", row)
by = collections.Counter()
for step, func, n, frames in events:
    print(f"ALLOC step={step} +{n} {func}")
    for fr in frames:
        print("      ", fr)
print("total attributed", sum(e[2] for e in events), "final num_host_alloc", n_alloc())
