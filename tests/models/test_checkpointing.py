"""Gradient checkpointing modes give the same gradients as no checkpointing (CPU)."""

from __future__ import annotations

import contextlib
import copy
import warnings
from types import SimpleNamespace

import pytest
import torch

from notebookkit.kernels.testing import rel_err
from notebookkit.memory import PinnedBufferPool
from notebookkit.models.patching import checkpointing as ckpt
from notebookkit import compat
from notebookkit.models.common.banner import Banner
from notebookkit.models.patching import forward_state
from notebookkit.models import patch_model
from notebookkit.models.patching.checkpointing import _HostCopy, apply_checkpointing, normalize_mode, offload_checkpoint

from .helpers import random_model
from .test_patch_parity import _lora


def _grads(model, x, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=x, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_mode_names():
    assert normalize_mode("unsloth") == "offload" and normalize_mode("offload_mlp") == "offload_mlp"
    assert normalize_mode(True) == "recompute"
    assert normalize_mode(False) == "none"
    with pytest.raises(ValueError):
        normalize_mode("maybe")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("plan", [True, ["keep", "recompute"], "offload", "direct-offload-function"])
def test_checkpointed_grads_match(plan, family):
    base = random_model(family, attention_dropout=0.0)
    patch_model(base)
    ref = _lora(base)
    ref.train()
    model = copy.deepcopy(ref)
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 12))
    labels = x.clone()
    labels[:, :3] = -100
    loss_ref, g_ref = _grads(ref, x, labels)
    if plan == "direct-offload-function":
        # The offload autograd function itself (on CPU the input stays on the device).
        apply_checkpointing(model, True)
        calls = []

        def counted(*args, **kwargs):
            calls.append(1)
            return offload_checkpoint(*args, keep_on_device=False, state={}, **kwargs)

        for layer in model.get_base_model().model.layers:
            compat.set_layer_checkpoint_function(layer, counted)
    else:
        apply_checkpointing(model, plan)
    layers = model.get_base_model().model.layers
    assert any(layer.gradient_checkpointing for layer in layers)
    loss, g = _grads(model, x, labels)
    if plan == "direct-offload-function":
        assert len(calls) == len(layers)
    assert torch.allclose(loss, loss_ref, rtol=1e-6)
    for n in g_ref:
        assert rel_err(g[n], g_ref[n]) < 1e-5, n


@pytest.mark.parametrize("plan", [True, "offload"])
def test_a_first_layer_without_adapters_recomputes_without_an_input_gradient(plan):
    """The first layer's input (the frozen embeddings' output) needs no gradient, so its recompute computes none
    (the q/k/v input gradient a kept layer skips too); a layer with nothing to train there still back-propagates
    nothing without error, and the other layers' gradients are those of no checkpointing."""
    from peft import LoraConfig, get_peft_model

    base = random_model("llama", attention_dropout=0.0)
    patch_model(base)
    torch.manual_seed(1)
    ref = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                          lora_dropout=0.0, layers_to_transform=[1]))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    ref.train()
    model = copy.deepcopy(ref)
    x = torch.randint(0, 256, (2, 12))
    loss_ref, g_ref = _grads(ref, x, x)
    apply_checkpointing(model, plan)
    seen = []
    hook = model.get_base_model().model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs.get("hidden_states", args[0] if args else None)).requires_grad),
        with_kwargs=True)
    loss, g = _grads(model, x, x)
    hook.remove()
    assert seen == [False, False]  # the first forward, then the recompute: no gradient asked of its input
    assert torch.allclose(loss, loss_ref, rtol=1e-6) and g_ref
    for n in g_ref:
        assert rel_err(g[n], g_ref[n]) < 1e-5, n


def test_trainer_cannot_silently_replace_our_mode():
    model = _lora(random_model("llama"))
    apply_checkpointing(model, ["recompute", "keep"])
    base = model.get_base_model()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert [layer.gradient_checkpointing for layer in base.model.layers] == [True, False]


