"""DPO / IPO / Robust DPO, ORPO and GRPO (grpo, dapo, dr_grpo; with and without KL; clipping active)
on notebookkit's chunked path (token_logprobs -> linear_logprobs -> rl_losses) against TRL 1.16's own
code on materialised logits: losses, gradients and logged metrics, fp32, 1e-5 relative.

TRL's losses live inside its trainers' loss methods, so the tests call those methods unbound with a
stand-in ``self`` carrying the attributes they read and a stand-in model that materialises the
logits and scores them with TRL's ``selective_log_softmax`` / ``entropy_from_logits``, i.e. the
non-fused reference computation (trl/trainer/utils.py:538, :604). Called, in the installed
trl-1.16.0 (site-packages/trl/...):

* DPO:  ``DPOTrainer._compute_loss``                      trainer/dpo_trainer.py:1285 (losses :1386-1519,
  metrics :1575-1599), with ``precompute_ref_logps`` (reference log-probs in the batch, :1318).
* ORPO: ``ORPOTrainer.get_batch_loss_metrics``            experimental/orpo/orpo_trainer.py:824, which runs
  ``concatenated_forward`` (:745, its chosen NLL over prompt + completion), ``get_batch_logps`` (:705,
  average log-prob) and ``odds_ratio_loss`` (:670).
* GRPO: ``GRPOTrainer._compute_loss``                     trainer/grpo_trainer.py:3020 (ratio and clip
  :3082-3121, k3 KL :3093-3101, normalisations :3149-3180, clip metrics :3272-3282), scoring through
  ``GRPOTrainer._get_per_token_logps_and_entropies``      :1419 (its prompt/padding label mask, :1490).

Each test has a negative control: the same comparison with one deliberate mistake must fail.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

trl = pytest.importorskip("trl")

from trl import DPOTrainer, GRPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402
from trl.trainer.utils import entropy_from_logits, selective_log_softmax  # noqa: E402

from notebookkit.kernels.testing import rel_err  # noqa: E402
from notebookkit.train.rl_losses import dpo_loss, grpo_loss, orpo_loss, sequence_logps  # noqa: E402
from notebookkit.train.token_logprobs import token_logprobs  # noqa: E402

TOL = 1e-5
VOCAB, HIDDEN = 211, 24


# ------------------------------------------------------------------------------------------------
# A toy causal LM: the same parameters scored two ways
# ------------------------------------------------------------------------------------------------


class ToyBackbone(nn.Module):
    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g))
        self.pos = nn.Parameter(torch.randn(64, HIDDEN, generator=g) * 0.5)
        self.mix = nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=g) * HIDDEN**-0.5)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        x = self.embed[input_ids] + self.pos[: input_ids.shape[1]]
        x = torch.cumsum(x, dim=1) / torch.arange(1, x.shape[1] + 1)[:, None]  # causal: t sees tokens <= t
        return (torch.tanh(x @ self.mix) * 2,)


class ToyLM(nn.Module):
    """``model`` backbone + ``lm_head``, a config with Gemma-2's soft-cap attribute (read like HF's)."""

    base_model_prefix = "model"

    def __init__(self, seed: int = 0, softcap=None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.model = ToyBackbone(g)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * 0.6)
        self.config = SimpleNamespace(model_type="toy", final_logit_softcapping=softcap)

    def get_output_embeddings(self):
        return self.lm_head

    def materialised_logits(self, input_ids):
        logits = self.lm_head(self.model(input_ids)[0])
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)


class TRLModelStandIn:
    """What TRL's trainers call: ``model(...)`` -> logits; with ``fused_lm_head=True`` the per-token
    outputs of TRL's fused head, computed here from the materialised logits with TRL's own functions."""

    def __init__(self, toy: ToyLM, temperature: float = 1.0) -> None:
        self.toy, self.temperature, self.training = toy, temperature, True

    def __call__(self, input_ids, attention_mask=None, labels=None, fused_lm_head=False, **_):
        logits = self.toy.materialised_logits(input_ids)
        if not fused_lm_head:
            return SimpleNamespace(logits=logits)
        logits = logits[:, :-1] / self.temperature
        targets = labels[:, 1:]
        mask = targets != -100
        log_probs = selective_log_softmax(logits, targets.clamp(min=0)).masked_fill(~mask, 0.0)
        with torch.no_grad():
            entropy = entropy_from_logits(logits).masked_fill(~mask, 0.0)
            is_top1 = logits.argmax(-1) == targets
        return SimpleNamespace(log_probs=log_probs, entropy=entropy, mean_logits=logits.detach().mean(-1),
                               is_top1=is_top1, log_sum_sq_probs=None, aux_loss=None)


class Accelerator:
    device = torch.device("cpu")
    num_processes = 1

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def autocast(self):
        return contextlib.nullcontext()


def _trainer_self(model: TRLModelStandIn, **attrs) -> SimpleNamespace:
    return SimpleNamespace(model=model, accelerator=Accelerator(), aux_loss_enabled=False,
                           _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, **attrs)


def _grads(loss: torch.Tensor, toy: ToyLM) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, list(toy.parameters())))


def _assert_same(ours_loss, ours_grads, trl_loss, trl_grads, what=""):
    assert torch.isfinite(ours_loss), what
    assert rel_err(ours_loss, trl_loss) < TOL, f"{what} loss: {ours_loss.item()} vs TRL {trl_loss.item()}"
    for (name, _), g, t in zip(ToyLM().named_parameters(), ours_grads, trl_grads):
        assert t.abs().sum() > 0, f"{what} {name}: TRL's gradient is zero, the test would prove nothing"
        assert rel_err(g, t) < TOL, f"{what} d {name}: {rel_err(g, t):.2e}"


def _assert_metrics(ours: dict, trl_metrics: dict, names, what=""):
    for name in names:
        got = ours[name].item()
        want = trl_metrics[name][-1] if isinstance(trl_metrics[name], list) else float(trl_metrics[name])
        assert abs(got - want) <= TOL * max(1.0, abs(want)), f"{what} {name}: {got} vs TRL {want}"


# ------------------------------------------------------------------------------------------------
# DPO
# ------------------------------------------------------------------------------------------------


def _pairs(seed: int, n_pairs: int = 3, prompt: int = 5, t: int = 17):
    """[chosen; rejected] rows (TRL's order): left prompt, completions of unequal lengths, right padding."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (2 * n_pairs, t), generator=g)
    attention_mask = torch.ones_like(input_ids)
    completion_mask = torch.zeros_like(input_ids)
    for row in range(2 * n_pairs):
        end = t - int(torch.randint(0, 6, (1,), generator=g))
        attention_mask[row, end:] = 0
        completion_mask[row, prompt:end] = 1
    return input_ids, attention_mask, completion_mask


DPO_CASES = {
    "sigmoid": dict(loss_type="sigmoid", beta=0.1),
    "ipo": dict(loss_type="ipo", beta=0.3),
    "robust": dict(loss_type="robust", beta=0.2, label_smoothing=0.1),
    "sigmoid+ipo": dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0, 0.5], beta=0.1),
}


