"""CPU tests of the benchmark tools: max_context.py, profile_step.py, run.py, kernels.py,
learning_check.py and fp8_quality.py.

The GPU parts (loading the systems, the timed steps, the profiler run) are run by the lead on the
GPU machine; here: the length search and its probe processes (with a fake child), kernel
categories, report tables, the kernel rows' status and timing method, the learning check of the
training rows, and the FP8 quality script end to end on a tiny model (FP8 emulated on CPU).
"""

from __future__ import annotations

import os
import sys
import types

import pytest

BENCHMARKS = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks")
sys.path.insert(0, os.path.abspath(BENCHMARKS))

import max_context  # noqa: E402
import profile_step  # noqa: E402
from max_context import search_longest  # noqa: E402
from profile_step import categorize  # noqa: E402


# --------------------------------------------------------------------------- search_longest


def fits_up_to(limit: int):
    calls: list[int] = []

    def try_len(length: int) -> bool:
        calls.append(length)
        return length <= limit

    return try_len, calls


def test_search_finds_the_longest_multiple_of_step_with_few_probes():
    try_len, calls = fits_up_to(37000)
    outcome = search_longest(try_len, start=4096, step=1024, max_seq=131072)
    assert outcome.longest == 36864  # 36 * 1024 <= 37000 < 37 * 1024
    assert outcome.reason == "ok"
    assert len(calls) == len(outcome.probes) <= 11
    assert len(set(calls)) == len(calls), "no length is probed twice"
    assert all(length % 1024 == 0 for length in calls)


@pytest.mark.parametrize("limit", [1024, 1500, 4096, 5000, 65535, 65536, 100000, 131071])
def test_search_is_exact_for_any_threshold(limit):
    try_len, calls = fits_up_to(limit)
    outcome = search_longest(try_len, start=4096, step=1024, max_seq=131072)
    assert outcome.longest == (limit // 1024) * 1024
    assert max(calls) <= 131072
    assert len(calls) <= 16


def test_search_respects_max_seq():
    try_len, calls = fits_up_to(10**9)
    outcome = search_longest(try_len, start=4096, step=1024, max_seq=100000)
    assert outcome.longest == 99328  # largest multiple of 1024 <= 100000
    assert outcome.reason == "reached --max-seq"
    assert max(calls) == 99328


def test_search_goes_down_when_the_start_does_not_fit():
    try_len, calls = fits_up_to(3000)
    outcome = search_longest(try_len, start=16384, step=1024, max_seq=131072)
    assert outcome.longest == 2048
    assert calls[:3] == [16384, 8192, 4096]
    assert outcome.reason == "ok"


def test_search_reports_zero_when_nothing_fits():
    try_len, calls = fits_up_to(500)
    outcome = search_longest(try_len, start=4096, step=1024, max_seq=131072)
    assert outcome.longest == 0
    assert outcome.reason == "nothing fits"
    assert calls == [4096, 2048, 1024]


def test_search_stops_at_the_time_budget_with_the_best_so_far():
    try_len, calls = fits_up_to(37000)
    outcome = search_longest(try_len, start=4096, step=1024, max_seq=131072, out_of_time=lambda: len(calls) >= 3)
    assert outcome.reason == "time budget reached"
    assert outcome.longest == 16384
    assert len(calls) == 3


def test_search_starting_from_a_previous_answer():
    try_len, calls = fits_up_to(60000)
    outcome = search_longest(try_len, start=36864, step=1024, max_seq=131072, growth=1.5)
    assert outcome.longest == 59392
    assert calls[0] == 36864


def test_search_rejects_bad_arguments():
    with pytest.raises(ValueError, match="--max-seq"):
        search_longest(lambda n: True, start=4096, step=1024, max_seq=1000)
    with pytest.raises(ValueError, match="--step"):
        search_longest(lambda n: True, start=4096, step=0, max_seq=1000)


def test_out_of_memory_detection():
    OutOfMemoryError = type("OutOfMemoryError", (RuntimeError,), {})
    assert max_context.is_out_of_memory(OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert max_context.is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not max_context.is_out_of_memory(RuntimeError("shape mismatch"))
    assert not max_context.is_out_of_memory(ValueError("out of memory"))


# --------------------------------------------------------------------------- max_context reports and plumbing


ROWS = [
    dict(system="hf", cap_gib=16, max_seq=9216, tok_s=1234.5, peak_gib=15.1, probes=7, processes=3, status="ok",
         gpu="NVIDIA H200", torch="2.11.0"),
    dict(system="liger", cap_gib=16, status="not installed"),
    dict(system="notebookkit", cap_gib=24, max_seq=0, probes=3, status="nothing fits (not even 1024 tokens)"),
]


def test_markdown_table_rows():
    table = max_context.markdown_table(ROWS)
    lines = table.splitlines()
    assert lines[0].startswith("| system | cap GiB | longest seq | predicted (planner) | tokens/s there | peak GiB | probes "
                               "| processes | status |")
    assert "| hf | 16 | 9,216 | – | 1,234 | 15.10 | 7 | 3 | ok |" in table
    assert "| liger | 16 | – | – | – | – | – | – | not installed |" in table
    assert "| notebookkit | 24 | – | – | – | – | 3 | – | nothing fits" in table
    report = max_context.markdown_report(ROWS, dict(shape="llama-3.1-8b", quant="nf4", step=1024, max_seq=131072))
    assert "set_per_process_memory_fraction" in report and "CUDA context" in report and "NVIDIA H200" in report
    assert "No probe runs in a process that has run out of memory" in report


def test_parse_caps():
    assert max_context.parse_caps("24, 16") == [16.0, 24.0]
    with pytest.raises(SystemExit):
        max_context.parse_caps("sixteen")


def _args(**overrides):
    args = max_context.build_parser().parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_missing_package_is_reported_not_dropped(monkeypatch, tmp_path):
    monkeypatch.setattr(max_context, "_available", lambda system: False)
    rows = max_context.rows_for_system("unsloth", _args(caps="16,24"), str(tmp_path))
    assert [(r["cap_gib"], r["status"]) for r in rows] == [(16, "not installed"), (24, "not installed")]


# A fake probe process: the protocol of max_context.child_main, a model that fits up to
# FAKE_LIMIT tokens per 16 GiB of cap, and the failure the real search must never meet: after one
# out-of-memory step, nothing fits in that process any more (a fragmented allocator, half-built
# buffers). It does not exit by itself, so only the parent can keep it from being asked again.
FAKE_CHILD = r"""
import json, os, sys, time
limit, hang_above = int(os.environ["FAKE_LIMIT"]), int(os.environ.get("FAKE_HANG_ABOVE", "0"))
if os.environ.get("FAKE_CRASH"):
    sys.exit("RuntimeError: could not load the model")
print("READY " + json.dumps({"gpu": "Fake GPU", "torch": "0", "load_s": 0.0, "pid": os.getpid()}), flush=True)
poisoned = False
for line in sys.stdin:
    req = json.loads(line)
    if "predict" in req:
        print("PREDICTED " + json.dumps({"cap": req["predict"], "seq": 1234}), flush=True)
        continue
    if hang_above and req["seq"] > hang_above:
        time.sleep(60)
    fits = req["seq"] <= limit * req["cap"] / 16 and not poisoned
    poisoned = poisoned or not fits
    print("PROBE " + json.dumps({"seq": req["seq"], "fits": fits, "s": 0.0, "cap": req["cap"], "pid": os.getpid(),
                                 "tok_s": 100.0, "peak_gib": 1.0}), flush=True)
"""


def _fake_children(monkeypatch, limit, **env):
    monkeypatch.setattr(max_context, "_available", lambda system: True)
    monkeypatch.setattr(max_context, "child_command", lambda system, args: [sys.executable, "-c", FAKE_CHILD])
    monkeypatch.setenv("FAKE_LIMIT", str(limit))
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))


