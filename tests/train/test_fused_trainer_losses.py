"""The fused ``_loss`` of FastDPOTrainer, FastORPOTrainer and FastGRPOTrainer against TRL's own loss on the same
batch (tiny default, CPU, fp32): the loss value, every LoRA gradient and every metric TRL logs agree (1e-5
relative); the batches are padded (pairs and completions of different lengths, masked prompt positions); the
LM head's module forward is never called on the fused path (no ``[B, T, V]`` logits); a setting the fused path
does not implement runs TRL's computation with one warning naming it. On the GPU (``pytest -m gpu``) the same
DPO and GRPO comparisons in bf16 and fp16, with 16-bit tolerances."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from notebookkit.kernels.testing import rel_err  # noqa: E402
from notebookkit.train import FastDPOTrainer, FastGRPOTrainer, FastORPOTrainer, ORPOConfig  # noqa: E402

from .test_dpo import PAIRS, _common, _dpo_config  # noqa: E402
from .tiny_models import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-5  # fp32: both paths sum the same terms in a different order; measured differences are ~1e-7


def _move_adapters(model, seed: int = 0, scale: float = 0.05) -> None:
    """Give lora_B values (as after some training), so policy != reference and every LoRA matrix gets a gradient."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name and "ref" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def _lora_params(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _loss_grads_metrics(trainer, compute):
    """``(loss, {name: grad}, {metric: value})`` of one call of ``compute()`` on a fresh metric store."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    for store in trainer._metrics.values():
        store.clear()
    if hasattr(trainer, "_total_train_tokens"):
        trainer._total_train_tokens = 0  # DPO's running token count
    loss = compute()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in _lora_params(model)}
    mode = "train" if model.training else "eval"
    metrics = {k: list(v) for k, v in trainer._metrics[mode].items()}
    return loss.detach(), grads, metrics


def _assert_equal_paths(ours, theirs, skip_metrics=()):
    loss, grads, metrics = ours
    trl_loss, trl_grads, trl_metrics = theirs
    assert torch.isfinite(loss) and rel_err(loss, trl_loss) < RTOL, (loss.item(), trl_loss.item())
    assert grads.keys() == trl_grads.keys() and grads
    moved = 0
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        assert rel_err(grad, trl_grads[name]) < RTOL, f"{name}: {rel_err(grad, trl_grads[name]):.2e}"
        moved += int(trl_grads[name].abs().sum() > 0)
    assert moved == len(grads), "every LoRA matrix should get a gradient in these cases"
    expected = {k: v for k, v in trl_metrics.items() if k not in skip_metrics}
    assert sorted(metrics) == sorted(trl_metrics), (sorted(metrics), sorted(trl_metrics))
    for key, values in expected.items():
        assert len(metrics[key]) == len(values), key
        for ours_value, trl_value in zip(metrics[key], values):
            assert not math.isnan(ours_value), key
            assert ours_value == pytest.approx(trl_value, rel=RTOL, abs=1e-6), (key, ours_value, trl_value)


def _no_lm_head_forward(model):
    """A forward hook on the LM head that records every call (the fused path must make none)."""
    calls = []
    head = model.get_base_model().get_output_embeddings()
    return calls, head.register_forward_hook(lambda module, args, out: calls.append(tuple(args[0].shape)))


def _fused_without_lm_head(trainer, batch):
    """:func:`_loss_grads_metrics` of the trainer's own (fused) ``compute_loss``, asserting that it never
    called the LM head's module forward."""
    calls, hook = _no_lm_head_forward(trainer.model)
    try:
        ours = _loss_grads_metrics(trainer, lambda: trainer.compute_loss(trainer.model, batch))
    finally:
        hook.remove()
    assert calls == [], calls
    return ours


# ---------------------------------------------------------------------------------- DPO

def _device_config(dtype) -> dict:
    """Trainer flags for a CPU run (``dtype`` None: fp32) or a CUDA run in ``dtype``."""
    if dtype is None:
        return {}
    return dict(use_cpu=False, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)


