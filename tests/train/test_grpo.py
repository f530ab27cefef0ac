"""FastGRPOTrainer on the tiny default (CPU): a data set without prompts, or a reward function that needs a
column the data set lacks, is refused before TRL builds anything; a reward function that raises or returns
the wrong number of values stops training with its name and the offending row; completions are generated
under FastLanguageModel.for_inference and training resumes in training mode; time in generation, scoring
and training is logged per step; with beta > 0 the reference is the same weights (no copy) and KL is logged."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from notebookkit.train import (  # noqa: E402
    FastGRPOTrainer,
    GRPOInputError,
    RewardFunctionError,
    correctness_reward,
    format_reward,
)
from notebookkit.train.grpo import TIME_KEYS  # noqa: E402

from .tiny_models import tiny_model as _model  # noqa: E402

ROWS = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
        for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]


pytestmark = pytest.mark.usefixtures("one_thread")


def _config(tmp_path, **kw):
    from trl import GRPOConfig

    base = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                max_completion_length=6, learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
                use_cpu=True, bf16=False, fp16=False, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    base.update(kw)
    return GRPOConfig(**base)


def _trainer(tmp_path, reward_funcs, rows=ROWS, model=None, keep_generation_cache=None, **config):
    if model is None:
        model, tok = _model()
    else:
        model, tok = model
    return FastGRPOTrainer(model=model, reward_funcs=reward_funcs, args=_config(tmp_path, **config),
                           train_dataset=Dataset.from_list(rows), processing_class=tok, show_banner=False,
                           keep_generation_cache=keep_generation_cache)


def test_a_data_set_without_prompts_is_refused(tmp_path):
    rows = [{"question": "What is 1 + 2?", "answer": "3"}]
    with pytest.raises(GRPOInputError) as info:
        _trainer(tmp_path, [format_reward], rows)
    message = str(info.value)
    assert "train_dataset has the columns ['question', 'answer']; GRPOTrainer needs a 'prompt' column" in message
    assert "(missing: ['prompt'])" in message and "passed to the reward functions under its name" in message
    assert "{'prompt': [{'role': 'user', 'content': row['question']}]}" in message


def test_prompts_of_the_wrong_form_are_refused(tmp_path):
    with pytest.raises(GRPOInputError, match=r"train_dataset\[0\]\['prompt'\] is a int"):
        _trainer(tmp_path, [format_reward], [{"prompt": 7, "answer": "3"}])
    with pytest.raises(GRPOInputError, match="has no 'role' and 'content'"):
        _trainer(tmp_path, [format_reward], [{"prompt": [{"from": "human", "value": "hi"}], "answer": "3"}])


def test_a_reward_needing_a_missing_column_is_refused_before_training(tmp_path):
    model = _model()
    rows = [{"prompt": r["prompt"]} for r in ROWS]  # no 'answer'
    with pytest.raises(RewardFunctionError) as info:
        _trainer(tmp_path, [format_reward, correctness_reward], rows, model=model)
    assert "'correctness_reward' needs ['answer']" in str(info.value)
    assert list(model[0].peft_config) == ["default"]


def test_a_raising_reward_stops_training_with_its_name_and_row(tmp_path):
    def strict_reward(completions, answer, **kwargs):
        return [{"3": 0.0}[a] for a in answer]  # KeyError on the rows of 'What is 3 + 4?'

    # two prompts x four completions per step: 3 + 4's rows come first or second, by the shuffle
    trainer = _trainer(tmp_path, [strict_reward], ROWS[:2], per_device_train_batch_size=8)
    with pytest.raises(RewardFunctionError) as info:
        trainer.train()
    message = str(info.value)
    assert "'strict_reward' raised KeyError: '7' on row " in message
    assert "on row 0 of 8" in message or "on row 4 of 8" in message
    assert "prompts: 'What is 3 + 4?'" in message and "completions: " in message and "answer: '7'" in message
    assert isinstance(info.value.__cause__, KeyError)


def test_a_reward_depending_on_the_whole_batch_is_reported_as_such(tmp_path):
    def batch_reward(completions, answer, **kwargs):
        return [0.0 if a == answer[0] else float({}[a]) for a in answer]

    trainer = _trainer(tmp_path, [batch_reward], ROWS[:2], per_device_train_batch_size=8)
    with pytest.raises(RewardFunctionError, match="on a batch of 8 completions, but not on any single row of it"):
        trainer.train()


def test_a_reward_returning_the_wrong_count_stops_training(tmp_path):
    def short_reward(completions, **kwargs):
        return [0.0] * (len(completions) - 1)

    trainer = _trainer(tmp_path, [short_reward])
    with pytest.raises(RewardFunctionError, match=r"'short_reward' returned 3 values for 4 completions"):
        trainer.train()


def test_generation_runs_under_for_inference_and_time_is_logged(tmp_path, monkeypatch):
    model, tok = _model()
    seen = []
    generate = model.generate

    def watched_generate(*args, **kwargs):
        base = model.get_base_model()
        seen.append((model.training, base.config.use_cache))
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", watched_generate)
    trainer = _trainer(tmp_path, [format_reward, correctness_reward], model=(model, tok))
    trainer.train()
    assert seen and all(state == (False, True) for state in seen)  # eval mode, KV cache on
    assert model.training and model.get_base_model().config.use_cache is False  # back to training
    rows = [h for h in trainer.state.log_history if "loss" in h]
    assert len(rows) == 2
    for row in rows:
        assert all(row[key] > 0 for key in TIME_KEYS), row
        for key in ("reward", "reward_std", "rewards/format_reward/mean", "rewards/correctness_reward/mean",
                    "completions/mean_length"):
            assert key in row, key


def test_kl_reference_is_the_same_weights(tmp_path):
    model, tok = _model()
    parameters = sum(p.numel() for p in model.parameters())
    trainer = _trainer(tmp_path, [format_reward], model=(model, tok), beta=0.1)
    assert trainer.ref_model is None and list(model.peft_config) == ["default"]
    assert sum(p.numel() for p in model.parameters()) == parameters
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    kl = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    assert len(kl) == 2 and abs(kl[0]) < 1e-6 and all(torch.isfinite(torch.tensor(kl)))
    # generation, scoring and the reference pass read Hugging Face's checkpointing flag: a notebook's training
    # cell shows no FutureWarning about its deprecated name (TRL reads the old one)
    deprecated = [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert not deprecated, deprecated[:1]


def test_a_model_without_adapters_and_a_kl_term_is_refused(tmp_path):
    with pytest.raises(ValueError, match="TRL would load a second full copy") as info:
        _trainer(tmp_path, [format_reward], model=_model(adapters=False), beta=0.1)
    assert "GRPOConfig(beta=0.0)" in str(info.value)


def _cache_of(model):
    from notebookkit.models.generation.state import generation_state

    return generation_state(model).cache


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_generation_cache_is_kept_or_freed_between_steps(tmp_path, monkeypatch, keep, device):
    """On CUDA the decode step is a captured graph: freed with the cache, captured again for the next step."""
    cuda = device == "cuda"
    model, tok = _model(dtype=torch.bfloat16 if cuda else None)
    caches = []
    generate = model.generate

    def watched_generate(*args, **kwargs):
        out = generate(*args, **kwargs)
        caches.append(_cache_of(model))
        return out

    monkeypatch.setattr(model, "generate", watched_generate)
    flags = dict(use_cpu=False, bf16=True) if cuda else {}
    trainer = _trainer(tmp_path, [format_reward], model=(model, tok), keep_generation_cache=keep, **flags)
    trainer.train()
    assert len(caches) == 2 and all(c is not None for c in caches)  # the fast decode path made a cache each time
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    if keep:
        assert _cache_of(model) is caches[0] is caches[1]  # one cache, reused by the second step
    else:
        assert _cache_of(model) is None and caches[0] is not caches[1]  # freed after each generation


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_offloaded_plan_keeps_its_pinned_buffers_across_steps(tmp_path, device):
    """TRL turns checkpointing off and on around every generation and scoring pass, and the guard applies the
    same plan again: with its offload state, so a later step allocates no pinned memory (on CUDA, torch's
    pinned-memory counter; session 43 measured 18 cudaHostAlloc and 16 cudaFreeHost a step, 0.52 s of a 0.77 s
    training half, when each re-application gave the buffers back).

    The generation cache is kept: with it freed, each step captures its decode graphs again, and after a capture
    torch's pinned allocator gives back its cached staging blocks, so the step's three small device-to-host reads
    (generate's returned length, TRL's masked index and its ``.item()``) each make a cudaHostAlloc and a
    cudaFreeHost (session 47 measured 3 of each a step that way, and none with the cache kept)."""
    from transformers import TrainerCallback

    from notebookkit import FastLanguageModel
    from notebookkit.models.patching import checkpointing as ckpt

    cuda = device == "cuda"
    model, tok = _model(dtype=torch.bfloat16 if cuda else None)
    FastLanguageModel.for_training(model, "offload")  # recompute on a CPU
    base = model.get_base_model()
    state, pinned = ckpt._offload_states[base], []

    class PinnedBlocks(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            pool = ckpt._offload_states[base].get("pool")
            count = torch.cuda.host_memory_stats()["num_host_alloc"] if cuda else 0
            pinned.append((count, id(pool), getattr(pool, "allocations", None)))

    flags = dict(use_cpu=False, bf16=True, max_steps=3) if cuda else {}
    trainer = _trainer(tmp_path, [format_reward], model=(model, tok), keep_generation_cache=True, **flags)
    trainer.add_callback(PinnedBlocks())
    trainer.train()
    assert ckpt._offload_states[base] is state
    if cuda:
        # the last step made no pinned block: torch's count of cudaHostAlloc calls did not grow, and the plan kept
        # the same offload pool, which allocated nothing either
        assert pinned[-1] == pinned[-2], f"(cudaHostAlloc calls, pool id, pool allocations) after each step: {pinned}"


def test_the_cache_rule_follows_the_activation_plan(tmp_path):
    from notebookkit.memory.generation import keeps_cache_between_steps
    from notebookkit.models.patching.checkpointing import apply_checkpointing

    assert keeps_cache_between_steps(["keep", "keep"]) and keeps_cache_between_steps("keep")
    assert not keeps_cache_between_steps(["keep", "offload"]) and not keeps_cache_between_steps("recompute")
    model, tok = _model()  # CPU: "auto" keeps every activation
    assert _trainer(tmp_path, [format_reward], model=(model, tok)).keep_generation_cache is True
    model, tok = _model()
    apply_checkpointing(model, True)  # recompute every layer: memory is short, the cache goes after generating
    assert _trainer(tmp_path, [format_reward], model=(model, tok)).keep_generation_cache is False
