"""Every row of the training-method record (``notebookkit.training_methods``) is known to every consumer.

A method added to the table without one of its consumers fails here: the memory model (rows per
example, loss buffers, reference pass, completion-only loss, generation), the activation planner, the
training panel (fields, switch, batch unit, note), the trainer (exported from ``notebookkit.train.<name>``,
its timing keys) and the dashboard (the view that draws its metrics, the key that marks its run).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from notebookkit.memory import estimate_training_memory, model_shape
from notebookkit.memory.estimate import METHODS
from notebookkit.training_methods import TRAINING_METHODS, panel_methods, training_method
from notebookkit.widgets.training_panel import TrainingChoice, TrainingPanel

NAMES = list(TRAINING_METHODS)
SHAPE = model_shape(dict(model_type="llama", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=512, vocab_size=1000))


def test_record_imports_without_torch():
    code = "import sys, notebookkit.training_methods; assert 'torch' not in sys.modules and 'trl' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lookup():
    assert training_method("dpo").rows_per_example == 2
    with pytest.raises(ValueError, match="the methods are: sft"):
        training_method("ppo")


@pytest.mark.parametrize("name", NAMES)
def test_memory_model_reads_the_record(name, monkeypatch):
    """Rows per example scale the activations; the loss buffers, reference pass and scored length follow."""
    from notebookkit.memory import estimate as estimate_module

    row = TRAINING_METHODS[name]
    references = []
    real = estimate_module._reference_pass
    monkeypatch.setattr(estimate_module, "_reference_pass", lambda *a: references.append(a) or real(*a))
    assert name in METHODS
    kw = dict(load_in_4bit=True, dtype="float16", batch_size=2, seq_len=64, activation_plan="keep")
    est = estimate_training_memory(SHAPE, method=name, completion_len=16, **kw)
    sft = estimate_training_memory(SHAPE, method="sft", **kw)
    assert est.inputs["rows"] == 2 * row.rows_per_example
    assert est.activations == sft.activations * row.rows_per_example
    assert est.inputs["scored_len"] == (16 if row.completion_loss else 64)
    assert any("per-token log-probs" in k for k in est.details) == row.logprob_loss
    assert bool(references) == row.reference_pass
    assert (est.generation > 0) == row.generates


@pytest.mark.parametrize("name", NAMES)
def test_planner_counts_rows_for_the_tower(name):
    from notebookkit.memory.planner import _vision_recompute_seconds
    from notebookkit.memory.vision_shapes import vlm_shape

    vlm = vlm_shape("Qwen/Qwen2.5-VL-7B-Instruct")
    one = _vision_recompute_seconds(vlm, dict(batch_size=1, method="sft"), None)
    assert _vision_recompute_seconds(vlm, dict(batch_size=1, method=name), None) == pytest.approx(
        one * TRAINING_METHODS[name].rows_per_example)


@pytest.mark.parametrize("name", NAMES)
def test_training_panel_shows_the_method(name):
    row = TRAINING_METHODS[name]
    panel = TrainingPanel(method=name, optim="adamw_torch")
    assert panel.value.method == name
    shown = panel.widget.children
    assert (panel.packing in shown) == row.packing and (panel.beta in shown) == bool(row.beta_label)
    assert (panel.method in shown) == (len(panel_methods(row.panel)) > 1)
    assert row.batch_unit in panel.summary.value and row.note in panel.summary.value
    kwargs = TrainingChoice(method=name, optim="adamw_torch").trainer_kwargs()
    assert ("packing" in kwargs) == row.packing and ("beta" in kwargs) == bool(row.beta_label)


@pytest.mark.parametrize("name", NAMES)
def test_trainer_exists(name):
    import notebookkit.train as train

    assert callable(getattr(train, TRAINING_METHODS[name].trainer))


@pytest.mark.parametrize("name", NAMES)
def test_dashboard_reads_the_metrics(name):
    from types import SimpleNamespace

    from notebookkit.widgets.rl_metrics import TIME_PARTS, panels, run_kind, stat_cells

    row = TRAINING_METHODS[name]
    logged = {"step": 1, "loss": 1.0, **{k: 0.5 for k in row.metrics + row.step_times}}
    monitor = SimpleNamespace(history=[logged], latest=logged.get, series=lambda key: ([1], [logged[key]]))
    assert run_kind(monitor) == (row.dashboard or None)
    assert bool(stat_cells(monitor)) == bool(panels(monitor)) == bool(row.dashboard)
    assert [key for key, _, _ in TIME_PARTS if key in row.step_times] == list(row.step_times)


@pytest.mark.parametrize("name", NAMES)
def test_trainer_reads_the_record(name):
    """The trainer is exported from notebookkit.train.<name>; its timing keys are the record's."""
    pytest.importorskip("trl")
    import notebookkit.train as train

    row = TRAINING_METHODS[name]
    assert getattr(train, row.trainer).__module__ == f"notebookkit.train.{name}"
    if row.step_times:
        from importlib import import_module

        assert import_module(f"notebookkit.train.{name}").TIME_KEYS == row.step_times


def test_every_dashboard_view_is_drawn():
    from notebookkit.widgets.rl_metrics import VIEWS

    assert {m.dashboard for m in TRAINING_METHODS.values()} - {""} == set(VIEWS)