def _trl_dpo(policy: ToyLM, ref_logps, batch, case, softcap):
    model = TRLModelStandIn(policy)
    types = case["loss_type"] if isinstance(case["loss_type"], list) else [case["loss_type"]]
    fake = _trainer_self(
        model, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=types,
        loss_weights=case.get("loss_weights") or [1.0] * len(types), beta=case["beta"],
        label_smoothing=case.get("label_smoothing", 0.0), use_weighting=False, _total_train_tokens=0, _tp_size=1,
    )
    input_ids, attention_mask, completion_mask = batch
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask,
              "ref_chosen_logps": ref_logps[0], "ref_rejected_logps": ref_logps[1]}
    loss = DPOTrainer._compute_loss(fake, model, inputs, return_outputs=False)
    return loss, fake._metrics["train"]


def _ours_dpo(policy: ToyLM, ref_logps, batch, case, wrong_normalisation=False):
    input_ids, attention_mask, completion_mask = batch
    labels = input_ids.masked_fill(completion_mask == 0, -100)
    per_token = token_logprobs(policy, input_ids, attention_mask, labels=labels, chunk_size=7)
    logps = sequence_logps(per_token, labels[:, 1:] != -100, average=wrong_normalisation)
    chosen, rejected = logps.chunk(2)
    lengths = completion_mask.sum(1).chunk(2)
    opts = {k: v for k, v in case.items()}
    return dpo_loss(chosen, rejected, *ref_logps, chosen_lengths=lengths[0], rejected_lengths=lengths[1], **opts)


