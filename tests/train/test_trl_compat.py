"""TRL's private names that notebookkit's trainers use (:mod:`notebookkit.train.trl_compat`) are still there
and behave as they did on the versions read: each test fails when an installed TRL changes."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from trl import DPOTrainer, GRPOTrainer, SFTTrainer  # noqa: E402

from notebookkit.train import trl_compat  # noqa: E402

from ..models.helpers import tiny_folder  # noqa: E402

GRPO_HOOKS = ("_generate_single_turn", "_generate_and_score_completions", "_get_per_token_logps_and_entropies")


@pytest.mark.parametrize("hook", GRPO_HOOKS)
def test_grpo_hook_points_exist_and_route_to_public_names(hook):
    """Each hook is a method of TRL's GRPOTrainer; the mixin's hook wins over it and its public names are
    not TRL's (an override cannot shadow something TRL has)."""
    from notebookkit.train import FastGRPOTrainer

    assert callable(getattr(GRPOTrainer, hook))
    assert getattr(FastGRPOTrainer, hook) is getattr(trl_compat.GRPOHookPoints, hook)
    public = {"_generate_single_turn": "generate_single_turn",
              "_generate_and_score_completions": "generate_and_score_completions",
              "_get_per_token_logps_and_entropies": "per_token_logps_and_entropies"}[hook]
    for name in (public, f"trl_{public}"):
        assert not hasattr(GRPOTrainer, name)


def test_hook_points_call_the_override_and_trl_s_own():
    """A private hook runs the public override; ``trl_<name>`` runs the next class in the MRO (TRL's)."""

    class TRLLike:
        def _generate_single_turn(self, *args, **kwargs):
            return ("trl", args, kwargs)

    class Trainer(trl_compat.GRPOHookPoints, TRLLike):
        def generate_single_turn(self, *args, **kwargs):
            return ("ours", self.trl_generate_single_turn(*args, **kwargs))

    assert Trainer()._generate_single_turn(1, x=2) == ("ours", ("trl", (1,), {"x": 2}))

    class Plain(trl_compat.GRPOHookPoints, TRLLike):  # no override: TRL's own
        pass

    assert Plain()._generate_single_turn(1, x=2) == ("trl", (1,), {"x": 2})


def test_grpo_and_dpo_set_the_names_read_in_their_source():
    """The counters and switches are set in TRL's own ``__init__`` / ``training_step`` (read in its source)."""
    import inspect

    grpo = inspect.getsource(GRPOTrainer)
    assert "self._step" in grpo and "self._metrics" in grpo and "self._entropy_bonus_enabled" in grpo
    dpo = inspect.getsource(DPOTrainer)
    for name in ("self._is_vision_dataset", "self._total_train_tokens", "self._tp_size", "self._metrics"):
        assert name in dpo
    assert "self._total_train_tokens" in inspect.getsource(SFTTrainer)


def test_trl_token_count_is_the_one_sft_trainer_keeps(tmp_path):
    """TRL's own ``compute_loss`` and :func:`trl_compat.trl_add_train_tokens` log the same ``num_tokens``."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    folder = tiny_folder("llama")
    tok = AutoTokenizer.from_pretrained(folder)
    data = Dataset.from_list([{"text": "a short line of text"}, {"text": "and one more, a little longer"}])

    def trainer(out):
        args = SFTConfig(output_dir=str(tmp_path / out), per_device_train_batch_size=2, max_length=32,
                         use_cpu=True, report_to="none", disable_tqdm=True)
        return SFTTrainer(model=AutoModelForCausalLM.from_pretrained(folder), args=args, train_dataset=data,
                          processing_class=tok)

    trl_side, ours = trainer("trl"), trainer("ours")
    assert trl_compat.trl_counts_train_tokens(trl_side) and trl_compat.trl_counts_train_tokens(ours)
    batch = next(iter(trl_side.get_train_dataloader()))
    trl_side.model.train()  # a training step's compute_loss
    trl_side.compute_loss(trl_side.model, dict(batch))
    trl_compat.trl_add_train_tokens(ours, int(batch["attention_mask"].sum()))
    trl_compat.trl_add_train_tokens(ours, 0)
    expected = trl_side._metrics["train"]["num_tokens"]
    assert expected == [int(batch["attention_mask"].sum())]
    assert ours._metrics["train"]["num_tokens"] == expected
    assert not trl_compat.trl_counts_train_tokens(object())
