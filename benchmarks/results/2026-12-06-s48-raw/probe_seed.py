"""Session 48 probe: why does test_sampling_inside_the_graph_follows_the_seed see two runs of one seed differ?

Runs the test's request several times per variant and prints, for each run, whether it equals run 0 and the
columns where it differs. Run from the repository root: python benchmarks/results/2026-12-06-s48-raw/probe_seed.py
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from tests.models.generation.common import PAD, fast_copy, left_padded_prompts, lora_model  # noqa: E402
from notebookkit.models.generation import generation_state, release  # noqa: E402


def runs(name, n=4, graphs=True, drop=False, dtype=torch.bfloat16, **sampling):
    os.environ["NOTEBOOKKIT_CUDA_GRAPHS"] = "1" if graphs else "0"
    fast = fast_copy(lora_model("llama")).to("cuda", dtype)
    ids, mask = (t.cuda() for t in left_padded_prompts())
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, pad_token_id=PAD, **sampling)
    out = []
    for _ in range(n):
        if drop:
            release(fast)
        torch.manual_seed(1)
        out.append(fast.generate(**kw))
    report = []
    for i, o in enumerate(out):
        if o.shape != out[0].shape:
            report.append(f"run{i}: shape {tuple(o.shape)}")
            continue
        diff = (o != out[0]).nonzero().tolist()
        report.append(f"run{i}: {'same' if not diff else diff[:6]}")
    same_late = all(torch.equal(out[1], o) for o in out[2:])
    print(f"{name:34s} captures={generation_state(fast).runner.captures} runs1..n equal={same_late} | "
          + "; ".join(report), flush=True)


sample = dict(do_sample=True, temperature=0.9, top_p=0.9)
for attempt in range(2):
    runs(f"graphs sample top_p=0.9 #{attempt}", **sample)
runs("graphs sample top_p=1.0", do_sample=True, temperature=0.9, top_p=1.0)
runs("graphs sample top_p=0.9 drop-cache", drop=True, **sample)
runs("eager sample top_p=0.9", graphs=False, **sample)
runs("graphs greedy", do_sample=False)
runs("graphs sample fp16", dtype=torch.float16, **sample)
