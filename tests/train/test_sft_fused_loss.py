"""SFT under TRL's SFTTrainer runs notebookkit's fused linear cross-entropy (CPU, tiny default).

TRL 1.15+ computes the SFT loss with its own chunked LM head (``add_fused_lm_head``), bypassing
the model's loss; ``FastSFTTrainer`` (what ``make_sft_trainer`` builds) routes the training loss
back through the model's fused cross-entropy. These tests prove that it does (a counting probe on
the fused kernel and a hook on ``lm_head``), that a plain ``trl.SFTTrainer`` does not (so the probe
catches the old behaviour), and that the loss and its gradients equal TRL's, with gradient
accumulation and with completion-only / assistant-only labels.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl")

from notebookkit.models import FastLanguageModel  # noqa: E402
from notebookkit.models.common.banner import get_banner  # noqa: E402
from notebookkit.base_layers import kernel_ops  # noqa: E402
from notebookkit.models.patching.patch_lm_head import trl_own_lm_head  # noqa: E402

KEY = ("fused_linear_cross_entropy", "fused_linear_cross_entropy")
FEATURE = "fused CE loss"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Probe:
    """Counts fused-CE calls and records the shape of every ``lm_head`` output."""

    def __init__(self) -> None:
        self.fused_calls = 0
        self.lm_head_shapes: list[tuple[int, ...]] = []

    def reset(self) -> None:
        self.fused_calls = 0
        self.lm_head_shapes = []


def _load(monkeypatch, probe: Probe, family: str = "llama"):
    """Tiny model + LoRA whose patched head calls a counting wrapper of the fused kernel."""
    real = kernel_ops.kernel(*KEY)
    assert real is not None

    def counting(*args, **kwargs):
        probe.fused_calls += 1
        return real(*args, **kwargs)

    # the patched forward looks the kernel up when it is built, so the probe goes in before loading
    monkeypatch.setitem(kernel_ops._cache, KEY, counting)
    model, tok = FastLanguageModel.from_pretrained(
        f"notebookkit/tiny-{family}", max_seq_length=64, load_in_4bit=False, show_banner=False
    )
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, show_banner=False)
    lm_head = model.get_base_model().get_output_embeddings()
    lm_head.register_forward_hook(lambda _m, _i, out: probe.lm_head_shapes.append(tuple(out.shape)))
    return model, tok


def _chat(n: int):
    from notebookkit.data.bundled import load_bundled

    return load_bundled("chat_messages").select(range(n))


def _prompt_completion(n: int):
    from datasets import Dataset

    from notebookkit.data.bundled import load_bundled

    rows = load_bundled("alpaca").select(range(n))
    return Dataset.from_list([{"prompt": r["instruction"] + "\n", "completion": r["output"]} for r in rows])


def _config(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
        max_length=64, learning_rate=1e-3, warmup_steps=0, seed=0, logging_steps=1, disable_tqdm=True,
    )
    base.update(kw)
    return base


def _rel(a, b) -> float:
    a, b = float(a), float(b)
    return abs(a - b) / max(abs(b), 1e-12)


def _full_logits_loss(model, inputs, num_items_in_batch) -> torch.Tensor:
    """TRL's SFT loss written out on the full logits: sum of -log p over shifted labels / N (float64)."""
    call = {k: v for k, v in inputs.items() if k != "labels"}
    call["use_cache"] = False
    logits = model(**call).logits.double()
    labels = inputs["labels"][:, 1:]
    total = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    n = (labels != -100).sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
    return total / n.clamp(min=1).double()