@pytest.mark.parametrize("family,skipped", [("llama", True), ("qwen3", True), ("gemma2", False)])
def test_recompute_skips_the_unread_down_projection(family, skipped, monkeypatch):
    """A recomputed layer runs gate and up again but not down, unless a post-MLP norm reads its output."""
    import notebookkit.kernels.lora_mlp as lora_mlp_module

    base = random_model(family, attention_dropout=0.0)
    patch_model(base)
    model = _lora(base)
    model.train()
    layers = model.get_base_model().model.layers
    apply_checkpointing(model, True)
    calls = []  # one entry per projection computed (gate and up through the shared-input dispatch)
    real_down = lora_mlp_module.projection_forward
    real_shared = lora_mlp_module.shared_input_forward
    monkeypatch.setattr(lora_mlp_module, "projection_forward", lambda *a, **k: calls.append(1) or real_down(*a, **k))
    monkeypatch.setattr(lora_mlp_module, "shared_input_forward",
                        lambda x2d, projs, *rest: calls.extend([1] * len(projs)) or real_shared(x2d, projs, *rest))
    x = torch.randint(0, 256, (2, 12))
    model(input_ids=x, labels=x).loss.backward()
    per_layer = 3 + (2 if skipped else 3)  # forward, then the recompute in backward
    assert len(calls) == per_layer * len(layers)
    assert forward_state.unread_output() is None and forward_state.current() is None  # nothing left behind


@pytest.mark.parametrize("family,parks", [("llama", True), ("gemma2", False)])
def test_offload_mlp_takes_the_parked_gate_up_with_the_recompute_bits(family, parks, monkeypatch):
    """"offload_mlp": each layer's first forward parks its MLP's e, g (on a CPU kept as they are) and the
    backward takes them instead of running gate and up again; loss and gradients are recompute's bit for bit.
    A post-MLP norm (Gemma 2) reads the MLP output: the mode offloads the inputs only."""
    import notebookkit.kernels.lora_mlp as lora_mlp_module

    base = random_model(family, attention_dropout=0.0)
    patch_model(base)
    ref = _lora(base)
    ref.train()
    model = copy.deepcopy(ref)
    apply_checkpointing(ref, True)
    banner = Banner()
    assert apply_checkpointing(model, "offload_mlp", banner=banner) == ("offload_mlp" if parks else "recompute")
    assert ("stay in memory" if parks else "plain recompute") in banner.features["checkpointing"][1]
    x = torch.randint(0, 256, (2, 12))
    loss_ref, g_ref = _grads(ref, x, x)
    products = []  # gate/up products (the shared-input dispatch) during the step
    real_shared = lora_mlp_module.shared_input_forward
    monkeypatch.setattr(lora_mlp_module, "shared_input_forward",
                        lambda x2d, projs, *rest: products.append(1) or real_shared(x2d, projs, *rest))
    loss, g = _grads(model, x, x)
    layers = len(model.get_base_model().model.layers)
    assert len(products) == (1 if parks else 2) * layers  # the first forward only, or again in the recompute
    assert torch.equal(loss, loss_ref)
    for n in g_ref:
        assert torch.equal(g[n], g_ref[n]), n
    assert forward_state.parked_mlp() is None


def test_offload_state_uses_its_buffer_pool_from_the_first_empty_state():
    state: dict = {}
    pool = ckpt._pool(state)
    assert isinstance(pool, PinnedBufferPool) and len(pool) == 0  # empty, so falsy: still the pool
    assert ckpt._pool(state) is pool and ckpt._pool({"pool": False}) is None


