"""One forward pass builds each layer's LoRA views and adapter casts once.

PEFT keeps adapters in fp32 under 16-bit weights, so the fused kernels cast ``A`` and ``B`` to the
compute dtype. Before, every use cast again: the forward, the checkpointing recompute and the
backward (six casts per adapted projection per step, each a launch). Now the patched backbone opens a
forward pass, the recompute re-enters it, and the views (with their casts) are reused: each
adapter is read into the compute dtype once per step, and each projection's view is built once.
Projections sharing an input (q/k/v, gate/up) read their ``A`` into one concatenated ``A_cat``
(``lora_projection.adapter_group``) instead of casting each. From the second pass on, all of a pass's casts are
made in one batch, one ``_foreach_copy_`` into one buffer (``models.patching.adapter_casts``). The steps still
train the updated adapters: the casts follow the optimizer's in-place updates.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from notebookkit.kernels import lora_projection
from notebookkit.kernels.lora_projection import LoRAProjection
from notebookkit.models.patching import lora_fast_path
from notebookkit.models import patch_model
from notebookkit.models.patching.checkpointing import apply_checkpointing

from .helpers import random_model
from .test_patch_parity import _lora


def _bf16_lora_model(family: str, checkpointing: str):
    model = random_model(family).to(torch.bfloat16)
    patch_model(model)
    model = _lora(model)  # PEFT keeps the adapters in fp32 under bf16 weights
    model.train()
    apply_checkpointing(model, checkpointing)
    return model


def _adapters(model):
    return [p for n, p in model.named_parameters() if "lora_" in n]


@pytest.mark.parametrize("checkpointing", ["recompute", "offload", False])
def test_adapters_cast_once_and_views_built_once_per_step(checkpointing, monkeypatch):
    model = _bf16_lora_model("llama", checkpointing)
    adapters = _adapters(model)
    assert adapters and all(p.dtype == torch.float32 for p in adapters)
    ptrs = {p.data_ptr() for p in adapters}
    n_layers = model.config.num_hidden_layers
    opt = torch.optim.AdamW(adapters, lr=1e-2)
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))

    casts, builds, concats, batched = [], [], [], []
    real_to = torch.Tensor.to
    real_view = lora_fast_path.projection_view
    real_concat = lora_projection.concat_adapters
    real_foreach_copy = torch._foreach_copy_

    def spy_to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if self.data_ptr() in ptrs and out.dtype == torch.bfloat16:
            casts.append(self.data_ptr())
        return out

    def spy_view(module, training=None):
        builds.append(id(module))
        return real_view(module, training)

    def spy_concat(As, dtype):
        concats.append([A.data_ptr() for A in As])
        return real_concat(As, dtype)

    def spy_foreach_copy(copies, sources):
        batched.append([t.data_ptr() for t in sources if t.data_ptr() in ptrs])
        return real_foreach_copy(copies, sources)

    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    monkeypatch.setattr(lora_fast_path, "projection_view", spy_view)
    monkeypatch.setattr(lora_projection, "concat_adapters", spy_concat)
    monkeypatch.setattr(torch, "_foreach_copy_", spy_foreach_copy)
    for step in range(3):
        casts.clear(), builds.clear(), concats.clear(), batched.clear()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert len(builds) == 7 * n_layers, f"{len(builds)} view builds in one step"
        if step == 0:
            # Per layer, 7 adapted projections: one A_cat for q/k/v and one for gate/up; the Bs of those
            # five and A, B of o and down cast once (before grouping: 14 casts).
            assert len(concats) == 2 * n_layers, f"{len(concats)} A_cat builds in one step"
            assert len(casts) == (5 + 2 * 2) * n_layers, f"{len(casts)} adapter casts in one step"
            assert sorted(casts + [p for group in concats for p in group]) == sorted(ptrs)  # each adapter once
            assert batched == []
        else:  # the pass casts in one batch what the previous pass cast (adapter_casts): every adapter once
            assert concats == [] and casts == [], f"{len(concats)} A_cat builds, {len(casts)} casts one at a time"
            assert len(batched) == 1 and sorted(batched[0]) == sorted(ptrs)


def test_steps_follow_the_optimizer_updates():
    """Two steps with views kept per pass give the same losses and adapters as with views rebuilt on
    every call (no pass reuse): nothing stale survives an optimizer step."""
    model = _bf16_lora_model("llama", "offload")
    twin = copy.deepcopy(model)
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(1))

    def train(m, reuse: bool):
        opt = torch.optim.AdamW(_adapters(m), lr=5e-2)
        losses = []
        for _ in range(3):
            loss = m(input_ids=ids, labels=ids).loss if reuse else _forward_without_pass(m, ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in _adapters(m)]

    losses, weights = train(model, True)
    twin_losses, twin_weights = train(twin, False)
    assert losses[0] != losses[-1]  # the adapters did change
    assert losses == twin_losses
    for a, b in zip(weights, twin_weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _forward_without_pass(model, ids):
    """The model's forward with the backbone opening no pass: every views() call builds anew."""
    from notebookkit.models.patching import patch_lm_head

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(patch_lm_head, "forward_pass", lambda **_: contextlib.nullcontext(None))
        return model(input_ids=ids, labels=ids).loss