def _probe_lines(out: str) -> list[dict]:
    import json

    return [json.loads(line.split("PROBE ", 1)[1]) for line in out.splitlines() if "] PROBE " in line]


def test_no_probe_runs_in_a_process_that_ran_out_of_memory(monkeypatch, tmp_path, capsys):
    """Every probe after an OOM goes to a fresh process, so the fake child's poisoned state never
    shows: the answers are the true limits (37,000 tokens per 16 GiB), for both caps."""
    _fake_children(monkeypatch, limit=37000)
    rows = max_context.rows_for_system("hf", _args(caps="16,24", step=1024, max_seq=131072), str(tmp_path))
    assert [r["max_seq"] for r in rows] == [36864, 55296]  # floor(37000 / 1024), floor(55500 / 1024) steps
    probes = _probe_lines(capsys.readouterr().out)
    ooms = [p for p in probes if not p["fits"]]
    assert ooms, "the search must have hit the limit"
    for oom in ooms:  # nothing else was asked of a process after its OOM
        later = probes[probes.index(oom) + 1:]
        assert all(p["pid"] != oom["pid"] for p in later)
    assert sum(r["processes"] for r in rows) == 1 + len(ooms) - (0 if probes[-1]["fits"] else 1)
    assert rows[0]["gpu"] == "Fake GPU" and rows[0]["tok_s"] == 100.0
    assert rows[0]["status"] == "ok" and "max-context-hf.log" in os.listdir(tmp_path)


def test_notebookkit_rows_ask_the_child_for_the_planner_prediction(monkeypatch, tmp_path):
    _fake_children(monkeypatch, limit=20000)
    rows = max_context.rows_for_system("notebookkit", _args(caps="16", step=1024), str(tmp_path))
    assert rows[0]["max_seq"] == 19456 and rows[0]["predicted_seq"] == 1234


def test_missing_caps_when_the_child_cannot_load(monkeypatch, tmp_path):
    _fake_children(monkeypatch, limit=1, FAKE_CRASH=1)
    rows = max_context.rows_for_system("hf", _args(caps="16,24"), str(tmp_path))
    assert [r["cap_gib"] for r in rows] == [16, 24]
    assert all(r["status"].startswith("failed") and "could not load the model" in r["status"] for r in rows)
    assert "max_seq" not in rows[0] and rows[0]["processes"] == 1


def test_child_timeout_is_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(max_context, "_available", lambda system: True)
    monkeypatch.setattr(max_context, "child_command",
                        lambda system, args: [sys.executable, "-c", "import time; time.sleep(30)"])
    rows = max_context.rows_for_system("hf", _args(caps="16", timeout=1), str(tmp_path))
    assert rows[0]["status"].startswith("timed out")


def test_a_search_cut_short_reports_its_lower_bound(monkeypatch, tmp_path):
    """A probe that hangs (killed at --timeout) ends the cap's search with the longest length that fitted."""
    _fake_children(monkeypatch, limit=100000, FAKE_HANG_ABOVE=20000)
    rows = max_context.rows_for_system("unsloth", _args(caps="16", step=1024, start=4096, timeout=2), str(tmp_path))
    assert rows[0]["status"].startswith("timed out") and rows[0]["at_least"] == 16384
    assert "| unsloth | 16 | ≥ 16,384 (cut short) | – |" in max_context.markdown_table(rows)


def test_child_command_names_the_system_and_the_model():
    cmd = max_context.child_command("unsloth", _args(shape="llama-3.1-8b", quant="nf4", step=512, max_seq=65536))
    joined = " ".join(cmd)
    assert "--child --system unsloth" in joined and "--shape llama-3.1-8b --quant nf4" in joined
    assert "--step 512" in joined and "--max-seq 65536" in joined


# --------------------------------------------------------------------------- profile_step categories and tables