def test_pinned_buffers_go_back_to_the_host_before_an_export_and_on_a_replan(tmp_path, monkeypatch):
    """The merged and GGUF exports and a re-plan drop the model's pooled pinned buffers and empty PyTorch's cache of
    freed pinned memory (a T4 host has 12.7 GB; a parked 8B plan pins 4.5 GiB); for_inference, which GRPO runs
    every step, keeps them for the next training step."""
    from notebookkit import FastLanguageModel

    emptied = []
    monkeypatch.setattr(compat, "empty_pinned_host_cache", lambda: emptied.append(True))
    model, tokenizer = FastLanguageModel.from_pretrained("notebookkit/tiny-llama", show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=4, use_gradient_checkpointing="offload", show_banner=False)

    def filled_pool() -> PinnedBufferPool:
        """The model's offload pool as a training step leaves it: one buffer free for the next step."""
        pool = ckpt._pool(ckpt._offload_states[model.get_base_model()])
        pool.release(pool.acquire((1024,), torch.float32))
        return pool

    FastLanguageModel.for_training(model)
    pool = filled_pool()
    held = pool.held_bytes
    FastLanguageModel.for_inference(model)
    assert pool.held_bytes == held and not emptied
    for done in (lambda m: m.save_pretrained_merged(tmp_path / "merged", tokenizer),
                 lambda m: m.save_pretrained_gguf(tmp_path / "gguf", tokenizer, quantization_method="q8_0"),
                 lambda m: apply_checkpointing(m, ["keep"] + ["recompute"] * (len(m.get_base_model().model.layers) - 1))):
        FastLanguageModel.for_training(model)
        pool, count = filled_pool(), len(emptied)
        assert pool.held_bytes >= 4096
        done(model)
        assert pool.held_bytes == 0 and len(emptied) == count + 1


def test_the_same_plan_applied_again_keeps_its_pinned_buffers(monkeypatch):
    """TRL turns checkpointing off around every generation and every scoring forward of a GRPO step and back on
    (``trl.models.utils.disable_gradient_checkpointing``), as DPO's reference forward does
    (``notebookkit.train.reference``), and the guard re-applies the recorded plan. The same plan
    keeps its offload state and pooled pinned buffers: giving them back each step cost GRPO's training half about
    0.5 s in ``cudaHostAlloc`` / ``cudaFreeHost`` (1B on an H100, session 43)."""
    from trl.models.utils import disable_gradient_checkpointing

    from notebookkit import FastLanguageModel
    from notebookkit.train.reference import _checkpointing_off

    emptied = []
    monkeypatch.setattr(compat, "empty_pinned_host_cache", lambda: emptied.append(True))
    model, _ = FastLanguageModel.from_pretrained("notebookkit/tiny-llama", show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=4, use_gradient_checkpointing="offload", show_banner=False)
    base = model.get_base_model()
    state, plan = ckpt._offload_states[base], ckpt.recorded_activation_plan(base)
    pool = ckpt._pool(state)
    pool.release(pool.acquire((1024,), torch.float32))
    for off in (lambda: disable_gradient_checkpointing(model, None), lambda: _checkpointing_off(model, None)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with off():
                assert not compat.is_checkpointing(base)
        assert compat.is_checkpointing(base) and ckpt.recorded_activation_plan(base) == plan
        assert ckpt._offload_states[base] is state and pool.held_bytes >= 4096 and not emptied
    # ours switches by the current names (TRL's, above, by the aliases that warn of their removal)
    assert not [w for w in caught if "deprecated" in str(w.message)]


# ---- offloaded inputs: copies ordered by events, never by host waits (CUDA faked on CPU) ----------


class _Stream:
    """Stands in for a CUDA stream: logs what it is told to wait for."""

    def __init__(self, name):
        self.name, self.waited = name, []

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        self.waited.append(event)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CPU tensors with CUDA's stream/event calls faked; logs host waits and device syncs."""
    log = SimpleNamespace(side=_Stream("side"), current=_Stream("current"), host_waits=[], device_syncs=[])

    class Event:
        def record(self, stream):
            self.stream = stream

        def synchronize(self):
            log.host_waits.append(self)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: log.current)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.device_syncs.append(device))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(ckpt, "_side_stream", lambda device: log.side)
    return log


def test_offloaded_input_comes_back_without_a_host_wait(fake_cuda):
    state: dict = {}
    x = torch.randn(4, 8)
    first = _HostCopy(x, state)
    assert isinstance(first.pool, PinnedBufferPool)  # the pool is used from its first (empty) state
    out = first.fetch()
    assert fake_cuda.host_waits == [] and fake_cuda.device_syncs == []
    assert torch.equal(out, x)
    ready = first.ready
    assert ready.stream is fake_cuda.side and fake_cuda.current.waited == [ready]
    assert first.stored.stream is fake_cuda.side
    # The next copy to the host reuses the buffer; its stream waits on the GPU for the copy back.
    second = _HostCopy(torch.randn(4, 8), state)
    assert second.pool is first.pool and first.pool.allocations == 1
    assert fake_cuda.side.waited == [ready] and fake_cuda.host_waits == []


