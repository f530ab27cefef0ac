"""``scripts/train_sft.py`` settings, the launch helpers of ``notebookkit.train.distributed``, the
``accelerate launch`` path, and accelerate's placement hooks around notebookkit's patched forwards."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_sft_script", REPO / "scripts" / "train_sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- settings --------------------------------------------------------------------------------------


def test_config_file_accepts_notebook_parameter_names_and_flags_win(script, tmp_path):
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps({
        "MODEL_NAME": "notebookkit/tiny-llama", "LORA_R": 8, "BATCH_SIZE": 3, "GRAD_ACCUM": 2,
        "LEARNING_RATE": None, "CPU_LEARNING_RATE": 1e-3, "MAX_STEPS": None, "CPU_STEPS": 7,
        "CALIBRATION_STEPS": 6, "N_EXACT": 6, "SEED": 11, "OUTPUT_DIR": "out/x", "lora_alpha": 32,
    }))
    cfg = script.parse_config(["--config", str(cfg_file), "--seed", "5", "--load-in-4bit", "false"])
    assert (cfg["r"], cfg["per_device_train_batch_size"], cfg["gradient_accumulation_steps"]) == (8, 3, 2)
    assert cfg["seed"] == 5 and cfg["load_in_4bit"] is False and cfg["lora_alpha"] == 32
    resolved = script.resolve(cfg)
    if not torch.cuda.is_available():
        assert resolved["max_steps"] == 7 and resolved["learning_rate"] == 1e-3
        assert resolved["max_seq_length"] == 512


def test_config_rejects_unknown_settings_and_bad_values(script, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"lerning_rate": 1e-4}))
    with pytest.raises(SystemExit, match="unknown setting 'lerning_rate'"):
        script.parse_config(["--config", str(bad)])
    with pytest.raises(SystemExit, match="max_steps='ten' is not a valid int"):
        script.parse_config(["--max_steps", "ten"])


# ---- launch helpers --------------------------------------------------------------------------------


def test_dist_info_and_ddp_settings(monkeypatch):
    from notebookkit.train.distributed import ddp_training_args, dist_info, local_device_map

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert dist_info().world_size == 1 and dist_info().is_main
    assert local_device_map("balanced") == "balanced"  # one process: layer placement allowed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    info = dist_info()
    assert (info.rank, info.local_rank, info.world_size, info.is_main) == (1, 1, 2, False)
    with pytest.raises(ValueError, match="data parallel"):
        local_device_map("balanced", info)
    args = ddp_training_args()
    assert args["ddp_find_unused_parameters"] is False and args["average_tokens_across_devices"] is True
    if not torch.cuda.is_available():
        assert args["ddp_backend"] == "gloo" and args["use_cpu"] is True
        assert local_device_map(None, info) is None


# ---- accelerate launch -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU launch test (gloo); GPUs are covered by the gpu tests")
def test_accelerate_launch_two_cpu_processes(tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2`` on a machine without GPUs starts two gloo
    processes (``--cpu`` alone would start one); the script trains and saves the adapter once."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()),
           str(REPO / "scripts" / "train_sft.py"), "--max_steps", "2", "--dataset_rows", "32", "--n_eval", "4",
           "--per_device_train_batch_size", "2", "--max_length", "256", "--output_dir", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 4 and summary["steps"] == 2
    assert all(l == l for l in summary["losses"]) and summary["eval_loss"] is not None
    assert (out / "lora_adapter" / "adapter_config.json").is_file()


# ---- device_map placement hooks --------------------------------------------------------------------


def test_accelerate_placement_hooks_survive_patching():
    """With ``device_map`` placement accelerate wraps ``forward`` of the placed modules (and the
    model) to move inputs to each module's device. Patching must keep those wrappers running around
    the fused forwards, or a model split over GPUs sees tensors on the wrong device."""
    from accelerate.hooks import attach_align_device_hook_on_blocks

    from notebookkit import FastLanguageModel

    model, tok = FastLanguageModel.from_pretrained(
        "notebookkit/tiny-llama", load_in_4bit=False, fast_path=False, show_banner=False
    )
    n = model.config.num_hidden_layers
    placement = {"": "cpu", "model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
                 "lm_head": "cpu", **{f"model.layers.{i}": "cpu" for i in range(n)}}
    attach_align_device_hook_on_blocks(model, execution_device=placement)
    ran: set[str] = set()
    for name, module in model.named_modules():
        hook = module.__dict__.get("_hf_hook")
        if hook is not None:
            original = hook.pre_forward

            def pre_forward(mod, *args, _name=name, _original=original, **kwargs):
                ran.add(_name)
                return _original(mod, *args, **kwargs)

            hook.pre_forward = pre_forward
    FastLanguageModel.patch(model)
    model.train()
    batch = tok(["placement hooks must keep running"], return_tensors="pt")
    loss = model(**batch, labels=batch["input_ids"]).loss
    assert torch.isfinite(loss)
    must_run = ["", "model.norm", "model.layers.0", "model.layers.0.input_layernorm", "model.layers.0.mlp",
                "model.layers.0.self_attn"]
    missing = [m or "<model>" for m in must_run if m not in ran]
    assert not missing, f"accelerate hooks bypassed by the patched forwards of: {missing}"
    FastLanguageModel.unpatch(model)
