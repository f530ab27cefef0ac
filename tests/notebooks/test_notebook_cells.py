"""``notebookkit.notebook_cells``: the logic the notebooks share, and each notebook's machine defaults.

The defaults table below is the numbers the notebooks had before their resolve cells became one call; other
work depends on them (the vision notebook's 2 x 4 batch on a GPU, 8 x 1 on the CPU, for one), so a change to
them, or to how ``resolve_parameters`` fills them, fails here first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from notebookkit import notebook_cells
from notebookkit.notebook_cells import (PARAMETER_NAMES_KEY, apply_script_arguments, first_and_last,
                                        plot_loss_curve, resolve_parameters, save_parameters)

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]

# ---- apply_script_arguments ------------------------------------------------------------------------


def _parameters() -> dict:
    return dict(MODEL_NAME=None, LORA_R=16, LEARNING_RATE=None, CPU_LEARNING_RATE=2e-3, MIN_LOSS_DROP=0.2,
                LOAD_IN_4BIT=None, GRADIENT_CHECKPOINTING="auto", CHAT_TEMPLATE="alpaca", EXPORT_FORMS=["lora"],
                OUTPUT_DIR="outputs/x", NOTEBOOKKIT_SOURCE="", os=sys)


def test_config_file_then_flags_in_any_spelling(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model_name: notebookkit/tiny-llama\nLORA_R: 8\ncpu_learning_rate: 1\nlearning_rate: 5.0e-4\n")
    ns = _parameters()
    set_ = apply_script_arguments(ns, ["--lora-r", "4", "--config", str(cfg), "--LOAD_IN_4BIT", "false",
                                       "--min_loss_drop=0", "--gradient_checkpointing", "False",
                                       "--chat_template", "3", "--export_forms", "['lora', 'gguf']"])
    assert ns["MODEL_NAME"] == "notebookkit/tiny-llama"
    assert ns["LORA_R"] == 4, "a flag wins over the file, wherever --config stands"
    assert ns["CPU_LEARNING_RATE"] == 1.0 and isinstance(ns["CPU_LEARNING_RATE"], float)
    assert ns["LEARNING_RATE"] == 5e-4
    assert ns["LOAD_IN_4BIT"] is False and ns["MIN_LOSS_DROP"] == 0.0 and ns["GRADIENT_CHECKPOINTING"] is False
    assert ns["CHAT_TEMPLATE"] == "3" and ns["EXPORT_FORMS"] == ["lora", "gguf"]
    assert set(set_) == {"MODEL_NAME", "LORA_R", "CPU_LEARNING_RATE", "LEARNING_RATE", "LOAD_IN_4BIT",
                         "MIN_LOSS_DROP", "GRADIENT_CHECKPOINTING", "CHAT_TEMPLATE", "EXPORT_FORMS"}
    assert ns[PARAMETER_NAMES_KEY] == ["MODEL_NAME", "LORA_R", "LEARNING_RATE", "CPU_LEARNING_RATE", "MIN_LOSS_DROP",
                                       "LOAD_IN_4BIT", "GRADIENT_CHECKPOINTING", "CHAT_TEMPLATE", "EXPORT_FORMS",
                                       "OUTPUT_DIR"], "the install cell's NOTEBOOKKIT_SOURCE and modules are not parameters"


def test_unknown_names_and_wrong_types_stop_the_run(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"lerning_rate": 1e-4}))
    with pytest.raises(SystemExit, match="unknown parameter 'lerning_rate'"):
        apply_script_arguments(_parameters(), ["--config", str(bad)])
    with pytest.raises(SystemExit, match="LORA_R='ten' is not a int"):
        apply_script_arguments(_parameters(), ["--lora_r", "ten"])
    with pytest.raises(SystemExit, match="LORA_R=2.5 is not a int"):
        apply_script_arguments(_parameters(), ["--lora_r", "2.5"])
    with pytest.raises(SystemExit, match="has no value"):
        apply_script_arguments(_parameters(), ["--lora_r"])


def test_in_a_kernel_the_command_line_is_not_read(monkeypatch):
    """papermill sets the parameters in a kernel; the kernel's own argv (``-f kernel.json``) is no flag."""
    monkeypatch.setattr(notebook_cells, "running_in_a_kernel", lambda: True)
    monkeypatch.setattr(sys, "argv", ["ipykernel_launcher.py", "--lora_r", "2"])
    ns = _parameters()
    assert apply_script_arguments(ns) == {} and ns["LORA_R"] == 16
    assert PARAMETER_NAMES_KEY in ns
    monkeypatch.setattr(notebook_cells, "running_in_a_kernel", lambda: False)
    assert apply_script_arguments(ns) == {"LORA_R": 2}