@pytest.mark.parametrize("prefetched", [False, True])
def test_input_dropped_without_backward_frees_its_buffer_without_a_sync(fake_cuda, prefetched):
    state: dict = {}
    copy_ = _HostCopy(torch.randn(4, 8), state)
    if prefetched:
        copy_.prefetch()
    last = copy_.ready if prefetched else copy_.stored  # the later copy; both run on the side stream
    pool = copy_.pool
    del copy_
    assert fake_cuda.device_syncs == [] and fake_cuda.host_waits == []
    assert pool.in_use_bytes == 0
    _HostCopy(torch.randn(4, 8), state)
    assert fake_cuda.side.waited == [last] and pool.allocations == 1


def test_without_a_pool_the_plain_pinned_copy_still_waits_before_it_is_freed(fake_cuda, monkeypatch):
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))  # no pinning on CPU
    copy_ = _HostCopy(torch.randn(4, 8), {"pool": False})
    assert copy_.pool is None
    copy_.fetch()
    assert fake_cuda.host_waits == [copy_.ready]



def test_parked_mlp_tiles_go_to_the_host_and_come_back_in_order_without_a_host_wait(fake_cuda):
    """offload_mlp's store on CUDA: each tile's e and g copied to pooled pinned buffers; taking a tile waits on
    the GPU for its copy back and starts the next tile's; the buffers go back to the pool."""
    state: dict = {}
    parked = ckpt._ParkedMLP(state, to_host=True)
    tiles = [(torch.randn(3, 5), torch.randn(3, 5)) for _ in range(2)]
    for e, g in tiles:
        parked.put(e, g)
    assert parked.stored is parked.tiles[-1][1].stored  # the last copy to the host: the next layer waits on it
    parked.prefetch()
    first_ready = [copy.ready for copy in parked.tiles[0]]
    assert all(r is not None for r in first_ready) and parked.tiles[1][0].ready is None
    for i, (e, g) in enumerate(tiles):
        got = parked.take()
        assert torch.equal(got[0], e) and torch.equal(got[1], g)
        assert all(copy.ready is not None for copy in parked.tiles[0]) if i == 0 else not parked.tiles
    assert parked.take() is None
    assert fake_cuda.current.waited[:2] == first_ready and len(fake_cuda.current.waited) == 4
    assert fake_cuda.host_waits == [] and fake_cuda.device_syncs == []
    pool = ckpt._pool(state)
    assert pool.in_use_bytes == 0 and pool.allocations == 4


def test_parking_stops_with_one_warning_where_host_ram_runs_short(fake_cuda):
    """A tile whose pinned copy the pool refuses (HostMemoryError) is not kept, nor is any later one of the run: the
    backward gets the tiles kept before it, then None (it computes the rest again); one warning says so."""
    tile = torch.randn(4, 8)
    state = {"pool": PinnedBufferPool(max_bytes=3 * tile.numel() * 4, granularity=1)}  # room for e, g and one more
    first = ckpt._ParkedMLP(state, to_host=True)
    with pytest.warns(UserWarning, match="compute them again") as caught:
        first.put(tile, tile + 1)
        first.put(tile + 2, tile + 3)  # e fits, g does not: e's buffer goes back
        later = ckpt._ParkedMLP(state, to_host=True)
        later.put(tile, tile)
    assert len(caught) == 1 and later.tiles == []
    e, g = first.take()
    assert torch.equal(e, tile) and torch.equal(g, tile + 1) and first.take() is None
    assert state["pool"].in_use_bytes == 0