def test_projection_recasts_after_an_in_place_update():
    torch.manual_seed(0)
    W = torch.randn(12, 10, dtype=torch.bfloat16)
    A, B = torch.randn(3, 10), torch.randn(12, 3)
    proj = LoRAProjection(W, None, A, B, 0.5)
    a1, b1 = proj.adapters(torch.bfloat16)
    assert proj.adapters(torch.bfloat16)[0] is a1  # kept
    with torch.no_grad():
        A.mul_(2.0)  # what an optimizer step does: in place, version counter bumped
    a2, b2 = proj.adapters(torch.bfloat16)
    assert a2 is not a1 and torch.equal(a2, A.to(torch.bfloat16)) and torch.equal(b2, B.to(torch.bfloat16))
    assert proj.adapters(torch.float32)[0] is A  # already in the compute dtype: no copy


@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16], ids=["fp32_adapters", "bf16_adapters"])
def test_kept_copies_are_what_the_memory_model_counts(adapter_dtype):
    """After a step, the compute-dtype copies kept on the layers' projections (adapter casts and the
    grouped A_cat) are the memory model's "compute-dtype copies", byte for byte."""
    from notebookkit.memory import estimate_training_memory

    model = _bf16_lora_model("llama", "recompute")
    with torch.no_grad():
        for p in _adapters(model):
            p.data = p.data.to(adapter_dtype)
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, labels=ids).loss.backward()

    kept = {}
    for module in model.modules():
        views_kept = module.__dict__.get(lora_fast_path._VIEWS_KEPT)
        if views_kept is None or views_kept.result[0] is None:
            continue
        for view in views_kept.result[0]:
            proj = view.projection
            tensors = [cast for _, _, cast in proj._adapter_casts.values()]
            tensors += [proj._group_cast[3]] if proj._group_cast is not None else []
            kept.update({t.data_ptr(): t.numel() * t.element_size() for t in tensors})
    est = estimate_training_memory(model.config, dtype="bfloat16", lora_r=4, adapter_dtype=str(adapter_dtype))
    assert sum(kept.values()) == est.details.get("adapters + optimizer: compute-dtype copies", 0) > 0


def _without_batches(monkeypatch_context):
    """No pass makes a batch (``adapter_casts``): every cast one at a time, as before batching."""
    monkeypatch_context.setattr(lora_fast_path, "pass_casts", lambda forward: None)