def test_saved_parameters_read_back_as_the_same_run(tmp_path):
    ns = _parameters()
    apply_script_arguments(ns, [])
    ns.update(MODEL_NAME="notebookkit/tiny-llama", LEARNING_RATE=2e-3, ON_GPU=False, MAX_LENGTH=128)  # later cells
    path = save_parameters(ns, str(tmp_path / "run.yaml"), OUTPUT_DIR="outputs/x/scale_out")
    fresh = _parameters()
    apply_script_arguments(fresh, ["--config", str(path)])
    expected = {k: ns[k] for k in ns[PARAMETER_NAMES_KEY]} | {"OUTPUT_DIR": "outputs/x/scale_out"}
    assert {k: fresh[k] for k in fresh[PARAMETER_NAMES_KEY]} == expected
    with pytest.raises(ValueError, match="not parameters"):
        save_parameters(ns, str(tmp_path / "x.json"), ON_GPU=True)
    with pytest.raises(ValueError, match="apply_script_arguments"):
        save_parameters(_parameters(), str(tmp_path / "y.json"))


# ---- resolve_parameters ----------------------------------------------------------------------------


def test_none_is_filled_for_the_machine_and_set_values_are_kept(tmp_path):
    gpu, cpu = dict(A=1, B=2e-4, C=True), dict(A=8, B=2e-3, C=False)
    for on_gpu, want in ((True, gpu), (False, cpu)):
        ns = dict(A=None, B=None, C=None, SEED=3, OUTPUT_DIR=str(tmp_path / f"out{on_gpu}"))
        assert resolve_parameters(ns, gpu=gpu, cpu=cpu, on_gpu=on_gpu) is on_gpu
        assert {k: ns[k] for k in want} == want
        assert Path(ns["OUTPUT_DIR"]).is_dir()
    ns = dict(A=0, B=0.0, C=False)  # 0 and False are choices (a learning rate of 0 is the notebooks' control)
    resolve_parameters(ns, gpu=gpu, cpu=cpu, on_gpu=True)
    assert ns == dict(A=0, B=0.0, C=False)
    with pytest.raises(ValueError, match="same parameters"):
        resolve_parameters({}, gpu=dict(A=1), cpu=dict(B=1), on_gpu=False)


def test_resolve_seeds_torch():
    resolve_parameters(dict(SEED=11), gpu={}, cpu={}, on_gpu=False)
    a = torch.rand(3)
    resolve_parameters(dict(SEED=11), gpu={}, cpu={}, on_gpu=False)
    assert torch.equal(a, torch.rand(3))