def test_a_parked_layer_waits_for_the_copies_of_the_one_two_before(fake_cuda):
    """The third parked layer's stream waits for the first one's copies to the host (not the second's, which run
    behind it): one layer's e, g in flight at most; so does the host, so the allocator can hand the first
    layer's freed blocks to the third (no reserve growing a layer at a time)."""
    state: dict = {}
    stores = [ckpt._ParkedMLP(state, to_host=True) for _ in range(4)]
    for store in stores:
        ckpt._pace_parked_copies(state, store, fake_cuda.current)
        store.put(torch.randn(2, 3), torch.randn(2, 3))
    assert fake_cuda.current.waited == [stores[0].stored, stores[1].stored]
    assert fake_cuda.host_waits == [stores[0].stored, stores[1].stored]
    ends = [torch.cuda.Event() for _ in range(4)]
    for end in ends:  # the backward: the host waits for the end of the parked layer two above
        ckpt._pace_parked_backward(state, end)
    assert fake_cuda.host_waits[2:] == ends[:2]


def test_auto_plan_is_remade_for_a_larger_training_batch(monkeypatch, capsys):
    """``get_peft_model`` sizes an "auto" plan for one row; the first training forward of a larger batch
    (GRPO's prompts x generations), of a padded one, or of one with more images re-plans before any layer runs, the Trainer's own
    ``gradient_checkpointing_enable`` keeps that ability, smaller batches keep the plan, and a plan
    chosen by hand is never changed. (On CPU "auto" never checkpoints, so the planner is stood in for:
    "keep" up to 64 tokens, "recompute" above.)"""
    planned = []

    def fake_auto_plan(model, seq_len=None, batch_size=None, max_memory=None, padded=False, images_per_row=None):
        tokens = (seq_len or 2048) * (batch_size or 1)
        planned.append(tokens)
        return ["keep" if tokens <= 64 else "recompute"] * 2, f"auto (fake) for {tokens}", None

    monkeypatch.setattr(ckpt, "auto_plan", fake_auto_plan)
    base = random_model("llama")
    patch_model(base)
    model = _lora(base)
    model.train()
    apply_checkpointing(model, "auto", seq_len=16, batch_size=1)
    assert ckpt.recorded_activation_plan(base) == "none"
    base.gradient_checkpointing_enable()  # what the Trainer does at the start of train()
    model(input_ids=torch.randint(0, 256, (2, 16)), labels=torch.randint(0, 256, (2, 16)))  # 32 tokens: as planned
    assert ckpt.recorded_activation_plan(base) == "none"
    x = torch.randint(0, 256, (4, 24))
    model(input_ids=x, labels=x).loss.backward()
    assert ckpt.recorded_activation_plan(base) == ["recompute", "recompute"]
    assert [layer.gradient_checkpointing for layer in base.model.layers] == [True, True]
    assert "re-made for training batches of 4 x 24 tokens" in capsys.readouterr().out
    with torch.no_grad():  # generation and evaluation do not re-plan
        base.eval()
        base(input_ids=torch.randint(0, 256, (8, 32)))
        base.train()
    assert planned[-1] == 96
    model(input_ids=x[:, :8], labels=x[:, :8])  # smaller: kept
    assert planned[-1] == 96
    assert not ckpt.auto_plan_size(base).padded
    mask = torch.ones_like(x[:, :8])
    model(input_ids=x[:, :8], attention_mask=mask, labels=x[:, :8])  # no padding: kept
    assert len(planned) == 3
    mask[0, -3:] = 0  # a padded batch of fewer tokens: planned again, for the larger token count and padding
    model(input_ids=x[:, :8], attention_mask=mask, labels=x[:, :8])
    assert len(planned) == 4 and planned[-1] == 96 and ckpt.auto_plan_size(base).padded
    model(input_ids=x[:, :8], attention_mask=mask, labels=x[:, :8])  # padded again: kept
    assert len(planned) == 4
    # more images than planned for (a vision-language batch): planned again
    ckpt.fit_plan_to_batch(base, 4, 8, images=ckpt.auto_plan_size(base).images + 1)
    assert len(planned) == 5
    apply_checkpointing(model, True)  # by hand: a larger batch changes nothing
    model(input_ids=torch.randint(0, 256, (8, 32)), labels=torch.randint(0, 256, (8, 32)))
    assert planned[-1] == 96 and ckpt.recorded_activation_plan(base) == ["recompute", "recompute"]