@pytest.mark.parametrize("name, category", [
    ("nvjet_tst_192x192_64x4_1x2_h_bz_coopB_TNT", "GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas", "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(Params)", "GEMM"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "GEMM"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>(...)", "GEMM"),
    ("flash_fwd_kernel", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128>>(Flash_bwd_params)", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    ("_rms_norm_bwd_kernel", "triton rms_norm"),
    ("_rms_norm_fwd_kernel", "triton rms_norm"),
    ("_rms_layernorm_backward", "triton rms_norm"),
    ("_rope_kernel", "triton rope"),
    ("_swiglu_fwd_kernel", "triton swiglu"),
    ("_geglu_bwd_kernel", "triton geglu"),
    ("_nf4_dequant_kernel", "triton nf4 dequant"),
    ("_cross_entropy_kernel", "triton cross_entropy"),
    ("liger_cross_entropy_kernel", "triton cross_entropy"),
    ("_lora_qkv_bwd_kernel", "triton lora"),
    ("Memcpy HtoD (Pinned -> Device)", "memcpy HtoD"),
    ("Memcpy DtoH (Device -> Pinned)", "memcpy DtoH"),
    ("Memcpy DtoD (Device -> Device)", "memcpy DtoD"),
    ("Memset (Device)", "memset"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, 1, true>>(...)",
     "optimizer (AdamW)"),
    ("kDequantizeBlockwise", "bitsandbytes"),
    ("void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, unsigned char*, float*, __nv_bfloat16*, int, int)",
     "bitsandbytes"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
     "std::array<char*, 3ul>>(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)",
     "elementwise / reduction"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>(...)",
     "elementwise / reduction"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, c10::BFloat16, float>(...)", "torch log_softmax / nll"),
    ("triton_poi_fused_add_mul_0", "inductor (torch.compile)"),
    ("some_vendor_kernel(int)", "other"),
])
def test_categorize(name, category):
    assert categorize(name) == category


def test_categorize_never_raises():
    assert categorize(None) == "other"
    assert categorize(12345) == "other"
    assert categorize("") == "other"
    assert categorize("_some_future_triton_kernel") == "other Triton-style name"


KERNELS = [
    ("nvjet_tst_192x192_64x4_1x2_h_bz_coopB_TNT", 6000.0, 300),
    ("flash_fwd_kernel", 2000.0, 32),
    ("_rms_norm_fwd_kernel", 500.0, 65),
    ("Memcpy HtoD (Pinned -> Device)", 1000.0, 31),
    ("nvjet_tst_192x192_64x4_1x2_h_bz_coopB_TNT", 500.0, 20),
]


def test_category_table_shares_and_merging():
    rows = profile_step.category_table(KERNELS)
    by = {r["category"]: r for r in rows}
    assert rows[0]["category"] == "GEMM"
    assert by["GEMM"]["ms"] == pytest.approx(6.5) and by["GEMM"]["count"] == 320
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert by["memcpy HtoD"]["share"] == pytest.approx(1000 / 10000)
    assert profile_step.category_table([]) == []


def test_busy_time_is_the_union_of_intervals():
    assert profile_step.busy_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert profile_step.busy_us([]) == 0


def test_render_report_contents():
    text = profile_step.render_report("One step", [("GPU", "test")], wall_ms=12.0, busy_ms=9.0, kernels=KERNELS)
    assert "wall time of the profiled step(s): 12.0 ms" in text
    assert "idle gaps" not in text  # no gap split without launch records
    assert "GPU time (sum of kernel and copy durations): 10.0 ms" in text
    assert "idle: 3.0 ms = 25.0% of the wall time" in text
    assert "| GEMM | 6.50 | 65.0% | 320 |" in text
    assert "| 1 | `nvjet_tst_192x192_64x4_1x2_h_bz_coopB_TNT` | GEMM | 6.50 | 320 | 65.0% |" in text
    assert text.count("\n| 4 |") == 1 and "\n| 5 |" not in text  # four distinct kernels


def test_idle_gaps_tell_waiting_for_the_host_from_queued_work():
    # Chrome-trace events: kernels (device) and the host calls that launched them, tied by "correlation".
    def kernel(ts, dur, corr, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": f"k{corr}", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def launch(ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 3, "args": {"correlation": corr}}

    trace = [
        launch(0, 1), kernel(5, 100, 1),               # busy 5..105
        launch(20, 2), kernel(105, 50, 2, "gpu_memcpy"),  # queued long before: starts right away, busy to 155
        launch(300, 3), kernel(305, 40, 3),            # launched after the GPU ran dry at 155: 150 us waiting for the host
        launch(310, 4), kernel(400, 10, 4),            # queued at 310, yet idle 345..400: a stream / event wait (55 us)
        kernel(402, 1, 5),                             # a 2 us gap: below the threshold
        {"ph": "i", "cat": "kernel", "ts": 500},       # not a complete event: ignored
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
    ]
    device, launches = profile_step.trace_device_and_launches(trace)
    assert len(device) == 5 and launches == {1: 0.0, 2: 20.0, 3: 300.0, 4: 310.0}
    gaps = profile_step.idle_gaps(device, launches)
    assert gaps == dict(host_wait_ms=0.150, host_gaps=1, other_idle_ms=0.055, other_gaps=1)
    # a launch just before the GPU ran dry still counts as the host's (kernels start some us after launch)
    gaps = profile_step.idle_gaps([(0, 10, 1), (40, 50, 2)], {1: 0.0, 2: 5.0})
    assert gaps["host_gaps"] == 1 and gaps["host_wait_ms"] == 0.030
    text = profile_step.render_report("t", [], 1.0, 0.5, [("k", 1.0, 1)], gaps=gaps)
    assert "0.0 ms in 1 gaps waiting for the host" in text and "CUDA's API" not in text
    # the host's time in CUDA's API by call: four 3 us launches, and a copy to the host that waited 900 us
    api = profile_step.host_api_calls(trace + [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 600, "dur": 900, "args": {}}])
    assert api == [dict(name="cudaMemcpyAsync", calls=1, ms=0.9, max_ms=0.9),
                   dict(name="cudaLaunchKernel", calls=4, ms=0.012, max_ms=0.003)]
    text = profile_step.render_report("t", [], 2.0, 0.5, [("k", 1.0, 1)], api=api)
    assert "Host time inside CUDA's API: 0.9 ms of the 2.0 ms wall time" in text
    assert "| `cudaMemcpyAsync` | 1 | 0.90 | 0.90 |" in text and "| `cudaLaunchKernel` | 4 | 0.01 | 0.00 |" in text


def test_a_report_straight_from_a_traces_events():
    # rl_step's profile of a GRPO step's training half: a window of a Chrome trace, no profiler object
    def ev(cat, ts, dur, corr=None, name="k"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    trace = [ev("cpu_op", 1000, 500, name="aten::mm"),
             ev("cuda_runtime", 1100, 5, 2, "cudaLaunchKernel"), ev("kernel", 1105, 100, 2, "nvjet_fwd"),
             ev("cuda_runtime", 1400, 5, 3, "cudaLaunchKernel"), ev("kernel", 1405, 50, 3, "nvjet_bwd"),
             ev("gpu_memcpy", 1460, 10, 4, "Memcpy DtoH (Device -> Pinned)")]
    assert profile_step.trace_kernels(trace) == [("nvjet_fwd", 100.0, 1), ("nvjet_bwd", 50.0, 1),
                                                 ("Memcpy DtoH (Device -> Pinned)", 10.0, 1)]
    text = profile_step.trace_report("rest", [], trace, 0.5)
    # 160 us busy of 500; the GPU waited 200 us for the host's second launch (idle 1205 -> 1405, launched at 1400)
    assert "GPU busy (union over streams): 0.2 ms; idle: 0.3 ms" in text and "0.2 ms in 1 gaps waiting" in text
    assert "| `cudaLaunchKernel` | 2 | 0.01 |" in text and "| GEMM | 0.15 |" in text


def test_several_profiled_steps_get_their_own_report_name():
    args = types.SimpleNamespace(system="notebookkit", checkpointing="offload", max_memory=None, fp8=True, steps=5)
    assert profile_step.default_tag(args) == "gc-offload-fp8-5steps"
    args.steps = 1
    assert profile_step.default_tag(args) == "gc-offload-fp8"


def test_trace_facts_reads_a_real_profiler_trace():
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    # CPU only: no device work, no launches, no gap split, no copies
    assert profile_step.trace_facts(prof) == (None, {}, [])


def test_host_link_rates_per_direction_from_the_copies_of_a_trace():
    def copy(name, mib, dur_us, cat="gpu_memcpy"):
        return {"ph": "X", "cat": cat, "name": name, "ts": 0, "dur": dur_us, "args": {"bytes": mib << 20}}

    trace = [copy("Memcpy DtoH (Device -> Pinned)", 200, 4000), copy("Memcpy DtoH (Device -> Pinned)", 200, 8000),
             copy("Memcpy DtoH (Device -> Pinned)", 200, 4100), copy("Memcpy HtoD (Pinned -> Device)", 32, 640),
             copy("Memcpy HtoD (Pinned -> Device)", 0, 5),                 # under 1 MiB: left out
             copy("Memcpy DtoD (Device -> Device)", 64, 10),               # not the host link
             copy("void kernel", 64, 10, cat="kernel")]
    rates = profile_step.host_link_rates(trace)
    assert set(rates) == {"DtoH", "HtoD"}
    d2h = rates["DtoH"]
    assert d2h["copies"] == 3 and abs(d2h["gb"] - 3 * 200 * 2**20 / 1e9) < 1e-9 and d2h["ms"] == 16.1
    assert round(d2h["p10"], 1) == 26.2 and round(d2h["median"], 1) == 51.2 and round(d2h["p90"], 1) == 52.4
    assert rates["HtoD"]["copies"] == 1 and round(rates["HtoD"]["median"], 1) == 52.4


def test_render_report_escapes_long_and_piped_names():
    long_name = "void f<" + "x" * 300 + "|y>(int)"
    text = profile_step.render_report("t", [], 1.0, 1.0, [(long_name, 1.0, 1)])
    row = [line for line in text.splitlines() if line.startswith("| 1 |")][0]
    assert "…" in row and len(row) < 250


def test_device_kernels_from_fake_profiler_events():
    cuda = types.SimpleNamespace(name="CUDA")
    cpu = types.SimpleNamespace(name="CPU")
    span = lambda a, b: types.SimpleNamespace(start=a, end=b)  # noqa: E731
    events = [
        types.SimpleNamespace(name="aten::mm", device_type=cpu, time_range=span(0, 50), is_user_annotation=False),
        types.SimpleNamespace(name="nvjet_x", device_type=cuda, time_range=span(0, 10), is_user_annotation=False),
        types.SimpleNamespace(name="nvjet_x", device_type=cuda, time_range=span(12, 20), is_user_annotation=False),
        types.SimpleNamespace(name="ProfilerStep#1", device_type=cuda, time_range=span(0, 99), is_user_annotation=True),
        types.SimpleNamespace(name="Memcpy HtoD (Pinned -> Device)", device_type=cuda, time_range=span(5, 25),
                              is_user_annotation=False),
        types.SimpleNamespace(name="Event Sync", device_type=cuda, time_range=span(0, 90), is_user_annotation=False),
        types.SimpleNamespace(name="old_style", device_type=cuda, cuda_time_total=7),
    ]
    kernels, intervals = profile_step.device_kernels(events)
    assert ("nvjet_x", 18.0, 2) in kernels
    assert ("Memcpy HtoD (Pinned -> Device)", 20.0, 1) in kernels
    assert ("old_style", 7.0, 1) in kernels
    assert len(kernels) == 3
    assert profile_step.busy_us(intervals) == 25
    # the copy alone ran from 20 to 25: the compute was busy 18 of the 25
    assert profile_step.busy_us(profile_step.compute_intervals(events)) == 18
    text = profile_step.render_report("t", [], 30.0, 25.0, kernels, compute_busy_ms=18.0)
    assert "compute busy (kernels and memsets, copies left out): 18.0 ms; only copies ran for 7.0 ms" in text


def test_report_name():
    assert profile_step.report_name("llama-3.1-8b", "nf4", 4096, 2, "notebookkit") == \
        "profile-llama-3.1-8b-nf4-4096x2-notebookkit.md"
    assert profile_step.report_name("llama-3.1-8b", "nf4", 4096, 2, "hf", "cap-8GiB").endswith("-hf-cap-8GiB.md")


def test_notebookkit_replan_falls_back_to_full_offload_when_the_planner_refuses(monkeypatch):
    """A length the planner predicts will not fit is still tried, fully offloaded: the step decides."""
    import notebookkit.models.patching.checkpointing as checkpointing
    from notebookkit.memory.planner import DoesNotFitError

    calls = []

    def fake_apply(model, value, banner=None, seq_len=None, batch_size=None, max_memory=None):
        calls.append((value, seq_len, max_memory))
        if value == "auto" and seq_len > 50_000:
            raise DoesNotFitError("does not fit")
        return value

    monkeypatch.setattr(checkpointing, "apply_checkpointing", fake_apply)
    replan = max_context._replanner(object(), 16.0)
    replan(8192)
    replan(65536)
    assert calls == [("auto", 8192, "16GiB"), ("auto", 65536, "16GiB"), ("offload", None, None)]


def test_markdown_table_shows_the_planner_prediction():
    row = dict(system="notebookkit", cap_gib=16, max_seq=51200, predicted_seq=47616, tok_s=4321.0, peak_gib=15.2,
               probes=9, processes=4, status="ok (plan: 32 offload)")
    assert "| notebookkit | 16 | 51,200 | 47,616 | 4,321 | 15.20 | 9 | 4 | ok (plan: 32 offload) |" in \
        max_context.markdown_table([row])


def test_first_row_of_a_compiling_system_gets_extra_time(monkeypatch, tmp_path):
    """Unsloth's first import compiles for over a minute: only its first row gets the grace."""
    import run

    seen = []
    monkeypatch.setattr(run, "run_row", lambda c, s, steps, timeout, extra, lora_b_path=None:
                        seen.append((c, s, timeout)) or dict(config=c, system=s, status="ok"))
    monkeypatch.setattr(run, "write_results", lambda rows, stem: "table")
    monkeypatch.setattr(sys, "argv", ["run.py", "--out", str(tmp_path), "--only", "8b-nf4-4096x2,1b-bf16-2048x8",
                                      "--systems", "unsloth,hf", "--timeout", "50"])
    run.main()
    grace = run.FIRST_ROW_GRACE_S["unsloth"]
    assert seen == [("8b-nf4-4096x2", "unsloth", 50 + grace), ("8b-nf4-4096x2", "hf", 50),
                    ("1b-bf16-2048x8", "unsloth", 50), ("1b-bf16-2048x8", "hf", 50)]


def test_repeated_rows_run_in_rounds_and_show_their_median_process(monkeypatch, tmp_path):
    import run

    seen, tables = [], []
    step = {"unsloth": [0.42, 0.41, 0.43], "notebookkit-spread": [0.31, 0.36, 0.30]}  # s a step, rounds 1-3

    def row(c, s, steps, timeout, extra, lora_b_path=None):
        seen.append((s, lora_b_path is not None))
        i = sum(1 for x, _ in seen if x == s) - 1
        return _train_row(s, LEARNED, config=c, tok_s=4096 / step[s][i]) | dict(s_step=step[s][i])

    monkeypatch.setattr(run, "run_row", row)
    monkeypatch.setattr(run, "compare_lora_with_hf", lambda rows, paths: None)
    monkeypatch.setattr(run, "write_results", lambda rows, stem: tables.append(run.markdown(rows)) or "table")
    monkeypatch.setattr(sys, "argv", ["run.py", "--out", str(tmp_path), "--only", "8b-nf4-4096x1-t4",
                                      "--systems", "unsloth,notebookkit-spread", "--repeats", "3"])
    run.main()
    # every system once a round; only the first round saves its adapters for the comparison with hf's
    assert seen == [("unsloth", True), ("notebookkit-spread", True)] + [("unsloth", False), ("notebookkit-spread", False)] * 2
    table = tables[-1]
    assert table.count("| notebookkit-spread |") == 1 and "| 8b-nf4-4096x1-t4 | notebookkit-spread | 13,213 |" in table
    assert "8b-nf4-4096x1-t4: Each process's median step (s), in run order: unsloth 0.420, 0.410, 0.430; " \
           "notebookkit-spread 0.310, 0.360, 0.300." in table
    assert "notebookkit-spread × unsloth, round by round: 1.35, 1.14, 1.43 (median 1.35)." in table


def test_system_names_resolve_to_train_step_arguments():
    import run

    assert run.resolve_system("notebookkit") == ("notebookkit", [])
    assert run.resolve_system("notebookkit-fp8-offload") == ("notebookkit", ["--fp8", "--checkpointing", "offload"])
    assert run.resolve_system("notebookkit-10GiB") == ("notebookkit", ["--max-memory", "10GiB"])
    assert run.resolve_system("notebookkit-fp8-4.79GiB") == ("notebookkit", ["--fp8", "--max-memory", "4.79GiB"])
    assert run.resolve_system("notebookkit-spread-14GiB") == ("notebookkit", ["--spread", "--max-memory", "14GiB"])
    assert run.resolve_system("notebookkit-lean-7GiB") == ("notebookkit", ["--offload-embedding", "--max-memory", "7GiB"])
    assert run.resolve_system("unsloth") == ("unsloth", [])
    assert run.resolve_system("notebookkit-spread+nogc") == ("notebookkit", ["--spread", "--no-gc"])
    assert run.resolve_system("unsloth+nogc") == ("unsloth", ["--no-gc"])
    assert run.resolve_system("notebookkit-16GiB+expandable") == (
        "notebookkit", ["--max-memory", "16GiB", "--expandable-segments"])


def test_a_failed_row_reports_the_head_of_its_error_message():
    import run

    output = ("loading...\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
              "notebookkit.memory.planner.DoesNotFitError: notebookkit: llama does not fit in 4.79 GiB "
              + "(details) " * 40 + "\n  fixes: load_in_4bit=True\n")
    reason = run.failure_reason(output)
    assert reason.startswith("notebookkit.memory.planner.DoesNotFitError: notebookkit: llama does not fit in 4.79 GiB")
    assert len(reason) <= 300 and reason.endswith("…")
    assert run.failure_reason("a\nb\nc\nd") == "b | c | d"  # no exception line: the last three lines


def test_train_table_shows_the_median_step_and_ratios_of_the_window_throughput():
    import run

    base = dict(config="1b-bf16-2048x8", peak_gib=4.0, loss_first=12.0, loss_last=11.9, status="ok")
    rows = [base | dict(system="unsloth", tok_s=50_000.0, s_step=0.328, tok_s_median=52_000.0),
            base | dict(system="notebookkit", tok_s=60_000.0, s_step=0.273, tok_s_median=61_234.0, predicted_gib=3.9,
                        plan="16 offload"),
            base | dict(system="hf", tok_s=25_000.0, s_step=0.655),  # a row from before the median was recorded
            dict(config="1b-bf16-2048x8", system="compile", status="timed out after 300s")]
    lines = run.markdown(rows).splitlines()
    assert lines[0].count("|") == lines[1].count("|") == 15
    nk = next(ln for ln in lines if "| notebookkit |" in ln)
    assert "| 60,000 | 61,234 | 2.40 | 1.20 | 4.00 | 3.9 | 16 offload |" in nk
    assert "| 25,000 | – | 1.00 |" in next(ln for ln in lines if "| hf |" in ln)
    assert "– (random tokens: nothing to learn) | ok |" in nk  # rows of record before the learnable stream
    assert all(ln.count("|") == 15 for ln in lines)
    assert run.NF4_HF_NOTE not in run.markdown(rows)  # no NF4 row, no note


def test_gpu_sampler_summarises_clocks_power_and_throttle_reasons():
    import threading

    import gpu_monitor

    readings = iter([(1980.0, 450.0, 50.0, 0x0), (1755.0, 699.0, 61.0, 0x4), (1830.0, 690.0, 63.0, 0x4 | 0x20)])
    done = threading.Event()

    def read():
        try:
            return next(readings)
        except StopIteration:
            done.set()
            raise  # a failed read ends the sampling thread, not the benchmark

    with gpu_monitor.GpuSampler(read, interval_s=0.001) as sampler:
        assert done.wait(5.0)
    summary = sampler.summary()
    assert summary["samples"] == 3
    assert (summary["sm_mhz_min"], summary["sm_mhz_median"], summary["sm_mhz_max"]) == (1755.0, 1830.0, 1980.0)
    assert (summary["power_w_median"], summary["power_w_max"], summary["temp_c_max"]) == (690.0, 699.0, 63.0)
    assert summary["throttle"] == {"software power cap": 0.667, "software thermal slowdown": 0.333}
    assert gpu_monitor.throttle_names(0x4 | 0x1000) == ["software power cap", "0x1000"]


def test_gpu_sampler_without_nvml_records_nothing():
    import gpu_monitor

    inert = gpu_monitor.GpuSampler(None)
    with inert:
        pass
    assert inert.summary() == {}
    # on this CPU machine for_device finds no GPU (or no pynvml) and must not raise
    assert gpu_monitor.GpuSampler.for_device(0).summary() == {}


# --------------------------------------------------------------------------- run.py: the learning check


def _train_row(system, losses, quant="bf16", **extra):
    row = dict(config="1b-bf16-2048x8", system=system, quant=quant, tok_s=1000.0, peak_gib=4.0, status="ok",
               losses=losses, loss_first=losses[0], loss_last=losses[-1], token_stream="cycle of 32 ids") | extra
    return row | dict(s_step=16384 / row["tok_s"])  # a timed step of 2048 x 8 tokens


LEARNED = [12.2, 11.9, 11.3, 10.6, 9.9, 9.2]  # the shape of a 6-step run on the cycle stream


@pytest.mark.parametrize("case, losses, lora, verdict", [
    ("learned like hf", [12.2, 11.9, 11.31, 10.62, 9.93, 9.25], dict(rel_err=0.08, cosine=0.997), "pass"),
    ("adapters never updated", [12.2] * 6, dict(rel_err=1.0, cosine=0.0), "FAIL"),
    ("learned half as fast", [12.2, 12.0, 11.8, 11.6, 11.4, 11.2], dict(rel_err=0.4, cosine=0.9), "FAIL"),
    ("other adapters", LEARNED, dict(rel_err=1.41, cosine=0.0, same_init=False), "FAIL"),
    ("NaN loss", [12.2, 11.9, float("nan"), 10.6, 9.9, float("nan")], dict(rel_err=0.08, cosine=0.99), "FAIL"),
])
def test_learning_verdict(case, losses, lora, verdict):
    import run

    hf = _train_row("hf", LEARNED)
    row = _train_row("notebookkit", losses, lora_b_vs_hf=lora)
    got = run.learning_verdict(row, hf)
    assert got.startswith(verdict), (case, got)
    assert run.learning_verdict(hf, hf) == "pass"
    if case == "adapters never updated":
        assert "loss fell 0.00%" in got and "last loss 32.61% from hf's" in got and "lora_B 1.00" in got
    if case == "other adapters":
        assert "other LoRA A init" in got


def test_fp8_rows_get_a_wider_final_loss_band_and_nf4_ratios_a_note():
    import run

    hf = _train_row("hf", LEARNED, quant="nf4")
    off_by_1_5 = LEARNED[:-1] + [LEARNED[-1] * 1.015]
    assert run.learning_verdict(_train_row("notebookkit-fp8-offload", off_by_1_5, quant="nf4"), hf) == "pass"
    assert run.learning_verdict(_train_row("notebookkit-offload", off_by_1_5, quant="nf4"), hf).startswith("FAIL")
    rows = [hf | dict(config="8b-nf4-4096x2"), _train_row("notebookkit", LEARNED, quant="nf4", config="8b-nf4-4096x2",
                                                           tok_s=3000.0)]
    table = run.markdown(rows)
    assert "| 3.00† |" in table and run.NF4_HF_NOTE in table and "prepare_model_for_kbit_training" in table


def test_lora_b_of_each_row_is_compared_with_hf(tmp_path):
    import run
    import torch

    gen = torch.Generator().manual_seed(0)
    update = {f"layers.{i}.q_proj.lora_B.default.weight": torch.randn(64, 16, generator=gen) for i in range(3)}
    noisy = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in update.items()}
    never = {k: torch.zeros_like(v) for k, v in update.items()}
    paths = {}
    for name, tensors in (("hf", update), ("notebookkit", noisy), ("liger", never)):
        paths[name] = str(tmp_path / f"{name}.pt")
        torch.save(tensors, paths[name])
    rows = [_train_row(s, LEARNED, lora_a_init_sum=1.25) for s in ("hf", "notebookkit", "liger")]
    rows.append(_train_row("unsloth", LEARNED, lora_a_init_sum=3.5))
    paths["unsloth"] = paths["notebookkit"]
    run.compare_lora_with_hf(rows, paths)
    hf, nk, liger, unsloth = rows
    assert "lora_b_vs_hf" not in hf
    assert 0.03 < nk["lora_b_vs_hf"]["rel_err"] < 0.08 and nk["lora_b_vs_hf"]["same_init"]
    assert liger["lora_b_vs_hf"]["rel_err"] == 1.0 and liger["lora_b_vs_hf"]["cosine"] == 0.0
    assert unsloth["lora_b_vs_hf"]["same_init"] is False
    assert run.learning_verdict(liger, hf).startswith("FAIL") and "lora_B 1.00" in run.learning_verdict(liger, hf)
    assert run.learning_verdict(nk, hf) == "pass"


# --------------------------------------------------------------------------- learning_check


def test_cycle_stream_walks_one_fixed_cycle():
    from learning_check import cycle_order, cycle_stream

    order = cycle_order(128256, symbols=32, seed=0)
    assert len(set(order.tolist())) == 32 and order.min() >= 3 and order.max() < 128256
    batches = cycle_stream(3, batch=4, seq=100, vocab=128256, symbols=32, seed=0)
    successor = {int(a): int(b) for a, b in zip(order, order.roll(-1))}
    for ids in batches:
        assert ids.shape == (4, 100) and set(ids.unique().tolist()) == set(order.tolist())
        assert all(successor[int(a)] == int(b) for row in ids for a, b in zip(row[:-1], row[1:]))
    again = cycle_stream(3, batch=4, seq=100, vocab=128256, symbols=32, seed=0)
    assert all(torch_equal(a, b) for a, b in zip(batches, again))  # every system sees the same batches
    assert not torch_equal(batches[0], batches[1])  # rows start elsewhere from batch to batch
    with pytest.raises(ValueError, match="symbols"):
        cycle_order(10, symbols=20)


def torch_equal(a, b):
    import torch

    return torch.equal(a, b)


def test_update_difference():
    import math

    import torch
    from learning_check import loss_drop, lora_updates, update_difference

    gen = torch.Generator().manual_seed(1)
    ref = {"a": torch.randn(8, 4, generator=gen), "b": torch.randn(3, 4, generator=gen)}
    assert update_difference(ref, ref)["rel_err"] == 0.0
    frozen = update_difference({k: torch.zeros_like(v) for k, v in ref.items()}, ref)
    assert frozen["rel_err"] == 1.0 and frozen["cosine"] == 0.0
    off = dict(ref, b=ref["b"] * 3)
    assert update_difference(off, ref)["worst"][0] == "b"
    poisoned = dict(ref, a=ref["a"].clone())
    poisoned["a"][0, 0] = float("nan")
    bad = update_difference(poisoned, ref)
    assert bad["rel_err"] == math.inf and math.isnan(bad["cosine"])
    with pytest.raises(ValueError, match="did not move"):
        update_difference(ref, {k: torch.zeros_like(v) for k, v in ref.items()})
    assert torch.allclose(lora_updates(ref, off)["b"], 2 * ref["b"]) and not lora_updates(ref, off)["a"].any()
    assert loss_drop([10.0, 9.0, 5.0]) == 0.5 and loss_drop([4.0, 4.0, 2.0, 2.0], window=2) == 0.5


# --------------------------------------------------------------------------- kernels.py: status and timing method


def test_a_nan_or_large_error_is_wrong_not_ok():
    import math

    import kernels
    import torch

    assert kernels.error_status(3e-3, torch.bfloat16) == "ok"
    assert kernels.error_status(0.0, torch.float32) == "ok"
    assert kernels.error_status(math.nan, torch.bfloat16).startswith("wrong") and "nan" in \
        kernels.error_status(math.nan, torch.bfloat16)
    assert kernels.error_status(5e-2, torch.bfloat16).startswith("wrong: rel err 5.0e-02")
    assert kernels.error_status(2e-5, torch.float32).startswith("wrong")
    assert math.isnan(kernels._rel_err(torch.tensor([1.0, float("inf")]), torch.tensor([1.0, 2.0])))


def _fake_op(inject_nan: bool):
    import kernels
    import torch

    def build(tokens, dtype, device):
        x = torch.randn(tokens, 64, dtype=dtype, requires_grad=True)

        def ours(x):
            y = x * 2.0
            return y.masked_fill(torch.arange(y.numel()).view_as(y) == 7, float("nan")) if inject_nan else y

        return kernels.Case([x], [torch.ones(tokens, 64, dtype=dtype)], {"notebookkit": ours, "eager": lambda x: x * 2.0},
                            bytes_fwd=1, bytes_fwdbwd=1, shape=f"[{tokens}, 64]")

    return kernels.BenchOp("fake", "math", build)


@pytest.mark.parametrize("inject_nan", [False, True], ids=["correct", "nan-injected"])
def test_kernel_rows_fail_on_nan_and_record_how_they_were_timed(inject_nan, monkeypatch):
    import kernels
    import torch
    import triton.testing

    def no_graph(fn, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", no_graph)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 0.5)[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(kernels, "_peak_mib", lambda fn: 0.0)
    rows = {r["impl"]: r for r in kernels.run_op(_fake_op(inject_nan), 16, torch.float32, 1000.0, use_compile=False)}
    ours, eager = rows["notebookkit"], rows["eager"]
    assert eager["status"] == "ok"
    assert ours["status"] == ("wrong: rel err nan vs eager (non-finite output or error)" if inject_nan else "ok")
    assert ("speedup_fwd" in ours) is (not inject_nan)
    assert ours["fwd_timing"] == ours["fwdbwd_timing"] == "do_bench (RuntimeError: operation not permitted when stream is capturing)"
    meta = dict(gpu="test", date="today", torch="x", triton="y", cuda="z", dtype="fp32", tokens=16, copy_gbps=1000.0)
    line = next(ln for ln in kernels.markdown(meta, list(rows.values())).splitlines() if "| notebookkit |" in ln)
    assert ("| nan | do_bench / do_bench | wrong" if inject_nan else "| do_bench / do_bench | ok |") in line


def test_graph_replay_is_recorded(monkeypatch):
    import kernels
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: 0.25)
    assert kernels._bench(lambda: None) == (0.25, "cuda graph")
    assert kernels._timing_cell(dict(fwd_timing="cuda graph", fwdbwd_timing="do_bench (x)")) == "graph / do_bench"
    assert kernels._timing_cell(dict(fwd_timing="cuda graph")) == "graph"


# --------------------------------------------------------------------------- fp8_quality.py on a tiny model (CPU)


@pytest.fixture
def tiny_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTEBOOKKIT_BENCH_CKPT", str(tmp_path / "ckpt"))
    return tmp_path


def test_fp8_quality_tiny_run_passes_and_writes_its_report(tiny_checkpoints):
    """The script end to end on CPU (FP8 emulated): both curves fall by more than half, FP8 tracks."""
    import json

    import fp8_quality

    code = fp8_quality.main(["--tiny", "--device", "cpu", "--no-reseed", "--out", str(tiny_checkpoints / "out")])
    result = json.loads((tiny_checkpoints / "out" / "fp8-quality.json").read_text())
    assert code == 0 and result["verdict"] == "pass", result["problems"]
    m = result["metrics"]
    assert m["fall_16"] >= 0.5 and m["fall_fp8"] >= 0.5 and m["max_gap"] <= fp8_quality.MAX_GAP
    assert m["first_loss_16"] != m["first_loss_fp8"]  # the FP8 path really ran: other forward numerics
    assert (tiny_checkpoints / "out" / "fp8-quality.png").read_bytes()[:4] == b"\x89PNG"
    assert "**Verdict: pass**" in (tiny_checkpoints / "out" / "fp8-quality.md").read_text()


def test_fp8_quality_fails_when_the_fp8_adapters_do_not_update(tiny_checkpoints, monkeypatch):
    """Negative control: the FP8 run's optimizer at lr 0 (its adapters never move): the verdict fails."""
    import fp8_quality
    import torch

    real = fp8_quality.make_optimizer
    calls = []

    def frozen_second(params, lr, device):
        calls.append(lr)
        return real(params, 0.0 if len(calls) == 2 else lr, device)

    monkeypatch.setattr(fp8_quality, "make_optimizer", frozen_second)
    settings = fp8_quality.Settings(**fp8_quality.TINY, reseed=False)
    result = fp8_quality.run(settings)
    assert len(calls) == 2 and result["verdict"] == "FAIL"
    assert any("FP8 loss fell" in p for p in result["problems"])
    assert any("gap" in p for p in result["problems"])
    assert torch.isfinite(torch.tensor(result["runs"][1]["losses"])).all()


# --------------------------------------------------------------------------- ptx_census

PTX = """
.visible .entry k(
)
{
\tmov.u32 \t%r1, 0;
$L__BB0_1:                              // %loop
\tld.global.v4.b32 \t{%r2, %r3, %r4, %r5}, [%rd1];
\t// begin inline asm
\t{ .reg .b32 t; cvt.rn.bf16x2.f32 t, %f1, %f2; and.b32 %r6, t, 0xffff0000; shl.b32 %r7, t, 16; }
\t// end inline asm
\tfma.rn.f32 \t%f3, %f4, %f5, %f3;
\t@%p1 bra \t$L__BB0_1;
$L__BB0_2:
\tst.global.b32 \t[%rd2], %r7;
\tret;
}
"""


def test_ptx_census_counts_the_loop_with_inline_asm_expanded():
    import ptx_census

    loop = ptx_census.hot_loop(PTX)
    counts = ptx_census.opcodes(loop)
    # the store and the mov outside the loop are not counted; the asm block counts its three instructions
    assert counts == {"ld.global.v4.b32": 1, "cvt.rn.bf16x2.f32": 1, "and.b32": 1, "shl.b32": 1, "fma.rn.f32": 1,
                      "bra": 1}
    with pytest.raises(SystemExit, match="no loop"):
        ptx_census.hot_loop(PTX.replace("@%p1 bra \t$L__BB0_1;", ""))
    assert ptx_census.nf4_matvec_bytes_per_thread(dict(BLOCK_N=4, STEP_BLOCKS=16, BLOCKSIZE=64), {"num_warps": 4}) == 16


SASS = """
        /*0120*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0130*/                   LDG.E.128.CONSTANT R4, desc[UR6][R2.64] ;
        /*0140*/                   SHFL.IDX PT, R9, R8, R4, 0x1f ;
        /*0150*/              @!P1 FFMA R10, R9, R11, R10 ;
        /*0160*/                   FFMA R10, R9, R12, R10 ;
        /*0170*/               @P0 BRA `(.L_x_1) ;
.L_x_0:
        /*0180*/                   STG.E desc[UR6][R2.64], R10 ;
.L_x_2:
        /*0190*/                   BRA `(.L_x_2);
"""


def test_sass_census_counts_the_loop_without_predicates_or_modifiers():
    import ptx_census

    loop = ptx_census.sass_hot_loop(SASS)
    # the forward branch before the loop, the store after it and the trailing self-branch are not counted
    assert ptx_census.sass_opcodes(loop) == {"LDG": 1, "SHFL": 1, "FFMA": 2, "BRA": 1}
    with pytest.raises(SystemExit, match="no loop"):
        ptx_census.sass_hot_loop(SASS.replace("@P0 BRA `(.L_x_1) ;", "NOP ;").replace("BRA `(.L_x_2);", "EXIT ;"))


def test_fp16_training_step_runs_under_a_loss_scaler_and_counts_skipped_steps():
    """The T4 emulation's step (benchmarks/train_step.py --dtype float16): the scaled loss's backward and
    GradScaler's step; an overflow halves the scale and counts as a skipped step (CPU, a one-linear model)."""
    import torch

    import run
    import train_step

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, input_ids, labels):
            return types.SimpleNamespace(loss=(self.w * self.w * input_ids.float()).sum())

    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=train_step.INITIAL_SCALE)
    step = train_step.training_step(model, optimizer, scaler)
    step(torch.tensor([1, 2, 3]))
    assert model.w.grad is None and not torch.equal(model.w.detach(), torch.ones(3))  # stepped, grads cleared
    with torch.no_grad():
        model.w[0] = float("inf")  # the next gradient overflows: the scaler skips the step and halves its scale
    step(torch.tensor([1, 2, 3]))
    assert step.scales == [train_step.INITIAL_SCALE, train_step.INITIAL_SCALE / 2]
    assert train_step.skipped_steps(step.scales) == 1 and train_step.skipped_steps(step.scales[:1]) == 0
    assert train_step.skipped_steps([65536.0, 65536.0, 131072.0, 65536.0]) == 1  # a growth is no skip
    assert run.CONFIG_ARGS["8b-nf4-4096x1-t4"] == ["--dtype", "float16", "--memory-cap-gib", "15"]


def test_render_report_compares_the_busy_time_with_an_unprofiled_step():
    text = profile_step.render_report("t", [], wall_ms=30.0, busy_ms=18.0, kernels=KERNELS, steps=2, unprofiled_ms=10.0)
    assert "idle: 12.0 ms = 40.0% of the wall time" in text  # the profiled steps' share, profiler overhead included
    assert "GPU busy per profiled step against the median step without the profiler: 9.0 of 10.0 ms = 90%" in text
    assert "median step without the profiler" not in profile_step.render_report("t", [], 30.0, 18.0, KERNELS)


def test_host_waits_times_each_steps_waits_and_collections_and_undoes_its_patches():
    import gc
    import time
    import types

    import host_waits

    def wait(seconds):
        time.sleep(seconds)
        return seconds

    counter = {"num_alloc_retries": 3, "num_device_free": 5}  # cumulative: a step reports what it added
    host = {"cpu_s": 10.0, "preempted": 7.0, "steal_s": 100.0}
    owner = types.SimpleNamespace(wait=wait, read=wait)
    waits = host_waits.HostWaits([(owner, "wait")], reads=[(owner, "read")], counters=lambda: dict(counter),
                                 contention=lambda: dict(host))
    with waits:
        with waits.step():
            owner.wait(0.02)
            owner.wait(0.01)
            owner.read(0.015)
            counter["num_alloc_retries"] += 2  # a step that freed the allocator's cache twice
            host.update(cpu_s=10.004, preempted=9.0, steal_s=100.03)  # a step on a shared machine
        with waits.step():
            gc.collect()  # a generation-2 collection, inside the step
        owner.wait(0.0)  # between steps: not counted
    assert owner.wait is wait and owner.read is wait and waits._on_gc not in gc.callbacks  # undone
    first, second = waits.steps
    assert first["syncs"] == 2 and 0.03 <= first["sync_s"] < 0.045 and 0.015 <= first["read_s"] < 0.03
    assert first["sync_s"] + first["read_s"] <= first["host_s"]
    assert first["gcs"] == [0, 0, 0] and first["gc_s"] == 0.0 and first["counts"] == {"num_alloc_retries": 2}
    assert second["syncs"] == 0 and second["gcs"] == [0, 0, 1] and 0.0 < second["gc_s"] <= second["host_s"] + 1e-4
    assert second["read_s"] == 0.0 and second["counts"] == {}
    assert first["cpu_s"] == pytest.approx(0.004) and first["preempted"] == 2 and first["steal_s"] == pytest.approx(0.03)
    assert second["cpu_s"] == second["preempted"] == second["steal_s"] == 0.0


def test_host_contention_counts_this_process_cpu_time():
    import time

    import host_waits

    before = host_waits.host_contention()
    end = time.process_time() + 0.05
    while time.process_time() < end:  # 50 ms of this process's CPU
        pass
    after = host_waits.host_contention()
    assert after["cpu_s"] - before["cpu_s"] >= 0.04 and after["preempted"] >= before["preempted"]
    assert ("steal_s" in after) == os.path.exists("/proc/stat")


def test_the_table_lists_each_steps_host_waits_where_a_row_recorded_them():
    import run

    row = dict(config="8b-nf4-4096x1-t4", system="notebookkit-spread", status="ok", step_s=[0.301, 0.355],
               step_host=[dict(sync_s=0.012, syncs=30, gc_s=0.0),  # session 35's rows: no read, no counters
                          dict(sync_s=0.0604, syncs=30, gc_s=0.0021, read_s=0.0318, cpu_s=0.3513, preempted=4,
                               steal_s=0.02, counts={"num_device_free": 3, "num_alloc_retries": 1})])
    assert run.step_lines([row, dict(row, system="unsloth", step_host=None)]) == [
        "", "Per timed step: the step's GPU time (host waits on the GPU, the read at the step's end, "
        "garbage-collector pauses, the host's CPU time, involuntary context switches and the machine's steal time, "
        "allocator counters):",
        "- 8b-nf4-4096x1-t4 notebookkit-spread: 0.301 s (waits 12 ms in 30, gc 0.0 ms); "
        "0.355 s (waits 60 ms in 30, end read 32 ms, gc 2.1 ms, cpu 351 ms, preempted 4, steal 20 ms, "
        "num_alloc_retries 1, num_device_free 3)"]
    assert run.step_lines([dict(row, step_host=None)]) == []