@pytest.mark.parametrize("case", list(DPO_CASES))
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["nocap", "softcap"])
def test_dpo_matches_trl(case, softcap):
    batch = _pairs(seed=1)
    policy = ToyLM(seed=0, softcap=softcap)
    reference = ToyLM(seed=5, softcap=softcap)  # a different model: the log-ratios are far from 0
    with torch.no_grad():
        ref_labels = batch[0].masked_fill(batch[2] == 0, -100)
        ref_logps = token_logprobs(reference, batch[0], batch[1], labels=ref_labels).sum(1).chunk(2)
    trl_loss, trl_metrics = _trl_dpo(policy, ref_logps, batch, DPO_CASES[case], softcap)
    trl_grads = _grads(trl_loss, policy)
    loss, metrics = _ours_dpo(policy, ref_logps, batch, DPO_CASES[case])
    _assert_same(loss, _grads(loss, policy), trl_loss, trl_grads, f"DPO {case}")
    _assert_metrics(metrics, trl_metrics, ["rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                           "rewards/margins", "logps/chosen", "logps/rejected"], f"DPO {case}")
    # Negative control: per-token averages instead of sums (a wrong normalisation) is caught.
    wrong, _ = _ours_dpo(policy, ref_logps, batch, DPO_CASES[case], wrong_normalisation=True)
    assert rel_err(wrong, trl_loss) > 1e-3


def test_dpo_refuses_label_smoothing_with_sigmoid():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="robust"):
        dpo_loss(x, x, x, x, loss_type="sigmoid", label_smoothing=0.1)
    with pytest.raises(ValueError, match="chosen_lengths"):
        dpo_loss(x, x, x, x, loss_type="ipo")
    with pytest.raises(ValueError, match=r"\[P\]"):
        dpo_loss(x, x, x, torch.zeros(3))


# ------------------------------------------------------------------------------------------------
# ORPO
# ------------------------------------------------------------------------------------------------


def _orpo_batch(seed: int, n_pairs: int = 3, prompt: int = 4, t: int = 15):
    input_ids, attention_mask, completion_mask = _pairs(seed, n_pairs, prompt, t)
    labels = input_ids.masked_fill(completion_mask == 0, -100)
    halves = lambda x: x.chunk(2)  # noqa: E731
    batch = {}
    for side, i in (("chosen", 0), ("rejected", 1)):
        batch[f"{side}_input_ids"] = halves(input_ids)[i]
        batch[f"{side}_attention_mask"] = halves(attention_mask)[i]
        batch[f"{side}_labels"] = halves(labels)[i]
    return batch, (input_ids, attention_mask, labels)


def _ours_orpo(policy, flat, beta, nll_over_completion_only=False):
    input_ids, attention_mask, labels = flat
    completion = token_logprobs(policy, input_ids, attention_mask, labels=labels, chunk_size=5)
    avg = sequence_logps(completion, labels[:, 1:] != -100, average=True)
    chosen, rejected = avg.chunk(2)
    # ORPO's NLL covers prompt and completion of the chosen rows (every non-padding next token).
    all_tokens = token_logprobs(policy, input_ids, attention_mask, chunk_size=5)
    scored = (attention_mask[:, 1:] == 1) if not nll_over_completion_only else (labels[:, 1:] != -100)
    n_pairs = input_ids.shape[0] // 2
    chosen_nll = -(all_tokens[:n_pairs] * scored[:n_pairs]).sum() / scored[:n_pairs].sum()
    return orpo_loss(chosen, rejected, chosen_nll, beta=beta)


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["nocap", "softcap"])
@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_matches_trl(softcap, beta):
    batch, flat = _orpo_batch(seed=2)
    policy = ToyLM(seed=3, softcap=softcap)
    model = TRLModelStandIn(policy)
    fake = _trainer_self(model, beta=beta, is_encoder_decoder=False, padding_value=0)
    fake.concatenated_inputs = ORPOTrainer.concatenated_inputs
    fake.odds_ratio_loss = lambda c, r: ORPOTrainer.odds_ratio_loss(fake, c, r)
    fake.get_batch_logps = ORPOTrainer.get_batch_logps
    fake.concatenated_forward = lambda m, b: ORPOTrainer.concatenated_forward(fake, m, b)
    trl_loss, trl_metrics = ORPOTrainer.get_batch_loss_metrics(fake, model, batch)
    trl_grads = _grads(trl_loss, policy)

    loss, metrics = _ours_orpo(policy, flat, beta)
    _assert_same(loss, _grads(loss, policy), trl_loss, trl_grads, "ORPO")
    _assert_metrics(metrics, trl_metrics, ["rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                           "rewards/margins", "logps/chosen", "logps/rejected", "nll_loss",
                                           "log_odds_ratio", "log_odds_chosen"], "ORPO")
    # Negative control: the NLL over the completion only (not TRL's prompt + completion) is caught.
    wrong, _ = _ours_orpo(policy, flat, beta, nll_over_completion_only=True)
    assert rel_err(wrong, trl_loss) > 1e-3


