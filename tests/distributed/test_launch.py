"""The launch helpers of ``notebookkit.train.distributed``, the chat SFT notebook's ``.py`` form under
``accelerate launch``, and accelerate's placement hooks around notebookkit's patched forwards. (How that
form reads its ``--config`` file and flags: ``tests/notebooks/test_notebook_cells.py``.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "sft" / "chat_sft.py"


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
def test_accelerate_launch_runs_the_notebook_on_two_cpu_processes(tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2 notebooks/sft/chat_sft.py`` on a machine without GPUs
    starts two gloo processes (``--cpu`` alone would start one); the notebook's cells train under DDP, every
    cell runs to the end on both ranks, and the adapter is saved once."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    out, logs = tmp_path / "run", tmp_path / "logs"
    # --tee 3 --log_dir: each rank's stdout and stderr also go to files of their own (the console copy
    # interleaves the two ranks' writes, e.g. one rank's streamed reply inside the other's lines).
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), "--tee", "3", "--log_dir", str(logs),
           str(NOTEBOOK), "--max_steps", "2", "--train_rows", "32", "--n_eval", "4", "--n_exact", "1",
           "--batch_size", "2", "--max_seq_length", "256", "--calibration_steps", "0",
           "--min_loss_drop", "-1", "--min_heldout_drop", "-1", "--output_dir", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    ranks = [sorted(logs.glob(f"*/attempt_*/{rank}/stdout.log")) for rank in (0, 1)]
    assert all(len(found) == 1 for found in ranks), f"one stdout log a rank expected under {logs}: {ranks}"
    stdout = [found[0].read_text() for found in ranks]
    for rank, text in enumerate(stdout):
        assert "trained 2 steps in" in text and " on 2 processes" in text, f"rank {rank}:\n{text[-4000:]}"
        assert "learning signal: OK" in text, f"rank {rank}:\n{text[-4000:]}"
    saves = [text.count("saved: [") for text in stdout]
    assert saves == [1, 0], f"the adapter must be written by the first process only (saves by rank: {saves})"
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
