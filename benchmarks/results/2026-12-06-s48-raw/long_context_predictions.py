"""Session 48 (CPU): the memory model's prediction for the three 8B QLoRA long-context rows measured in session 23
(benchmarks/results/2026-12-03-NVIDIA-H200-long-context-s23.md), with their plans in the planner's front order.
Run from the repository root: .venv/bin/python benchmarks/results/2026-12-06-s48-raw/long_context_predictions.py"""
from notebookkit.memory.estimate import estimate_training_memory
rows = [(65536, ["offload"] * 21 + ["recompute"] * 10 + ["keep"], 20.58, 21.63),
        (131072, ["offload"] * 30 + ["recompute"] * 2, 21.17, 21.15),
        (262144, ["offload"] * 27 + ["recompute"] * 5, 42.12, 42.19)]
for n, plan, peak, old in rows:
    e = estimate_training_memory("meta-llama/Llama-3.1-8B-Instruct", load_in_4bit=True, seq_len=n, activation_plan=plan)
    p = e.peak_allocated / 2**30
    print(f"{n:>7,} tokens: predicted {p:.2f} GiB (session 23: {old}), measured {peak} GiB: {100 * (p - peak) / peak:+.1f}%")
