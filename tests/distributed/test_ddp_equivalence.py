"""Data-parallel training equals one process on the same global batch.

Two launches of ``ddp_worker.py`` (which runs the chat SFT notebook's own cells, ``notebooks/sft/chat_sft.py``,
as a ``torchrun`` launch of that file does, and trains the trainer they build) on the tiny default model,
fp32, 5 optimizer steps, the same 48 bundled conversations and seed:

* one process, ``per_device_train_batch_size=4`` (the reference), plus ``device_map="balanced"``
  and a plain ``transformers.Trainer`` run;
* ``torchrun --nproc_per_node 2`` (gloo): 2 x 2; 2 x 1 with 2 accumulation steps; 2 x 2 with every
  decoder layer under notebookkit's offload checkpoint; 2 x 2 with a plain ``Trainer`` (so the loss
  is notebookkit's fused linear cross-entropy with ``num_items_in_batch``, not TRL's fused head);
  2 x 2 with NF4 (QLoRA) base weights; and 2 x 2 with the gradient all-reduce switched off (a
  broken data-parallel run, the negative control).

How close is close enough is measured, not assumed. A data-parallel run computes the same sums as
one process, in another order; so does one process that splits the same global batch of 4 into
accumulation micro-batches (2 x 2, 1 x 4). Those one-process splits, run in the same launch on the
same CPU, give the **noise floor**: how far rounding alone moves the trained adapters on this
machine, with its kernels, vector width and thread count. A data-parallel run must stay within
``NOISE_FACTOR`` times that floor.

The difference is measured per kind of matrix, relative to how far that kind moved in training:

    err_A = ||A_ddp - A_ref|| / ||A_ref - A_init||     (all lora_A tensors together; same for B)

A starts at random values and moves little in 5 steps, so pooled with B (as ``||W_ddp - W_ref|| /
||W_ref||`` over all tensors was) its large norm hid differences in the update; B starts at zero.

The NF4 run is compared with one process running the same two micro-batches as accumulation steps
(2 x 2 accumulation, the same sums as 2 processes x 2, so bit-identical here); its own floor comes from
the NF4 splits 1 x 4 and 4 x 1: AdamW's first steps amplify rounding on entries whose gradient is
near its epsilon, which NF4 base weights produce (err about 1e-2, against about 2e-5 in fp32).

Also checked: the same weights on both ranks, one gradient all-reduce per bucket per optimizer step
(none on the accumulation micro-batches), and ``find_unused_parameters=False``. The shuffled order is
the same in every launch because the sampler is seeded identically in every process; dropout is 0.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ddp_worker.py")
STEPS = 5
# A data-parallel run is one more way of ordering the same sums as the one-process splits that
# measure the floor, so its difference is one more sample of the same rounding noise. Measured on a
# 2-core AVX-512 CPU: every data-parallel difference was at most 0.92x the larger of its two floor
# samples, and two samples differed by up to 1.6x (A, B) and 3x (the loss, a few ulps). 4x the
# larger sample leaves room for other CPUs and still sits 8,000x (fp32) below the broken run (no
# all-reduce: 0.63 in A, 0.46 in B) and about 6x below it for NF4, whose floor is 2e-2.
NOISE_FACTOR = 4.0
# Should two splits ever round identically, the floor would be zero: never ask for less than eight
# fp32 ulps (2^-20 relative). Logged losses differ by whole ulps, so their floor is this one here.
FLOOR_MIN = 2.0**-20
# The notebook's parameters (its parameters cell's names); the notebook logs the loss every step and
# keeps LoRA dropout at 0. One held-back conversation keeps its evaluation cells cheap; no calibration.
COMMON = dict(
    MODEL_NAME="notebookkit/tiny-llama", MAX_STEPS=STEPS, TRAIN_ROWS=48, N_EVAL=1, N_EXACT=0, MAX_SEQ_LENGTH=256,
    LEARNING_RATE=2e-3, WARMUP_STEPS=0, SEED=3407, DTYPE="float32", LOAD_IN_4BIT=False,
    GRADIENT_CHECKPOINTING=False, CALIBRATION_STEPS=0,
)


def _variant(name: str, out: Path, bs: int, ga: int = 1, **extra) -> dict:
    settings = dict(COMMON, BATCH_SIZE=bs, GRAD_ACCUM=ga, OUTPUT_DIR=str(out / f"run_{name}"))
    settings.update(extra.pop("settings", {}))
    return dict(name=name, settings=settings, **extra)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
    )
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    return env


def _launch(out: Path, variants: list[dict], nproc: int, timeout: int = 300) -> float:
    env = _env()
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
                "--master_port", env["MASTER_PORT"]]
    cmd += [str(WORKER), "--out", str(out), "--variants", json.dumps(variants)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"{' '.join(cmd[:6])} ... exited with {proc.returncode}:\n{tail}")
    return time.perf_counter() - start


# Each reference's floor: (a one-process run, its splits of the same global batch of 4 sequences).
# The plain Trainer runs the same model and kernels as the SFT trainer, so it shares their floor
# (measured once, with a 2 x 2 plain-Trainer split: the same three numbers to three digits).
FLOOR_RUNS = {
    "ref": ("ref", ("ref_ga2", "ref_ga4")),
    "ref_hf": ("ref", ("ref_ga2", "ref_ga4")),
    "ref_nf4_ga2": ("ref_nf4_ga2", ("ref_nf4", "ref_nf4_ga4")),
}
COMPARISONS = [("ddp_bs2", "ref"), ("ddp_ga2", "ref"), ("ddp_offload", "ref"), ("ddp_hf", "ref_hf"),
               ("ddp_nf4", "ref_nf4_ga2")]
NF4 = {"LOAD_IN_4BIT": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    one = [
        _variant("ref", out, bs=4),
        _variant("ref_ga2", out, bs=2, ga=2),
        _variant("ref_ga4", out, bs=1, ga=4),
        _variant("balanced", out, bs=4, settings={"DEVICE_MAP": "balanced"}),
        _variant("ref_hf", out, bs=4, trainer="hf"),
        _variant("ref_nf4_ga2", out, bs=2, ga=2, settings=NF4),
        _variant("ref_nf4", out, bs=4, settings=NF4),
        _variant("ref_nf4_ga4", out, bs=1, ga=4, settings=NF4),
    ]
    two = [
        _variant("ddp_bs2", out, bs=2),
        _variant("ddp_ga2", out, bs=1, ga=2),
        _variant("ddp_offload", out, bs=2, force_offload=True),
        _variant("ddp_hf", out, bs=2, trainer="hf"),
        _variant("ddp_nf4", out, bs=2, settings=NF4),
        _variant("ddp_no_allreduce", out, bs=2, skip_allreduce=True),
    ]
    t1 = _launch(out, one, nproc=1)
    t2 = _launch(out, two, nproc=2)
    print(f"\none-process launch {t1:.1f} s, two-process launch {t2:.1f} s")
    return out


def _load(out: Path, name: str, rank: int = 0) -> dict:
    return torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)


def _differences(got: dict, want: dict) -> dict[str, float]:
    """``{"lora_A": err_A, "lora_B": err_B, "loss": worst per-step relative loss difference}`` of run
    ``got`` against run ``want``, each matrix kind relative to how far it moved in ``want``."""
    assert got["lora"].keys() == want["lora"].keys() and want["lora"], "LoRA parameter names differ between runs"
    assert all(torch.isfinite(v).all() for v in got["lora"].values()), "NaN/inf in LoRA weights"
    for k, v in want["lora_init"].items():
        assert torch.equal(got["lora_init"][k], v), f"{k}: the two runs did not start from the same adapters"
    out = {}
    for kind in ("lora_A", "lora_B"):
        keys = [k for k in want["lora"] if kind in k]
        assert keys, f"no {kind} tensors"
        diff = sum(float(((got["lora"][k] - want["lora"][k]).double() ** 2).sum()) for k in keys) ** 0.5
        moved = sum(float(((want["lora"][k] - want["lora_init"][k]).double() ** 2).sum()) for k in keys) ** 0.5
        assert moved > 0, f"{kind} did not move in training: nothing to compare"
        out[kind] = diff / moved
    assert len(got["losses"]) == len(want["losses"]) == STEPS
    out["loss"] = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"]))
    return out


def _bounds(out: Path, ref: str) -> dict[str, float]:
    """``NOISE_FACTOR`` x the noise floor of ``ref``: the largest difference between it and the
    one-process splits of the same global batch (at least ``FLOOR_MIN``)."""
    base, splits = FLOOR_RUNS[ref]
    want = _load(out, base)
    floors = [_differences(_load(out, split), want) for split in splits]
    return {key: NOISE_FACTOR * max(FLOOR_MIN, *(f[key] for f in floors)) for key in floors[0]}


def _report(what: str, diffs: dict, bounds: dict) -> str:
    return f"{what}: " + ", ".join(f"{k} {diffs[k]:.2e} (bound {bounds[k]:.2e})" for k in diffs)


@pytest.mark.parametrize("name,ref", COMPARISONS)
def test_ddp_lora_weights_equal_one_process(runs, name, ref):
    got, want = _load(runs, name), _load(runs, ref)
    assert got["world_size"] == 2 and want["world_size"] == 1
    assert got["global_batch"] == want["global_batch"] == 4
    assert got["steps"] == want["steps"] == STEPS
    diffs, bounds = _differences(got, want), _bounds(runs, ref)
    print(_report(f"{name} vs {ref}", diffs, bounds))
    for key, err in diffs.items():
        assert err <= bounds[key], (
            f"{name} differs from one process ({ref}) by {err:.2e} in {key}, more than {NOISE_FACTOR:g}x the "
            f"rounding noise of one-process batch splits ({bounds[key] / NOISE_FACTOR:.2e})")
    # DDP keeps the replicas identical
    other = _load(runs, name, rank=1)
    assert all(torch.equal(other["lora"][k], v) for k, v in got["lora"].items()), "the two ranks' adapters differ"


def test_the_floor_is_rounding_noise(runs):
    """The floors are what they claim: small (rounding, not another computation) and not zero by
    accident (the splits really ran differently)."""
    for base, splits in set(FLOOR_RUNS.values()):
        want = _load(runs, base)
        for split in splits:
            diffs = _differences(_load(runs, split), want)
            print(f"floor {split} vs {base}: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
            assert max(diffs.values()) < 0.1, f"{split} vs {base}: {diffs} is not rounding noise"


def test_a_broken_ddp_run_fails_the_comparison(runs):
    """Negative control: without the gradient all-reduce each rank trains on its own half of the batch.
    The comparison must catch that in A and in B separately, and the ranks must drift apart."""
    got, want = _load(runs, "ddp_no_allreduce"), _load(runs, "ref")
    diffs, bounds = _differences(got, want), _bounds(runs, "ref")
    print(_report("ddp_no_allreduce vs ref", diffs, bounds))
    for kind in ("lora_A", "lora_B"):
        assert diffs[kind] > 100 * bounds[kind], f"a run without all-reduce passes the {kind} comparison"
    other = _load(runs, "ddp_no_allreduce", rank=1)
    assert not all(torch.equal(other["lora"][k], v) for k, v in got["lora"].items())


def test_ddp_settings_and_one_allreduce_per_optimizer_step(runs):
    for name in ("ddp_bs2", "ddp_ga2", "ddp_offload", "ddp_hf"):
        rec = _load(runs, name)
        assert rec["wrapper"] == "DistributedDataParallel", name
        assert rec["find_unused_parameters"] is False, name
        buckets = len(rec["buckets"])
        assert buckets >= 1
        # one all-reduce per bucket per optimizer step, tagged with that step
        assert rec["allreduce_calls"] == [s for s in range(STEPS) for _ in range(buckets)], name
    ga = _load(runs, "ddp_ga2")
    assert ga["micro_batches"] == 2 * STEPS  # two backward passes per step, the first under no_sync


def test_offload_checkpoint_ran_under_ddp(runs):
    rec = _load(runs, "ddp_offload")
    assert rec["offload_calls"] >= STEPS * 4  # every decoder layer (tiny llama has 4), every step


def test_plain_trainer_used_notebookkit_fused_loss(runs):
    for name in ("ref_hf", "ddp_hf"):
        rec = _load(runs, name)
        assert rec["trainer"] == "Trainer"
        assert rec["lm_head_calls"] == 0, "the LM head ran as a module: the fused linear cross-entropy was bypassed"


def test_device_map_balanced_loads_and_trains_on_cpu(runs):
    """On a CPU-only machine "balanced" has one device to use: everything on the CPU, and training is
    the default run (within the default run's noise floor). (On several GPUs it spreads the layers;
    see the gpu test.)"""
    rec, ref = _load(runs, "balanced"), _load(runs, "ref")
    device_map = rec["hf_device_map"]
    assert device_map is None or set(map(str, device_map.values())) <= {"cpu"}
    diffs, bounds = _differences(rec, ref), _bounds(runs, "ref")
    assert all(diffs[k] <= bounds[k] for k in diffs), _report("balanced vs ref", diffs, bounds)


# ---- GPU checks (run by the lead: `pytest -m gpu tests/distributed`) ---------------------------------


def _floor_runs(out: Path, **settings) -> list[dict]:
    """The reference (1 x 4) and its noise-floor splits (2 x 2, 1 x 4 accumulation) with ``settings``."""
    return [_variant("ref", out, bs=4, settings=settings), _variant("ref_ga2", out, bs=2, ga=2, settings=settings),
            _variant("ref_ga4", out, bs=1, ga=4, settings=settings)]


@pytest.mark.gpu
def test_device_map_balanced_trains_on_gpus(tmp_path):
    """One process, ``device_map="balanced"``: on several GPUs the decoder layers are spread over them
    (the hook that moves activations between devices must survive notebookkit's patching); on one GPU
    everything lands on it. Either way 5 fp32 steps must match the single-device run within its
    noise floor (measured on the GPU, with its kernels)."""
    one = _floor_runs(tmp_path, DEVICE_MAP=None) + [
        _variant("balanced", tmp_path, bs=4, settings={"DEVICE_MAP": "balanced"}),
    ]
    _launch(tmp_path, one, nproc=1)
    rec, ref = _load(tmp_path, "balanced"), _load(tmp_path, "ref")
    devices = {str(d) for d in (rec["hf_device_map"] or {}).values()}
    print("hf_device_map devices:", devices, "losses:", rec["losses"])
    if torch.cuda.device_count() > 1:
        assert len(devices) > 1, f"balanced did not split the layers: {rec['hf_device_map']}"
    diffs, bounds = _differences(rec, ref), _bounds(tmp_path, "ref")
    print(_report("balanced vs ref", diffs, bounds))
    assert all(diffs[k] <= bounds[k] for k in diffs), _report("balanced vs ref", diffs, bounds)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ddp_nccl_two_gpus_equal_one(tmp_path):
    two = [_variant("ddp_bs2", tmp_path, bs=2), _variant("ddp_ga2", tmp_path, bs=1, ga=2)]
    _launch(tmp_path, _floor_runs(tmp_path), nproc=1)
    _launch(tmp_path, two, nproc=2)
    ref, bounds = _load(tmp_path, "ref"), _bounds(tmp_path, "ref")
    for name in ("ddp_bs2", "ddp_ga2"):
        got = _load(tmp_path, name)
        assert got["find_unused_parameters"] is False
        diffs = _differences(got, ref)
        print(_report(f"{name} vs ref", diffs, bounds))
        assert all(diffs[k] <= bounds[k] for k in diffs), _report(f"{name} vs ref", diffs, bounds)
