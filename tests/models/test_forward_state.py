"""The state of one forward is its own: threads, nested forwards and failures do not share or leak it.

A patched backbone opens one :class:`~notebookkit.models.patching.forward_state.ForwardPass` per call, held
per thread, and a plainly causal forward passes its "no mask" through the attention-mask argument:
nothing shared (the model's config, a module-level flag) changes during a forward. So a padded
forward running while a plainly causal one is paused inside a layer (another thread, or nested in
it) still gets Hugging Face's padding mask, and each gives the result it gives alone.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from notebookkit.models.patching import forward_state, lora_fast_path
from notebookkit.models import patch_model
from notebookkit.models.patching.checkpointing import apply_checkpointing

from .helpers import random_model
from .test_patch_parity import _lora

SEQ = 10


def _model(checkpointing=False, device="cpu", dtype=torch.float32):
    model = _lora(random_model("llama").to(device=device, dtype=dtype))
    patch_model(model)
    model.train()
    apply_checkpointing(model, checkpointing)
    return model


def _on(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


def _plain(seed=0):
    ids = torch.randint(3, 256, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _padded(seed=1):
    ids = torch.randint(3, 256, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 4] = -100  # predicted from a padding position
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _packed(seed=2):
    ids = torch.randint(3, 256, (1, SEQ), generator=torch.Generator().manual_seed(seed))
    pos = torch.cat([torch.arange(4), torch.arange(SEQ - 4)])[None]
    return {"input_ids": ids, "position_ids": pos, "labels": ids}


def _loss(model, batch):
    with torch.no_grad():
        return model(**batch).loss


def _config_state(model):
    config = model.get_base_model().model.config
    return {k: copy.copy(v) for k, v in vars(config).items()}


def test_each_thread_sees_its_own_pass():
    inside = threading.Barrier(2)
    seen = {}

    def run(name, defaults):
        with forward_state.forward_pass(default_positions=defaults) as mine:
            inside.wait()  # both passes are open now
            seen[name] = (forward_state.current() is mine, mine.positions_are_defaults, mine.id)
            inside.wait()
        seen[name + " after"] = forward_state.current()

    threads = [threading.Thread(target=run, args=("a", True)), threading.Thread(target=run, args=("b", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a"][:2] == (True, True) and seen["b"][:2] == (True, False)
    assert seen["a"][2] != seen["b"][2]
    assert seen["a after"] is None and seen["b after"] is None and forward_state.current() is None


def _pause_first_layer(model, when):
    """Call ``when()`` inside the first decoder layer of the next forward of ``model`` (once)."""
    layer = model.get_base_model().model.layers[0]
    state = {"done": False}

    def hook(_module, _args):
        if not state["done"]:
            state["done"] = True
            when()

    return layer.register_forward_pre_hook(hook)


def _alongside_a_paused_forward(model, paused_batch, batch):
    """Losses of ``paused_batch`` (a worker thread, paused inside its first layer) and of ``batch``
    (this thread, run while the other waits)."""
    paused, resume, got = threading.Event(), threading.Event(), {}

    def wait_inside():
        paused.set()
        assert resume.wait(60)

    handle = _pause_first_layer(model, wait_inside)
    worker = threading.Thread(target=lambda: got.setdefault("paused", _loss(model, paused_batch)))
    worker.start()
    try:
        assert paused.wait(60)
        got["meanwhile"] = _loss(model, batch)
    finally:
        resume.set()
        worker.join()
        handle.remove()
    return got["paused"], got["meanwhile"]


def test_a_forward_on_another_thread_keeps_its_own_masks():
    """Thread A's plainly causal forward pauses inside its first layer; meanwhile this thread runs a
    padded forward of the same model. Both equal their results alone (a config swapped for A's
    forward would have dropped B's padding mask)."""
    model = _model()
    plain, padded = _plain(), _padded()
    expected_plain, expected_padded = _loss(model, plain), _loss(model, padded)
    got_plain, got_padded = _alongside_a_paused_forward(model, plain, padded)
    assert torch.equal(got_padded, expected_padded)
    assert torch.equal(got_plain, expected_plain)


@pytest.mark.parametrize("inner_model", ["same", "reference copy"])
def test_a_forward_nested_in_a_forward_stays_correct(inner_model):
    """A forward run from inside another (a reference model, or the same model, from a hook) gets its
    own masks and positions, and the outer forward continues with its own pass."""
    model = _model()
    inner = model if inner_model == "same" else copy.deepcopy(model)
    plain, padded, packed = _plain(), _padded(), _packed()
    expected = {name: _loss(m, b) for name, m, b in
                (("plain", model, plain), ("padded", inner, padded), ("packed", inner, packed))}
    got = {}

    def nested():
        outer = forward_state.current()
        got["padded"] = _loss(inner, padded)
        got["packed"] = _loss(inner, packed)
        got["outer restored"] = forward_state.current() is outer and outer is not None

    handle = _pause_first_layer(model, nested)
    try:
        got["plain"] = _loss(model, plain)
    finally:
        handle.remove()
    assert got["outer restored"]
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


@pytest.mark.parametrize("checkpointing", [False, "recompute"])
def test_nothing_is_left_set_after_a_forward_raises(checkpointing):
    model = _model(checkpointing)
    plain, padded = _plain(), _padded()
    expected_padded = _loss(model, padded)
    before = _config_state(model)

    def fail():
        raise RuntimeError("stop inside the first layer")

    handle = _pause_first_layer(model, fail)
    with pytest.raises(RuntimeError, match="stop inside"):
        model(**plain)
    handle.remove()
    with pytest.raises(Exception):
        model(input_ids=torch.full((1, SEQ), 10_000), labels=None)  # token ids past the vocabulary
    assert forward_state.current() is None and forward_state.unread_output() is None
    assert _config_state(model) == before  # the shared config was never changed
    assert torch.equal(_loss(model, padded), expected_padded)


def _count_view_builds(monkeypatch) -> list:
    builds = []
    real_view = lora_fast_path.projection_view
    monkeypatch.setattr(lora_fast_path, "projection_view", lambda m, training=None: builds.append(1) or real_view(m, training))
    return builds


def test_the_recompute_resumes_its_pass_on_another_thread(monkeypatch):
    """The backward (with the recompute of every layer) run on another thread than the forward, as
    PyTorch does for CUDA: the recompute resumes the forward's pass, so the views are built once per
    step, and the gradients are those of a backward on the same thread."""
    model = _model("recompute")
    batch = _plain()
    builds = _count_view_builds(monkeypatch)

    def grads():
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    expected, expected_builds = grads(), len(builds)

    builds.clear()
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    worker = threading.Thread(target=loss.backward)
    worker.start()
    worker.join()
    assert len(builds) == expected_builds == 7 * model.config.num_hidden_layers
    got = grads()
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


@pytest.mark.gpu
def test_gpu_recompute_on_autograd_threads_and_two_threads_at_once(monkeypatch):
    """On CUDA, PyTorch runs the backward (and so every recompute) on its own device thread: the views
    are still built once per step. And two threads forwarding one CUDA model at once keep their masks."""
    model = _model("recompute", device="cuda", dtype=torch.bfloat16)
    batch = _on(_plain(), "cuda")
    builds = _count_view_builds(monkeypatch)
    for _ in range(2):
        builds.clear()
        model(**batch).loss.backward()
        assert len(builds) == 7 * model.config.num_hidden_layers
    assert forward_state.current() is None

    plain, padded = _on(_plain(), "cuda"), _on(_padded(), "cuda")
    expected_plain, expected_padded = _loss(model, plain), _loss(model, padded)
    unmasked = _loss(model, {k: v for k, v in padded.items() if k != "attention_mask"})
    missing_mask = (unmasked - expected_padded).abs()  # what a dropped padding mask changes
    assert missing_mask > 0
    got_plain, got_padded = _alongside_a_paused_forward(model, plain, padded)
    assert (got_padded - expected_padded).abs() < missing_mask / 10
    assert (got_plain - expected_plain).abs() < missing_mask / 10