def test_sft_trainer_runs_the_fused_ce_and_never_builds_full_logits(tmp_path, monkeypatch, capsys):
    from trl import SFTConfig, SFTTrainer

    from notebookkit.train.sft import make_sft_trainer

    probe = Probe()
    model, tok = _load(monkeypatch, probe)
    trainer = make_sft_trainer(
        model, tok, _chat(8), _chat(2), responses_only=True, **_config(tmp_path, gradient_accumulation_steps=2)
    )
    out = capsys.readouterr().out
    assert f"[on ] {FEATURE}" in out and "mean_token_accuracy" in out
    assert trainer.fused_loss_off is None
    probe.reset()
    trainer.train()
    # 2 optimizer steps x 2 micro-batches, each loss by the fused kernel; lm_head never ran
    assert probe.fused_calls == 4, probe.fused_calls
    assert probe.lm_head_shapes == [], probe.lm_head_shapes
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert all(h["num_tokens"] > 0 for h in logs)  # the dashboard's tokens/s source is kept
    assert not any("mean_token_accuracy" in h or "entropy" in h for h in logs)  # disabled, as the banner says
    assert get_banner(model).is_on(FEATURE)
    assert "FastSFTTrainer" in get_banner(model).line(FEATURE)

    # evaluation runs TRL's head: no crash, its metrics are there
    probe.reset()
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and "eval_mean_token_accuracy" in metrics
    assert probe.lm_head_shapes == []

    # the old behaviour (a plain trl.SFTTrainer) never calls the fused kernel: the probe catches it
    if trl_own_lm_head() is not None:
        plain = SFTTrainer(
            model=model, args=SFTConfig(**_config(tmp_path / "plain", max_steps=1, use_cpu=True, report_to="none")),
            train_dataset=_chat(4), processing_class=tok,
        )
        probe.reset()
        plain.train()
        assert probe.fused_calls == 0 and probe.lm_head_shapes == []