def test_batched_casts_train_as_one_at_a_time_with_a_reference_pass_and_two_forwards():
    """DPO's and GRPO's pattern (a pass with the adapters disabled between the policy forward and its backward) and
    two forwards before one backward give the same losses and adapters, bit for bit, with the casts batched as
    without; from the second step on the policy's pass batches every adapter's cast."""
    model = _bf16_lora_model("llama", "offload")
    twin = copy.deepcopy(model)
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    ptrs = {p.data_ptr() for p in _adapters(model)}
    batched = []
    real_foreach_copy = torch._foreach_copy_

    def spy_foreach_copy(copies, sources):
        batched.append({t.data_ptr() for t in sources} & ptrs)
        return real_foreach_copy(copies, sources)

    def train(m):
        opt = torch.optim.AdamW(_adapters(m), lr=5e-2)
        losses = []
        for _ in range(3):
            batched.clear()
            policy = m(input_ids=ids, labels=ids).loss
            with torch.no_grad(), m.disable_adapter():
                reference = m(input_ids=ids, labels=ids).loss
            again = m(input_ids=ids[:, :16], labels=ids[:, :16]).loss  # a second forward before the backward
            (policy - reference + again).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(policy.item())
        return losses, [p.detach().clone() for p in _adapters(m)], list(batched)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "_foreach_copy_", spy_foreach_copy)
        losses, weights, last_batches = train(model)
        _without_batches(mp)
        twin_losses, twin_weights, twin_batches = train(twin)
    assert last_batches and all(b == ptrs for b in last_batches)  # each pass with adapters: all of them at once
    assert twin_batches == []
    assert losses[0] != losses[-1] and losses == twin_losses
    for a, b in zip(weights, twin_weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _vision_step_casts(monkeypatch, reuse: bool):
    """Two training steps of the tiny Qwen2.5-VL (bf16, fp32 adapters on both towers, Hugging Face's checkpointing
    of the tower's blocks): the adapter casts made one at a time in the second, and its gradients."""
    from notebookkit import FastVisionModel
    from notebookkit.data import VisionDataCollator
    from notebookkit.embedded.bundled import load_bundled
    from notebookkit.models.patching import adapter_casts

    if not reuse:
        monkeypatch.setattr(lora_fast_path, "reuse_latest_copies", lambda views: None)
    model, processor = FastVisionModel.from_pretrained("notebookkit/tiny-qwen2.5-vl", dtype=torch.bfloat16,
                                                       load_in_4bit=False, show_banner=False)
    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=4, finetune_vision_layers=True,
                                           use_gradient_checkpointing=True, random_state=0, show_banner=False).train()
    rows = load_bundled("captions")
    batch = VisionDataCollator(model.get_base_model(), processor, max_seq_length=256)([rows[0], rows[1]])
    adapters = _adapters(model)
    ptrs = {p.data_ptr() for p in adapters}
    casts = []
    real_to = torch.Tensor.to

    def spy_to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if self.data_ptr() in ptrs and out.dtype == torch.bfloat16:
            casts.append(self.data_ptr())
        return out

    model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "to", spy_to)
        model(**batch).loss.backward()
    adapter_casts._last_batch = None  # the next model's test starts from no batch
    return casts, [p.grad.clone() for p in adapters]


def test_a_vision_towers_recompute_reads_the_passs_copies(monkeypatch):
    """Hugging Face's checkpointing runs the tower's blocks again in the backward, after the forward pass ended:
    their adapted linears read the copies of the pass's batch (adapter_casts.reuse_latest_copies) and cast
    nothing one at a time; the gradients are those of casting each again."""
    casts, grads = _vision_step_casts(monkeypatch, reuse=True)
    assert casts == [], f"{len(casts)} adapter casts one at a time in the second step"
    with monkeypatch.context() as m:
        plain_casts, plain = _vision_step_casts(m, reuse=False)
    assert plain_casts  # the recompute cast its adapters again without the reuse
    for a, b in zip(grads, plain):
        assert torch.equal(a, b)