# name -> (GPU, CPU) values after each notebook's resolve cell, with its parameters cell as committed
MACHINE_DEFAULTS = {
    "sft/chat_sft": dict(MODEL_NAME=("Qwen/Qwen3-0.6B", "notebookkit/tiny-llama"), LOAD_IN_4BIT=(True, False),
                         MAX_SEQ_LENGTH=(2048, 512), MAX_STEPS=(60, 24), CALIBRATION_STEPS=(30, 4),
                         LEARNING_RATE=(2e-4, 2e-3), BATCH_SIZE=(4, 4), GRAD_ACCUM=(1, 1), LORA_R=(16, 16),
                         MIN_LOSS_DROP=(0.2, 0.2)),  # MOE = True: tests/notebooks/test_chat_sft_moe.py
    "sft/alpaca_sft": dict(MODEL_NAME=("Qwen/Qwen3-0.6B", "notebookkit/tiny-llama"), LOAD_IN_4BIT=(True, False),
                           MAX_SEQ_LENGTH=(2048, 512), MAX_STEPS=(60, 24), CALIBRATION_STEPS=(30, 4),
                           LEARNING_RATE=(2e-4, 2e-3), BATCH_SIZE=(4, 4), GRAD_ACCUM=(1, 1)),
    "dpo/dpo": dict(MODEL_NAME=("Qwen/Qwen3-0.6B", "notebookkit/tiny-llama"), LOAD_IN_4BIT=(True, False),
                    MAX_SEQ_LENGTH=(2048, 256), MAX_STEPS=(60, 60), LEARNING_RATE=(5e-5, 5e-4), BATCH_SIZE=(8, 8),
                    GRAD_ACCUM=(1, 1)),
    "grpo/grpo": dict(MODEL_NAME=("Qwen/Qwen3-0.6B", "notebookkit/tiny-llama"), LOAD_IN_4BIT=(True, False),
                      MAX_SEQ_LENGTH=(1024, 256), PRIME_STEPS=(30, 40), PRIME_LEARNING_RATE=(2e-4, 5e-3),
                      GRPO_STEPS=(100, 50), MAX_COMPLETION_LENGTH=(256, 24), LEARNING_RATE=(5e-5, 1e-3),
                      FORMAT_ROWS=(False, True)),
    "vision/vision_sft": dict(MODEL_NAME=("Qwen/Qwen2.5-VL-7B-Instruct", "notebookkit/tiny-qwen2.5-vl"),
                              LOAD_IN_4BIT=(True, False), MAX_SEQ_LENGTH=(2048, 256), MAX_STEPS=(60, 450),
                              BATCH_SIZE=(2, 8), GRAD_ACCUM=(4, 1), LEARNING_RATE=(2e-4, 5e-3)),
    "export/export": dict(MODEL_NAME=("Qwen/Qwen3-0.6B", "notebookkit/tiny-llama"), LOAD_IN_4BIT=(True, False)),
}


def _parameters_and_resolve_cells(name: str) -> list[str]:
    import jupytext

    cells = [c for c in jupytext.read(ROOT / "notebooks" / f"{name}.py").cells if c.cell_type == "code"]
    params = [c.source for c in cells if "parameters" in c.metadata.get("tags", [])]
    resolve = [c.source for c in cells if "resolve_parameters(" in c.source]
    assert len(params) == 1 and len(resolve) == 1, f"{name}: one parameters cell and one resolve cell expected"
    return params + resolve


@pytest.mark.parametrize("name", sorted(MACHINE_DEFAULTS))
@pytest.mark.parametrize("on_gpu", [True, False], ids=["gpu", "cpu"])
def test_notebook_machine_defaults_are_unchanged(name, on_gpu, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the resolve cell creates OUTPUT_DIR
    monkeypatch.setattr(sys, "argv", ["notebook.py"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: on_gpu)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    ns: dict = {}
    for source in _parameters_and_resolve_cells(name):
        exec(compile(source, name, "exec"), ns)
    want = {k: v[0 if on_gpu else 1] for k, v in MACHINE_DEFAULTS[name].items()}
    assert {k: ns[k] for k in want} == want
    assert ns["ON_GPU"] is on_gpu


# ---- first_and_last and plot_loss_curve ------------------------------------------------------------

HISTORY = [{"loss": 4.0, "step": 1}, {"loss": 3.0, "step": 2, "reward": 0.0}, {"eval_loss": 9.0, "step": 2},
           {"loss": 2.0, "step": 3, "reward": 1.0}, {"reward": 5.0, "step": 3}, {"loss": 1.0, "step": 4}]


def test_first_and_last_means_the_rows_that_have_the_key():
    assert first_and_last(HISTORY, "loss", n=2) == (3.5, 1.5)
    assert first_and_last(HISTORY, "loss", n=10) == (2.5, 2.5)
    assert first_and_last(HISTORY, "reward", n=1) == (0.0, 5.0)
    assert first_and_last(HISTORY, "reward", n=1, rows_with=("loss",)) == (0.0, 1.0)

    class Trainer:  # a trainer is read through state.log_history
        class state:
            log_history = HISTORY

    assert first_and_last(Trainer(), "loss", n=1) == (4.0, 1.0)
    with pytest.raises(ValueError, match="no logged step has 'rewards/margins'"):
        first_and_last(HISTORY, "rewards/margins")


def test_plot_loss_curve_draws_training_and_held_back_loss(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    fig = plot_loss_curve(HISTORY, str(tmp_path / "curve.png"))
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].lines}
    assert lines == {"training loss": ([1, 2, 3, 4], [4.0, 3.0, 2.0, 1.0]), "held-back loss": ([2], [9.0])}
    assert (tmp_path / "curve.png").stat().st_size > 0