@pytest.mark.parametrize(
    "data, accumulation, family",
    [("chat_responses_only", 2, "llama"), ("prompt_completion", 1, "llama"), ("prompt_completion", 2, "gemma2")],
)
def test_fused_loss_equals_trls_loss(tmp_path, monkeypatch, data, accumulation, family):
    from trl import SFTTrainer

    from notebookkit.train.sft import make_sft_trainer

    probe = Probe()
    model, tok = _load(monkeypatch, probe, family)
    dataset = _chat(8) if data == "chat_responses_only" else _prompt_completion(8)
    trainer = make_sft_trainer(
        model, tok, dataset, responses_only=data == "chat_responses_only", show_banner=False,
        **_config(tmp_path, max_steps=1, gradient_accumulation_steps=accumulation),
    )
    assert trainer.fused_loss_off is None
    real = trainer.compute_loss
    records = []

    def spy(model, inputs, return_outputs=False, num_items_in_batch=None):
        calls = probe.fused_calls
        loss = real(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        assert probe.fused_calls == calls + 1
        with torch.no_grad():
            trl_loss = SFTTrainer.compute_loss(trainer, model, dict(inputs), num_items_in_batch=num_items_in_batch)
            full = _full_logits_loss(model, inputs, num_items_in_batch)
        labels = inputs["labels"][:, 1:]
        masked = int((inputs["labels"] == -100).sum())
        records.append((loss.detach(), trl_loss, full, num_items_in_batch, int((labels != -100).sum()), masked))
        return loss

    trainer.compute_loss = spy
    trainer.train()
    assert len(records) == accumulation
    for loss, trl_loss, full, _, _, masked in records:
        assert loss.dtype == torch.float32
        assert _rel(loss, full) < 1e-5, (float(loss), float(full))
        assert _rel(loss, trl_loss) < 1e-5, (float(loss), float(trl_loss))
        assert masked > 0  # prompt / user tokens are really masked out
    n_items = records[0][3]
    if accumulation > 1:
        # normalised by the label count of the whole accumulated step, not per micro-batch
        assert n_items is not None and int(n_items) == sum(r[4] for r in records)
        assert all(int(r[3]) == int(n_items) for r in records)


def _loss_and_grads(trainer, inputs, n_items):
    """``compute -> (loss, every trainable parameter's gradient, flat)`` of one micro-batch in training mode."""
    model = trainer.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(compute):
        model.zero_grad(set_to_none=True)
        loss = compute(trainer, model, dict(inputs), num_items_in_batch=n_items)
        loss.backward()
        return loss.detach(), torch.cat([p.grad.reshape(-1) for p in params])

    return grads


def test_fused_loss_gradients_equal_trls(tmp_path, monkeypatch):
    from trl import SFTTrainer

    from notebookkit.train.sft import make_sft_trainer

    probe = Probe()
    model, tok = _load(monkeypatch, probe)
    trainer = make_sft_trainer(
        model, tok, _prompt_completion(4), show_banner=False, **_config(tmp_path, max_steps=1)
    )
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    n_items = (inputs["labels"][:, 1:] != -100).sum() + 3  # any N: both divide by it
    grads = _loss_and_grads(trainer, inputs, n_items)
    probe.reset()
    ours, g_ours = grads(type(trainer).compute_loss)
    assert probe.fused_calls == 1
    theirs, g_theirs = grads(SFTTrainer.compute_loss)
    assert probe.fused_calls == 1  # TRL's head does not use the kernel
    assert _rel(ours, theirs) < 1e-5
    assert g_theirs.norm() > 0
    assert float((g_ours - g_theirs).norm() / g_theirs.norm()) < 1e-5


def test_moe_router_loss_stays_on_the_fused_path_and_equals_trls(tmp_path, monkeypatch):
    """TRL turns a mixture of experts' router loss on by default (its coefficient from the config); the fused
    path adds it in the model's head as TRL does, ``coef * aux / accumulation steps``: loss and every LoRA
    gradient (attention and experts) equal TRL's own head, at a coefficient where the router loss moves both."""
    from trl import SFTTrainer

    from notebookkit.train.sft import make_sft_trainer

    probe = Probe()
    model, tok = _load(monkeypatch, probe, "qwen3_moe")
    trainer = make_sft_trainer(model, tok, _prompt_completion(4), show_banner=False, router_aux_loss_coef=0.5,
                               **_config(tmp_path, max_steps=1, gradient_accumulation_steps=2))
    assert trainer.aux_loss_enabled and trainer.fused_loss_off is None
    trainer.current_gradient_accumulation_steps = 2  # what the training loop sets for this step
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    n_items = (inputs["labels"][:, 1:] != -100).sum() * 2
    grads = _loss_and_grads(trainer, inputs, n_items)
    probe.reset()
    ours, g_ours = grads(type(trainer).compute_loss)
    assert probe.fused_calls == 1
    theirs, g_theirs = grads(SFTTrainer.compute_loss)
    trainer.router_aux_loss_coef, trainer.aux_loss_enabled = 0.0, False
    without, g_without = grads(SFTTrainer.compute_loss)
    assert _rel(ours, theirs) < 1e-5 and _rel(without, theirs) > 1e-3  # the router loss is a visible share
    assert float((g_ours - g_theirs).norm() / g_theirs.norm()) < 1e-5
    assert float((g_without - g_theirs).norm() / g_theirs.norm()) > 1e-3
    assert trainer._metrics["train"]["aux_loss"]  # logged as TRL logs it


def test_settings_that_need_trls_head_fall_back_and_say_so(tmp_path, monkeypatch, capsys):
    from notebookkit.train.sft import make_sft_trainer

    probe = Probe()
    model, tok = _load(monkeypatch, probe)
    trainer = make_sft_trainer(model, tok, _prompt_completion(4), loss_type="dft", **_config(tmp_path, max_steps=1))
    out = capsys.readouterr().out
    assert f"[off] {FEATURE}" in out and "dft" in out
    assert not get_banner(model).is_on(FEATURE)
    probe.reset()
    trainer.train()
    assert probe.fused_calls == 0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 1 and "mean_token_accuracy" in logs[0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_sft_trainer_fused_loss_matches_trls_head(tmp_path, monkeypatch, dtype):
    """On CUDA the fused kernel runs Triton (chunked, no [N, V] logits); loss within 16-bit tolerance of TRL's."""
    from trl import SFTTrainer

    from notebookkit.train.sft import make_sft_trainer

    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    probe = Probe()
    real = kernel_ops.kernel(*KEY)

    def counting(*args, **kwargs):
        probe.fused_calls += 1
        return real(*args, **kwargs)

    monkeypatch.setitem(kernel_ops._cache, KEY, counting)
    model, tok = FastLanguageModel.from_pretrained(
        "notebookkit/tiny-llama", max_seq_length=64, load_in_4bit=False, dtype=dtype, show_banner=False
    )
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, show_banner=False)
    model.get_base_model().get_output_embeddings().register_forward_hook(
        lambda _m, _i, out: probe.lm_head_shapes.append(tuple(out.shape))
    )
    trainer = make_sft_trainer(
        model, tok, _chat(8), responses_only=True, show_banner=False,
        **_config(tmp_path, max_steps=2, gradient_accumulation_steps=2),
    )
    assert trainer.fused_loss_off is None
    real_loss = trainer.compute_loss
    pairs = []

    def spy(model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = real_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        with torch.no_grad():
            theirs = SFTTrainer.compute_loss(trainer, model, dict(inputs), num_items_in_batch=num_items_in_batch)
        pairs.append((float(loss), float(theirs)))
        return loss

    trainer.compute_loss = spy
    probe.reset()
    trainer.train()
    assert probe.fused_calls == 4 and probe.lm_head_shapes == []
    assert len(pairs) == 4
    for ours, theirs in pairs:
        assert math.isfinite(ours) and _rel(ours, theirs) < 1e-2, pairs
