"""TrainingMonitor counts the optimizer steps fp16's loss scaler skipped (accelerate's step_was_skipped)."""

from types import SimpleNamespace

from notebookkit.train.callbacks import TrainingMonitor


def test_counts_skipped_steps_and_resets_per_run():
    monitor = TrainingMonitor(update_every=1e9)
    state = SimpleNamespace(global_step=0, max_steps=3, epoch=0.0)
    monitor.on_train_begin(None, state, None)
    for step, skipped in enumerate([True, False, True], start=1):
        state.global_step = step
        monitor.on_step_end(None, state, None, optimizer=SimpleNamespace(step_was_skipped=skipped))
    monitor.on_step_end(None, state, None)  # no optimizer handed over: nothing counted
    assert monitor.skipped_steps == 2
    monitor.on_train_begin(None, state, None)
    assert monitor.skipped_steps == 0