def _dpo_trainer(tmp_path, dtype=None, **config):
    model, tok = tiny_model(dtype=dtype)
    config = {**_device_config(dtype), **config}
    rows = [dict(PAIRS[0], chosen=PAIRS[0]["chosen"] + " It is ripe and sweet."), *PAIRS[1:]]
    trainer = FastDPOTrainer(model=model, args=_dpo_config(tmp_path, per_device_train_batch_size=4, **config),
                             train_dataset=Dataset.from_list(rows), processing_class=tok, show_banner=False)
    _move_adapters(model)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    return trainer, batch


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", ["sigmoid", "ipo"]])
def test_dpo_fused_loss_grads_and_metrics_equal_trl(tmp_path, loss_type):
    from trl import DPOTrainer

    trainer, batch = _dpo_trainer(tmp_path, loss_type=loss_type, loss_weights=[1.0, 0.5] if isinstance(loss_type, list) else None)
    assert trainer._fused_unsupported(batch) is None
    padded = batch["attention_mask"] == 0
    assert padded.any() and (batch["completion_mask"] == 0).any()  # padding and masked prompts are in the batch
    ours = _fused_without_lm_head(trainer, batch)  # the LM head's forward never ran: no [2P, T, V] logits
    theirs = _loss_grads_metrics(trainer, lambda: DPOTrainer.compute_loss(trainer, trainer.model, batch))
    _assert_equal_paths(ours, theirs)
    assert abs(ours[2]["rewards/margins"][0]) > 1e-4  # policy != reference: the comparison is not of zeros


def test_dpo_reference_is_trl_frozen_copy_of_a_trained_adapter(tmp_path):
    from trl import DPOTrainer

    model, tok = tiny_model()
    _move_adapters(model, seed=3)  # trained before DPO: TRL keeps a frozen "ref" copy, the fused path must use it
    trainer = FastDPOTrainer(model=model, args=_dpo_config(tmp_path, per_device_train_batch_size=4),
                             train_dataset=Dataset.from_list(PAIRS), processing_class=tok, show_banner=False)
    assert "ref" in model.peft_config
    _move_adapters(model, seed=4)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    ours = _loss_grads_metrics(trainer, lambda: trainer.compute_loss(trainer.model, batch))
    theirs = _loss_grads_metrics(trainer, lambda: DPOTrainer.compute_loss(trainer, trainer.model, batch))
    _assert_equal_paths(ours, theirs)
    ref_ours = trainer.compute_ref_log_probs(trainer.model, batch)
    ref_trl = DPOTrainer.compute_ref_log_probs(trainer, trainer.model, batch)
    for a, b in zip(ref_ours, ref_trl):
        assert rel_err(a, b) < RTOL


