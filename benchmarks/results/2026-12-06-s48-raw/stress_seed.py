"""Session 48: does the seeded sampling test flip under a busy GPU? One process: LOOPS times the test's three
seeded runs (seeds 1, 1, 2) on a fresh fast copy of the tiny llama; prints how often runs 0 and 1 differ.
Env picks the variant (NOTEBOOKKIT_CUDA_GRAPHS, CUBLAS_WORKSPACE_CONFIG). With argument 'load': big bf16
matmuls for the given seconds instead (the other workers of the suite). After the calls ran, the two capture
variants were given one shared helper (_capture_only): the same calls in the same order."""
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
if sys.argv[1] == "load":
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.time() + float(sys.argv[2])
    while time.time() < end:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    sys.exit()

from tests.models.generation.common import PAD, fast_copy, left_padded_prompts, lora_model  # noqa: E402
from notebookkit.models.generation import graph_runner  # noqa: E402

VARIANT = os.environ.get("PROBE_VARIANT", "")
original_capture = graph_runner.GraphRunner._capture


def capture_synced(self, step, device, state_tensors):
    """The runner's capture with the device synchronised before and after (a race around it disappears)."""
    torch.cuda.synchronize()
    graph = original_capture(self, step, device, state_tensors)
    torch.cuda.synchronize()
    return graph


def _capture_only(self, step, device):
    """Capture ``step`` on the capture stream into the runner's pool (no warm-up, no wait after it)."""
    if self._pool is None:
        self._pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=self._pool, stream=graph_runner.capture_stream(device),
                          capture_error_mode="thread_local"):
        step()
    self.captures += 1
    return graph


def capture_warm_on_current(self, step, device, state_tensors):
    """The runner's capture with its warm-up on the current stream instead of the capture stream."""
    saved = [t.clone() for t in state_tensors]
    rng = torch.cuda.get_rng_state(device)
    step()
    for tensor, value in zip(state_tensors, saved):
        tensor.copy_(value)
    graph = _capture_only(self, step, device)
    torch.cuda.set_rng_state(rng, device)
    return graph


def capture_no_warmup(self, step, device, state_tensors):
    """The runner's capture without the eager warm-up run."""
    rng = torch.cuda.get_rng_state(device)
    graph = _capture_only(self, step, device)
    torch.cuda.set_rng_state(rng, device)
    return graph


original_run = graph_runner.GraphRunner.run


def run_synced(self, *args):
    original_run(self, *args)
    torch.cuda.synchronize()


if VARIANT == "sync-capture":
    graph_runner.GraphRunner._capture = capture_synced
elif VARIANT == "warm-on-current":
    graph_runner.GraphRunner._capture = capture_warm_on_current
elif VARIANT == "no-warmup":
    graph_runner.GraphRunner._capture = capture_no_warmup
elif VARIANT == "sync-every-step":
    graph_runner.GraphRunner.run = run_synced
GREEDY = VARIANT == "greedy"

loops, tag = int(sys.argv[1]), sys.argv[2]
stock = lora_model("llama")
flips = []
for loop in range(loops):
    fast = fast_copy(stock).to("cuda", torch.bfloat16)
    ids, mask = (t.cuda() for t in left_padded_prompts())
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, pad_token_id=PAD,
              **(dict(do_sample=False) if GREEDY else dict(do_sample=True, temperature=0.9, top_p=0.9)))
    runs = []
    for seed in (1, 1, 1):
        torch.manual_seed(seed)
        runs.append(fast.generate(**kw))
    for i in (1, 2):
        if not torch.equal(runs[0], runs[i]):
            flips.append((loop, i, (runs[0] != runs[i]).nonzero().tolist()[:4]))
print(f"{tag} pid {os.getpid()}: {len(flips)} differing runs of {2 * loops}: {flips[:3]}", flush=True)