# ------------------------------------------------------------------------------------------------
# GRPO
# ------------------------------------------------------------------------------------------------


def _rollouts(seed: int, n: int = 6, prompt: int = 6, completion: int = 9):
    """Left-padded prompts, completions padded after their end, mixed-sign advantages, and old
    log-probs shifted so that some tokens' ratios leave the clip range."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, VOCAB, (n, prompt), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    completion_ids = torch.randint(0, VOCAB, (n, completion), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    for row in range(n):
        prompt_mask[row, : int(torch.randint(0, 3, (1,), generator=g))] = 0
        completion_mask[row, completion - int(torch.randint(0, 4, (1,), generator=g)):] = 0
    completion_mask[-1] = 0  # one completion with no scored token (an empty row)
    advantages = torch.randn(n, generator=g)
    return prompt_ids, prompt_mask, completion_ids, completion_mask, advantages, g


def _old_and_ref(policy, ids, mask, k, temperature, g):
    with torch.no_grad():
        current = token_logprobs(policy, ids, mask, logits_to_keep=k, temperature=temperature)
        old = current + torch.randn(current.shape, generator=g) * 0.4  # |log ratio| > log 1.2 on many tokens
        ref = token_logprobs(ToyLM(seed=9, softcap=policy.config.final_logit_softcapping), ids, mask,
                             logits_to_keep=k, temperature=temperature)
    return old, ref


GRPO_CASES = [(loss_type, beta) for loss_type in ("grpo", "dapo", "dr_grpo") for beta in (0.0, 0.04)]


def _trl_grpo(policy, inputs, loss_type, beta, temperature, gas, spg, max_len, bias_kl=True):
    model = TRLModelStandIn(policy, temperature)
    fake = _trainer_self(
        model, top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, use_vllm=False,
        vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=gas,
        max_completion_length=max_len, _entropy_bonus_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=bias_kl, delta=None, steps_per_generation=spg),
    )
    score = GRPOTrainer._get_per_token_logps_and_entropies
    score = getattr(score, "__wrapped__", score)  # under TRL's profiling decorator (trl/extras/profiling.py)
    fake._get_per_token_logps_and_entropies = lambda *a, **kw: score(fake, *a, **kw)
    loss = GRPOTrainer._compute_loss(fake, model, inputs)
    return loss, fake._metrics["train"]


@pytest.mark.parametrize("loss_type,beta", GRPO_CASES, ids=[f"{t}-beta{b}" for t, b in GRPO_CASES])
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["nocap", "softcap"])
def test_grpo_matches_trl(loss_type, beta, softcap):
    prompt_ids, prompt_mask, completion_ids, completion_mask, advantages, g = _rollouts(seed=4)
    policy = ToyLM(seed=7, softcap=softcap)
    temperature, gas, spg, max_len = 0.8, 2, 4, 12
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    k = completion_ids.shape[1]
    old, ref = _old_and_ref(policy, ids, mask, k, temperature, g)
    num_items = completion_mask.sum() * 3  # the generation batch is larger than this micro-batch
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": old,
              "ref_per_token_logps": ref, "num_items_in_batch": num_items}
    trl_loss, trl_metrics = _trl_grpo(policy, inputs, loss_type, beta, temperature, gas, spg, max_len)
    trl_grads = _grads(trl_loss, policy)

    def ours(**overrides):
        per_token = token_logprobs(policy, ids, mask, logits_to_keep=k, temperature=temperature, chunk_size=8)
        opts = dict(old_per_token_logps=old, ref_per_token_logps=ref, loss_type=loss_type, beta=beta,
                    epsilon_low=0.2, epsilon_high=0.28, max_completion_length=max_len, num_items_in_batch=num_items,
                    gradient_accumulation_steps=gas, steps_per_generation=spg)
        opts.update(overrides)
        return grpo_loss(per_token, advantages, completion_mask, **opts)

    loss, metrics = ours()
    _assert_same(loss, _grads(loss, policy), trl_loss, trl_grads, f"GRPO {loss_type}")
    names = ["clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
             "clip_ratio/region_mean"] + (["kl"] if beta else [])
    _assert_metrics(metrics, trl_metrics, names, f"GRPO {loss_type}")
    assert 0.05 < metrics["clip_ratio/region_mean"].item() < 0.95, "clipping must be active on some tokens only"

    # Negative controls: each other normalisation, and (with KL) the KL without its bias correction.
    for other in {"grpo", "dapo", "dr_grpo"} - {loss_type}:
        wrong, _ = ours(loss_type=other)
        assert rel_err(wrong, trl_loss) > 1e-3, f"{other} normalisation indistinguishable from {loss_type}"
    if beta:
        wrong, _ = ours(use_bias_correction_kl=False)
        assert rel_err(wrong, trl_loss) > 1e-6 and not torch.allclose(
            torch.cat([x.flatten() for x in _grads(wrong, policy)]),
            torch.cat([x.flatten() for x in trl_grads]), rtol=1e-4, atol=0)


def test_grpo_on_policy_default_and_kl_without_bias_correction():
    """No old log-probs (TRL's num_iterations=1 shortcut: ratio 1) and the KL without bias correction."""
    prompt_ids, prompt_mask, completion_ids, completion_mask, advantages, g = _rollouts(seed=6)
    policy = ToyLM(seed=8)
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    k = completion_ids.shape[1]
    _, ref = _old_and_ref(policy, ids, mask, k, 1.0, g)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages, "ref_per_token_logps": ref}
    trl_loss, trl_metrics = _trl_grpo(policy, inputs, "grpo", 0.1, 1.0, 1, 1, 9, bias_kl=False)
    per_token = token_logprobs(policy, ids, mask, logits_to_keep=k, chunk_size=4)
    loss, metrics = grpo_loss(per_token, advantages, completion_mask, ref_per_token_logps=ref, loss_type="grpo",
                              beta=0.1, use_bias_correction_kl=False)
    _assert_same(loss, _grads(loss, policy), trl_loss, _grads(trl_loss, policy), "GRPO on-policy")
    _assert_metrics(metrics, trl_metrics, ["kl", "clip_ratio/region_mean"], "GRPO on-policy")


def test_grpo_bad_arguments_explain_what_to_change():
    x, m, a = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        grpo_loss(x, a, m, loss_type="dapo")
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(x, a, m, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        grpo_loss(x, a, m, loss_type="grpo", beta=0.1)
    with pytest.raises(ValueError, match="bnpo"):
        grpo_loss(x, a, m, loss_type="bnpo")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        grpo_loss(x, a, torch.ones(2, 4), loss_type="grpo")