def _falls_back_once(trainer, batch, trl_loss, setting):
    """Two fused-path calls on an unsupported setting: one warning naming it; the loss, gradients and
    metrics are TRL's (``trl_loss()`` computes TRL's own)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = _loss_grads_metrics(trainer, lambda: trainer.compute_loss(trainer.model, batch))
        trainer.compute_loss(trainer.model, batch)
    said = [str(w.message) for w in caught if "TRL's own computation" in str(w.message)]
    assert len(said) == 1 and setting in said[0], said
    _assert_equal_paths(ours, _loss_grads_metrics(trainer, trl_loss))


def test_dpo_unsupported_setting_falls_back_with_one_warning(tmp_path):
    from trl import DPOTrainer

    trainer, batch = _dpo_trainer(tmp_path, loss_type="hinge")
    _falls_back_once(trainer, batch, lambda: DPOTrainer.compute_loss(trainer, trainer.model, batch),
                     "DPOConfig(loss_type=['hinge'])")


# ---------------------------------------------------------------------------------- ORPO

@pytest.mark.parametrize("mode", ["train", "eval"])
def test_orpo_fused_loss_grads_and_metrics_equal_trl(tmp_path, mode):
    from notebookkit.train.orpo import orpo_trainer_class

    model, tok = tiny_model()
    _move_adapters(model)
    trainer = FastORPOTrainer(model=model, args=ORPOConfig(**_common(tmp_path, per_device_train_batch_size=4)),
                              train_dataset=Dataset.from_list(PAIRS), processing_class=tok, show_banner=False)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert (batch["chosen_attention_mask"] == 0).any() or (batch["rejected_attention_mask"] == 0).any()
    calls, hook = _no_lm_head_forward(model)
    try:
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch, train_eval=mode)
    finally:
        hook.remove()
    assert calls == []  # TRL's own path runs the LM head on every position ([2P, T, V] logits)
    grads = torch.autograd.grad(loss, [p for _, p in _lora_params(model)])
    trl_loss, trl_metrics = orpo_trainer_class().get_batch_loss_metrics(trainer, trainer.model, batch, train_eval=mode)
    trl_grads = torch.autograd.grad(trl_loss, [p for _, p in _lora_params(model)])
    assert rel_err(loss, trl_loss) < RTOL
    for (name, _), g, r in zip(_lora_params(model), grads, trl_grads):
        assert r.abs().sum() > 0 and rel_err(g, r) < RTOL, name
    assert sorted(metrics) == sorted(trl_metrics) and (mode == "train") != all(k.startswith("eval_") for k in metrics)
    for key, value in trl_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=RTOL, abs=1e-6), key
    # and the trainer's compute_loss (the training step's entry) stores the same metrics
    trainer.compute_loss(trainer.model, batch)
    if mode == "train":
        assert {k: v[-1] for k, v in trainer._stored_metrics["train"].items()} == pytest.approx(metrics, rel=RTOL)


# ---------------------------------------------------------------------------------- GRPO

GRPO_ROWS = [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in [
    ("What is 1 + 2?", "3"), ("Add four and three, then tell me the sum please.", "7"),
]]


def _length_reward(completions, **kwargs):
    """Rewards that differ within a group (so advantages have both signs)."""
    return [float(len(str(c))) for c in completions]


def _grpo_trainer(tmp_path, dtype=None, **config):
    from trl import GRPOConfig

    model, tok = tiny_model(dtype=dtype)
    base = dict(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                max_completion_length=7, learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
                use_cpu=True, bf16=False, fp16=False, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    base.update(_device_config(dtype), **config)
    trainer = FastGRPOTrainer(model=model, reward_funcs=[_length_reward], args=GRPOConfig(**base),
                              train_dataset=Dataset.from_list(GRPO_ROWS), processing_class=tok, show_banner=False)
    _move_adapters(model)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by train()
    rows = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._generate_and_score_completions(rows)
    # a completion that stopped early: its tail is masked (the masks are inputs, equal for both paths)
    inputs["completion_mask"][0, -3:] = 0
    g = torch.Generator().manual_seed(5)
    logps = inputs.get("ref_per_token_logps")
    if logps is None:
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].size(1))
    # an older policy: ratios away from 1, so both clip sides act
    inputs["old_per_token_logps"] = logps.detach() + 0.4 * torch.randn(logps.shape, generator=g).to(logps)
    return trainer, inputs


def _trl_scoring(trainer):
    """The trainer with TRL's own scoring method (its fused LM head) bound in place of notebookkit's."""
    import types

    from trl import GRPOTrainer

    trainer._get_per_token_logps_and_entropies = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, trainer)
    return trainer


@pytest.mark.parametrize("loss_type, beta, epsilon_high", [("dapo", 0.0, None), ("grpo", 0.04, None),
                                                             ("dr_grpo", 0.04, 0.28)])
def test_grpo_fused_loss_grads_and_metrics_equal_trl(tmp_path, loss_type, beta, epsilon_high):
    from trl import GRPOTrainer

    trainer, inputs = _grpo_trainer(tmp_path, loss_type=loss_type, beta=beta, epsilon_high=epsilon_high)
    assert (inputs["prompt_mask"] == 0).any() and (inputs["completion_mask"] == 0).any()  # padded, masked
    assert (inputs["advantages"] > 0).any() and (inputs["advantages"] < 0).any()
    assert ("ref_per_token_logps" in inputs) == (beta > 0)
    assert trainer._loss_unsupported(inputs) is None
    ours = _fused_without_lm_head(trainer, inputs)
    _trl_scoring(trainer)
    theirs = _loss_grads_metrics(trainer, lambda: GRPOTrainer.compute_loss(trainer, trainer.model, inputs))
    _assert_equal_paths(ours, theirs)
    assert ours[2]["clip_ratio/region_mean"][0] > 0  # clipping acted
    if beta:
        assert ours[2]["kl"][0] > 0


def test_grpo_scoring_equals_trl_for_policy_and_reference(tmp_path):
    """The old-policy / reference scoring TRL runs after generation (chunked batches, adapters off)."""
    from trl import GRPOTrainer
    from trl.trainer.utils import use_adapter

    trainer, inputs = _grpo_trainer(tmp_path, beta=0.04)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    keep = inputs["completion_ids"].size(1)
    for adapters in (True, False):
        with torch.no_grad(), (use_adapter(trainer.model, None) if not adapters else torch.enable_grad()):
            ours = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep, batch_size=3,
                                                              compute_entropy=True)
            theirs = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, keep,
                                                                    batch_size=3, compute_entropy=True)
        assert rel_err(ours[0], theirs[0]) < RTOL and rel_err(ours[1], theirs[1]) < RTOL and ours[2] is None
    kept = inputs["completion_mask"].bool()  # the test masked a tail after TRL's step scored it
    assert rel_err(ours[0][kept], inputs["ref_per_token_logps"][kept]) < RTOL  # TRL's step stored the adapters-off score


def test_grpo_unsupported_loss_type_falls_back_with_one_warning(tmp_path):
    from trl import GRPOTrainer

    trainer, inputs = _grpo_trainer(tmp_path, loss_type="bnpo")
    _falls_back_once(trainer, inputs, lambda: GRPOTrainer.compute_loss(_trl_scoring(trainer), trainer.model, inputs),
                     "GRPOConfig(loss_type='bnpo')")


# ---------------------------------------------------------------------------------- on the GPU

def _assert_close_in_16_bit(ours, theirs):
    """16-bit: the loss within 2% of TRL's, every LoRA gradient pointing the same way (cosine > 0.99) and of
    the same size (within 5%), every metric finite. TRL's path rounds its [B, T, V] logits to 16 bits, the
    fused path accumulates each chunk in fp32, so both carry 16-bit noise of their own."""
    loss, grads, metrics = ours
    trl_loss, trl_grads, _ = theirs
    assert torch.isfinite(loss) and abs(loss.item() - trl_loss.item()) <= 2e-2 * max(abs(trl_loss.item()), 1e-3)
    assert grads.keys() == trl_grads.keys() and grads
    for name, grad in grads.items():
        a, b = grad.float().flatten(), trl_grads[name].float().flatten()
        assert torch.isfinite(a).all(), name
        cosine = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
        assert cosine > 0.99 and abs(a.norm().item() / b.norm().item() - 1) < 0.05, (name, cosine)
    assert all(not math.isnan(v) for values in metrics.values() for v in values)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_dpo_fused_loss_matches_trl(tmp_path, dtype):
    from trl import DPOTrainer

    trainer, batch = _dpo_trainer(tmp_path, dtype=dtype)
    assert next(trainer.model.parameters()).device.type == "cuda"
    ours = _fused_without_lm_head(trainer, batch)  # the Triton log-prob kernel, never [B, T, V] logits
    _assert_close_in_16_bit(ours, _loss_grads_metrics(trainer, lambda: DPOTrainer.compute_loss(trainer, trainer.model,
                                                                                                 batch)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_grpo_fused_loss_matches_trl(tmp_path, dtype):
    from trl import GRPOTrainer

    trainer, inputs = _grpo_trainer(tmp_path, dtype=dtype, loss_type="dapo", beta=0.04)
    assert inputs["completion_ids"].device.type == "cuda"  # generated on the decode path, on the GPU
    ours = _fused_without_lm_head(trainer, inputs)
    _trl_scoring(trainer)
    _assert_close_in_16_bit(ours, _loss_grads_metrics(trainer, lambda: GRPOTrainer.compute_loss(trainer, trainer.model,
                                                                                                  inputs)))
