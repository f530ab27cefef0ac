"""FastDPOTrainer and FastORPOTrainer on the tiny default (CPU): bad preference data is refused before TRL
builds anything, with the missing columns and the expected format named; the DPO reference is the same
weights with the adapters disabled (no second model, no adapter copy while the adapter is fresh); the loss
goes through the one ``_loss`` seam; IPO and ORPO train."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from notebookkit.train import FastDPOTrainer, FastORPOTrainer, ORPOConfig, PreferenceInputError  # noqa: E402

from .tiny_models import tiny_model as _model  # noqa: E402

PAIRS = [
    {"prompt": "What colour is a banana?", "chosen": "A banana is yellow.", "rejected": "A banana is blue."},
    {"prompt": "How many legs does a cat have?", "chosen": "A cat has 4 legs.", "rejected": "A cat has 2 legs."},
    {"prompt": "What do we use our eyes for?", "chosen": "We use our eyes to see.", "rejected": "I do not know."},
    {"prompt": "What colour is the sky?", "chosen": "The sky is blue.", "rejected": "The sky is green."},
]


pytestmark = pytest.mark.usefixtures("one_thread")


def _common(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, learning_rate=5e-3,
                logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
                dataloader_num_workers=0, seed=0, max_length=48, bf16=False, fp16=False)
    base.update(kw)
    return base


def _dpo_config(tmp_path, **kw):
    from trl import DPOConfig

    return DPOConfig(**_common(tmp_path, **kw))


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "loss" in h]


# ---------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("trainer", ["dpo", "orpo"])
def test_missing_column_is_named_with_the_expected_format(tmp_path, trainer):
    model, tok = _model()
    data = Dataset.from_list([{"prompt": r["prompt"], "chosen": r["chosen"]} for r in PAIRS])
    with pytest.raises(PreferenceInputError) as info:
        if trainer == "dpo":
            FastDPOTrainer(model=model, args=_dpo_config(tmp_path), train_dataset=data, processing_class=tok)
        else:
            FastORPOTrainer(model=model, args=ORPOConfig(**_common(tmp_path)), train_dataset=data, processing_class=tok)
    message = str(info.value)
    name = "DPOTrainer" if trainer == "dpo" else "ORPOTrainer"
    assert f"train_dataset has the columns ['prompt', 'chosen']; {name} needs 'prompt', 'chosen' and 'rejected' " \
           "(missing: ['rejected'])" in message
    assert "'rejected': a worse answer to the same prompt" in message
    assert "rename_columns({'<your rejected column>': 'rejected'})" in message
    assert list(model.peft_config) == ["default"]  # refused before TRL touched the model


def test_rename_hint_uses_the_columns_found(tmp_path):
    model, tok = _model()
    data = Dataset.from_list([{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in PAIRS])
    with pytest.raises(PreferenceInputError) as info:
        FastDPOTrainer(model, None, _dpo_config(tmp_path), None, data, processing_class=tok)  # positions, as TRL's
    assert "(missing: ['prompt', 'chosen', 'rejected'])" in str(info.value)
    assert "dataset.rename_columns({'question': 'prompt', 'good': 'chosen', 'bad': 'rejected'})" in str(info.value)


def test_wrong_values_and_containers_are_refused(tmp_path):
    model, tok = _model()
    config = _dpo_config(tmp_path)
    numbers = Dataset.from_list([{**r, "chosen": 1} for r in PAIRS])
    with pytest.raises(PreferenceInputError, match=r"train_dataset\[0\]\['chosen'\] is a int"):
        FastDPOTrainer(model=model, args=config, train_dataset=numbers, processing_class=tok)
    mixed = Dataset.from_list([{**r, "chosen": [{"role": "assistant", "content": r["chosen"]}]} for r in PAIRS])
    with pytest.raises(PreferenceInputError, match="'chosen' as chat and 'rejected' as text"):
        FastDPOTrainer(model=model, args=config, train_dataset=mixed, processing_class=tok)
    with pytest.raises(TypeError, match="Python list of 4 rows; DPOTrainer reads a datasets.Dataset"):
        FastDPOTrainer(model=model, args=config, train_dataset=PAIRS, processing_class=tok)
    with pytest.raises(PreferenceInputError, match="eval_dataset has no rows"):
        FastDPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(PAIRS),
                       eval_dataset=Dataset.from_list(PAIRS).select([]), processing_class=tok)


def test_a_model_without_adapters_is_refused_not_copied(tmp_path):
    model, tok = _model(adapters=False)
    with pytest.raises(ValueError, match="TRL would load a second full copy of the model") as info:
        FastDPOTrainer(model=model, args=_dpo_config(tmp_path), train_dataset=Dataset.from_list(PAIRS), processing_class=tok)
    assert "FastLanguageModel.get_peft_model" in str(info.value)


# ---------------------------------------------------------------------------------- the reference

def test_reference_is_the_base_weights_without_a_copy(tmp_path):
    model, tok = _model()
    parameters = {n: p.numel() for n, p in model.named_parameters()}
    trainer = FastDPOTrainer(model=model, ref_model=None, args=_dpo_config(tmp_path, max_steps=3),
                             train_dataset=Dataset.from_list(PAIRS * 2), processing_class=tok, show_banner=False)
    assert trainer.ref_model is None and list(model.peft_config) == ["default"]
    assert {n: p.numel() for n, p in model.named_parameters()} == parameters  # no adapter copy, no second model
    trainer.train()
    # step 1: policy == reference, so every implicit reward is exactly 0; training then separates them
    assert _logged(trainer, "rewards/chosen")[0] == 0.0 and _logged(trainer, "rewards/margins")[0] == 0.0
    assert _logged(trainer, "rewards/margins")[-1] != 0.0

    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    ref_chosen, ref_rejected = trainer.compute_ref_log_probs(trainer.model, batch)
    base, _ = _model(adapters=False)  # the same checkpoint, never trained
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(base)
    base.train()
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        logps = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                     fused_lm_head=True).log_probs.sum(1)
    torch.testing.assert_close(torch.cat([ref_chosen, ref_rejected]), logps, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        policy = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                               fused_lm_head=True).log_probs.sum(1)
    assert (policy - logps).abs().max() > 1e-3  # the adapter moved the policy; the reference did not move


def test_a_trained_adapter_keeps_trl_frozen_copy(tmp_path, capsys):
    model, tok = _model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)  # as after an SFT run: the reference must be this model, not the base
    trainer = FastDPOTrainer(model=model, args=_dpo_config(tmp_path), train_dataset=Dataset.from_list(PAIRS),
                             processing_class=tok)
    assert sorted(model.peft_config) == ["default", "ref"] and trainer.ref_model is None
    assert "reference: a frozen copy of the trained adapter (adapter 'ref')" in capsys.readouterr().out


def test_an_offloaded_plan_scores_the_reference_without_checkpointing_and_keeps_its_state(tmp_path, monkeypatch):
    """DPO's reference forward (no gradient) runs with checkpointing off; the policy's runs with the plan back on
    and the same offload state (its pinned buffers on a GPU); the losses are those of a run without checkpointing."""
    import contextlib

    from notebookkit import FastLanguageModel, compat
    from notebookkit.models.patching import checkpointing as ckpt
    from notebookkit.train import dpo as dpo_module

    losses, real = {}, dpo_module.reference_policy
    for mode in (False, "offload"):  # "offload" recomputes on a CPU
        model, tok = _model()
        FastLanguageModel.for_training(model, mode)
        base = model.get_base_model()
        state = ckpt._offload_states.get(base)
        seen = []

        @contextlib.contextmanager
        def spy(trainer, real=real, base=base, seen=seen):
            with real(trainer) as reference:
                seen.append(compat.is_checkpointing(base))
                yield reference

        monkeypatch.setattr(dpo_module, "reference_policy", spy)
        trainer = FastDPOTrainer(model=model, ref_model=None, args=_dpo_config(tmp_path / str(mode)),
                                 train_dataset=Dataset.from_list(PAIRS), processing_class=tok, show_banner=False)
        trainer.train()
        losses[mode] = _logged(trainer, "loss")
        assert seen and not any(seen)  # every reference pass ran with checkpointing off
        if mode:
            assert compat.is_checkpointing(base) and ckpt._offload_states[base] is state
    assert losses["offload"] == pytest.approx(losses[False], rel=1e-5)


# ---------------------------------------------------------------------------------- losses

def test_ipo_trains_through_the_loss_seam(tmp_path, monkeypatch):
    model, tok = _model()
    trainer = FastDPOTrainer(model=model, args=_dpo_config(tmp_path, loss_type="ipo"),
                             train_dataset=Dataset.from_list(PAIRS), processing_class=tok, show_banner=False)
    calls = []
    seam = type(trainer)._loss

    def counted(self, *args, **kwargs):
        calls.append(1)
        return seam(self, *args, **kwargs)

    monkeypatch.setattr(type(trainer), "_loss", counted)
    trainer.train()
    losses = _logged(trainer, "loss")
    assert trainer.loss_types == ["ipo"] and len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    # IPO's loss at the first step (policy == reference) is (0 - 1 / (2 beta))^2
    assert losses[0] == pytest.approx((1 / (2 * trainer.beta)) ** 2, rel=1e-5)
    assert len(calls) == 2


def test_orpo_trains_and_logs_preference_metrics(tmp_path, capsys):
    model, tok = _model()
    trainer = FastORPOTrainer(model=model, args=ORPOConfig(**_common(tmp_path, max_steps=3)),
                              train_dataset=Dataset.from_list(PAIRS * 2), processing_class=tok)
    assert "ORPO (lambda = beta = 0.1); no reference model" in capsys.readouterr().out
    trainer.train()
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "nll_loss"):
        values = _logged(trainer, key)
        assert len(values) == 3 and all(torch.isfinite(torch.tensor(values))), key
    assert list(model.peft_config) == ["default"]


def test_orpo_without_a_config_says_where_the_class_lives(tmp_path):
    model, tok = _model()
    with pytest.raises(TypeError, match=r"needs args=ORPOConfig\(\.\.\.\)"):
        FastORPOTrainer(model=model, train_dataset=Dataset.from_list(PAIRS), processing_class=tok)

