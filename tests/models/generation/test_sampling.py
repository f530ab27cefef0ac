"""The fast path's next-token choice against Hugging Face's own logits processors and sampling.

The oracle is the ``LogitsProcessorList`` that ``generate`` itself builds (``_prepare_generation_config``
then ``_get_logits_processor`` on a tiny model) from the same ``GenerationConfig``: repetition
penalty, temperature, top-k, top-p and min-p from ``transformers.generation.logits_process``.
Both sides run the same fp32 arithmetic, so the filtered logits must be equal bit for bit, ``-inf``
where a token is dropped. Logits have odd vocabulary sizes, ties (values on a coarse grid, so the
top-k boundary and the top-p threshold fall inside runs of equal values) and ``-inf`` entries.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from notebookkit.models.generation.sampling import (
    SamplingSettings,
    UnsupportedSettingError,
    _min_p,
    _top_k,
    _top_p,
    choose_next,
    filter_logits,
    mark_seen,
    new_seen_mask,
)

from ..helpers import random_model

FIVE = (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)

# (name, GenerationConfig keywords): each filter alone (top_k=0 where HF's default top_k=50 would
# join in), then all together; greedy with a penalty applies the penalty only.
CASES = [
    ("greedy", dict()),
    ("greedy_penalty", dict(repetition_penalty=1.3)),
    ("greedy_ignores_warpers", dict(temperature=0.5, top_k=3, top_p=0.5, min_p=0.2, repetition_penalty=1.2)),
    ("penalty", dict(do_sample=True, top_k=0, repetition_penalty=1.3)),
    ("penalty_reward", dict(do_sample=True, top_k=0, repetition_penalty=0.7)),
    ("temperature_low", dict(do_sample=True, top_k=0, temperature=0.7)),
    ("temperature_high", dict(do_sample=True, top_k=0, temperature=1.6)),
    ("top_k_1", dict(do_sample=True, top_k=1)),
    ("top_k_5", dict(do_sample=True, top_k=5)),
    ("top_k_default_50", dict(do_sample=True)),
    ("top_k_above_vocab", dict(do_sample=True, top_k=5000)),
    ("top_p_0", dict(do_sample=True, top_k=0, top_p=0.0)),
    ("top_p_03", dict(do_sample=True, top_k=0, top_p=0.3)),
    ("top_p_09", dict(do_sample=True, top_k=0, top_p=0.9)),
    ("top_p_0999", dict(do_sample=True, top_k=0, top_p=0.999)),
    ("min_p_005", dict(do_sample=True, top_k=0, min_p=0.05)),
    ("min_p_03", dict(do_sample=True, top_k=0, min_p=0.3)),
    ("min_p_1", dict(do_sample=True, top_k=0, min_p=1.0)),
    ("all", dict(do_sample=True, temperature=0.8, top_k=7, top_p=0.9, min_p=0.05, repetition_penalty=1.2)),
    ("all_hot", dict(do_sample=True, temperature=1.7, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=0.8)),
]
VOCABS = [7, 97, 1031]


@pytest.fixture(scope="module")
def hf_model():
    return random_model("llama")


def hf_processors(model, config: GenerationConfig, input_ids, attention_mask=None) -> LogitsProcessorList:
    """The processors ``generate`` builds for ``config`` (HF's defaults filled in the way generate does)."""
    prepared, _ = model._prepare_generation_config(config)
    if not hasattr(prepared, "_eos_token_tensor"):  # set by generate's special-token step: no EOS here
        prepared._eos_token_tensor = None
    return model._get_logits_processor(
        generation_config=prepared, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=str(input_ids.device),
        model_kwargs={"attention_mask": attention_mask} if attention_mask is not None else {},
    )


def tied_logits(batch: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits on a grid of 0.25 (many ties, also at the maximum) with about 5% ``-inf``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-12, 13, (batch, vocab), generator=g).float() * 0.25
    x[torch.rand(batch, vocab, generator=g) < 0.05] = float("-inf")
    x[:, 0] = 3.0  # every row keeps a finite maximum
    return x


def smooth_logits(batch: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = 2.0 * torch.randn(batch, vocab, generator=g)
    x[torch.rand(batch, vocab, generator=g) < 0.05] = float("-inf")
    return x


def prompt(batch: int, vocab: int, seed: int, length: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def assert_same(ours: torch.Tensor, ref: torch.Tensor, msg: str = "") -> None:
    assert not torch.isnan(ours).any(), f"NaN in the filtered logits {msg}"
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), f"different tokens dropped {msg}"
    assert torch.equal(ours, ref), f"filtered logits differ {msg}"


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("make", [tied_logits, smooth_logits], ids=["ties", "smooth"])
@pytest.mark.parametrize("name,kwargs", CASES, ids=[c[0] for c in CASES])
def test_filter_logits_equals_hf_processors(hf_model, name, kwargs, make, vocab):
    config = GenerationConfig(**kwargs)
    logits = make(5, vocab, seed=vocab)
    ids = prompt(5, vocab, seed=vocab + 1)
    processors = hf_processors(hf_model, config, ids)
    assert all(type(p) in FIVE for p in processors), [type(p).__name__ for p in processors]
    if kwargs:
        assert len(processors) > 0
    ref = processors(ids, logits.clone())
    s = SamplingSettings.from_generation_config(config)
    ours = filter_logits(logits, new_seen_mask(ids, vocab), s)
    assert_same(ours, ref, f"({name}, V={vocab})")


def test_every_filter_changes_something_on_the_test_logits(hf_model):
    """The cases are not vacuous: each filter alone changes the logits of the test data."""
    logits, ids = tied_logits(5, 97, seed=97), prompt(5, 97, seed=98)
    for name, kwargs in CASES:
        if name in ("greedy", "greedy_ignores_warpers", "top_k_above_vocab", "top_p_0999"):
            continue
        s = SamplingSettings.from_generation_config(GenerationConfig(**kwargs))
        out = filter_logits(logits, new_seen_mask(ids, 97), s)
        assert not torch.equal(out, logits), name


def test_top_k_keeps_every_tie_at_the_boundary():
    x = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, -1.0, float("-inf")]])
    kept = torch.isfinite(_top_k(x, 2))[0].tolist()
    assert kept == [False, True, True, True, True, False, False]  # the 2nd largest is 2.0: all three stay


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = torch.isfinite(_top_p(probs.log(), 0.6))[0].tolist()
    assert kept == [True, True, False, False]  # 0.5 < 0.6, so 0.3 (reaching 0.8) stays too
    kept = torch.isfinite(_top_p(probs.log(), 0.0))[0].tolist()
    assert kept == [True, False, False, False]  # min_tokens_to_keep = 1


def test_min_p_is_relative_to_the_most_likely_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    kept = torch.isfinite(_min_p(probs.log(), 0.35))
    assert kept[0].tolist() == [True, True, False, False]  # threshold 0.35 * 0.5 = 0.175
    assert kept[1].all()  # a flat row keeps everything, whatever min_p


def test_wrong_order_is_caught(hf_model):
    """Negative control: the equality test above sees a changed order of the filters."""
    logits, ids = smooth_logits(5, 1031, seed=3), prompt(5, 1031, seed=4)

    def compare(kwargs, wrong):
        config = GenerationConfig(**kwargs)
        ref = hf_processors(hf_model, config, ids)(ids, logits.clone())
        right = filter_logits(logits, new_seen_mask(ids, 1031), SamplingSettings.from_generation_config(config))
        assert torch.equal(right, ref)
        return not torch.equal(wrong, ref)

    # min-p before the temperature (HF applies min-p after it): another set of tokens survives
    t, m = 0.5, 0.05
    assert compare(dict(do_sample=True, top_k=0, temperature=t, min_p=m), _min_p(logits, m) / t)
    # top-p before top-k
    assert compare(dict(do_sample=True, top_k=20, top_p=0.5), _top_k(_top_p(logits, 0.5), 20))
    # temperature after top-p, min-p last: top-p measured the untempered probabilities
    wrong = _min_p(_top_p(logits, 0.9) / 1.5, 0.01)
    assert compare(dict(do_sample=True, top_k=0, temperature=1.5, top_p=0.9, min_p=0.01), wrong)
    # the penalty after the temperature (the same tokens, other values)
    seen = new_seen_mask(ids, 1031)
    hot = logits / 0.7
    wrong = torch.where(seen, torch.where(hot < 0, hot * 1.3, hot / 1.3), hot)
    assert compare(dict(do_sample=True, top_k=0, temperature=0.7, repetition_penalty=1.3), wrong)


@pytest.mark.parametrize(
    "kwargs",
    [dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.5),
     dict(do_sample=False, repetition_penalty=1.5)],
    ids=["sampling_every_filter", "greedy_penalty"],
)
def test_generate_scores_replayed_step_by_step_with_left_padding(kwargs):
    """HF's generate with left padding: at each step the raw logits it returns (``output_logits``),
    filtered with the seen mask kept by new_seen_mask + mark_seen, equal the scores it chose from
    (``output_scores``)."""
    vocab, pad = 301, 0
    model = random_model("llama", vocab_size=vocab)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 256, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = pad, 0  # row 0: four pad tokens; token 0 appears nowhere else
    ids[1, :1], mask[1, :1] = pad, 0
    torch.manual_seed(0)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=pad, eos_token_id=None,
        output_logits=True, output_scores=True, return_dict_in_generate=True, **kwargs,
    )
    s = SamplingSettings.from_generation_config(model.generation_config, **kwargs)
    seen = new_seen_mask(ids, vocab, pad_lengths=(mask == 0).sum(dim=1))
    if not s.do_sample:  # negative control: counting the pads as seen changes token 0 of row 0
        counted_pads = new_seen_mask(ids, vocab)
        assert not seen[0, pad] and counted_pads[0, pad]
        assert not torch.equal(filter_logits(out.logits[0], counted_pads, s), out.scores[0])
    for step, (raw, ref) in enumerate(zip(out.logits, out.scores)):
        assert_same(filter_logits(raw, seen, s), ref, f"(step {step})")
        mark_seen(seen, out.sequences[:, ids.shape[1] + step])


# ---- SamplingSettings.from_generation_config ----


def test_defaults_are_hugging_faces():
    assert SamplingSettings.from_generation_config(GenerationConfig()) == SamplingSettings()
    assert SamplingSettings.from_generation_config(None) == SamplingSettings()
    s = SamplingSettings.from_generation_config(GenerationConfig(do_sample=True))
    assert s == SamplingSettings(do_sample=True, temperature=1.0, top_k=50, top_p=1.0, min_p=0.0)
    assert not s.needs_seen_mask and s.needs_uniforms


def test_overrides_and_none_turning_a_filter_off():
    config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, repetition_penalty=1.1)
    s = SamplingSettings.from_generation_config(config, top_k=None, temperature=0.3, min_p=0.1)
    assert s == SamplingSettings(True, 0.3, 0, 0.9, 0.1, 1.1)
    assert s.needs_seen_mask
    assert SamplingSettings.from_generation_config(config, do_sample=False) == SamplingSettings(repetition_penalty=1.1)
    assert SamplingSettings.from_generation_config({"do_sample": True, "top_k": 3}).top_k == 3


def test_greedy_settings_compare_equal_whatever_the_sampling_filters():
    a = SamplingSettings.from_generation_config(GenerationConfig(temperature=0.2, top_p=0.5, typical_p=0.5))
    assert a == SamplingSettings() and hash(a) == hash(SamplingSettings())


UNSUPPORTED = [
    ("num_beams", 4), ("num_beam_groups", 2), ("diversity_penalty", 0.5), ("penalty_alpha", 0.6),
    ("dola_layers", "high"), ("prompt_lookup_num_tokens", 10), ("no_repeat_ngram_size", 3),
    ("encoder_no_repeat_ngram_size", 2), ("encoder_repetition_penalty", 1.2), ("bad_words_ids", [[5]]),
    ("sequence_bias", {(5,): -1.0}), ("forced_bos_token_id", 1),
    ("forced_eos_token_id", 2), ("remove_invalid_values", True), ("exponential_decay_length_penalty", (5, 1.5)),
    ("suppress_tokens", [3]), ("begin_suppress_tokens", [3]), ("guidance_scale", 1.5),
    ("renormalize_logits", True), ("typical_p", 0.9), ("epsilon_cutoff", 3e-4), ("eta_cutoff", 3e-4), ("top_h", 0.4),
]


@pytest.mark.parametrize("name,value", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_setting_names_itself(name, value):
    with pytest.raises(UnsupportedSettingError) as info:
        SamplingSettings.from_generation_config(GenerationConfig(do_sample=True), **{name: value})
    assert isinstance(info.value, ValueError) and info.value.setting == name
    assert f"`{name}=" in str(info.value) and "Hugging Face's generate" in str(info.value)


@pytest.mark.parametrize("name,value", [("typical_p", 0.9), ("epsilon_cutoff", 3e-4), ("eta_cutoff", 3e-4), ("top_h", 0.4)])
def test_sampling_only_filters_do_not_block_greedy(hf_model, name, value):
    """Hugging Face ignores these without do_sample, so the fast path runs greedy decoding with them."""
    config = GenerationConfig(**{name: value})
    ids = prompt(2, 50, seed=0)
    assert len(hf_processors(hf_model, config, ids)) == 0
    assert SamplingSettings.from_generation_config(config) == SamplingSettings()


@pytest.mark.parametrize("name,value", [("typical_p", 0.9), ("epsilon_cutoff", 3e-4), ("eta_cutoff", 3e-4),
                                        ("top_h", 0.4), ("no_repeat_ngram_size", 3), ("suppress_tokens", [3]),
                                        ("bad_words_ids", [[5]]), ("remove_invalid_values", True),
                                        ("sequence_bias", {(5,): -1.0}), ("renormalize_logits", True)])
def test_refused_settings_do_add_a_processor_in_hf(hf_model, name, value):
    """What the fast path refuses, Hugging Face turns into a processor outside the five it runs."""
    config = GenerationConfig(do_sample=True, top_k=0, **{name: value})
    ids = prompt(2, 50, seed=0)
    extra = [type(p).__name__ for p in hf_processors(hf_model, config, ids) if type(p) not in FIVE]
    assert extra, name


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(do_sample=True, temperature=0.0), ["temperature", "do_sample=False"]),
        (dict(do_sample=True, top_k=-1), ["top_k", ">= 0"]),
        (dict(do_sample=True, top_p=1.5), ["top_p", "between 0 and 1"]),
        (dict(do_sample=True, min_p=-0.1), ["min_p", "between 0 and 1"]),
        (dict(repetition_penalty=0.0), ["repetition_penalty", "> 0"]),
    ],
)
def test_invalid_values_say_what_to_change(kwargs, words):
    with pytest.raises(ValueError) as info:
        SamplingSettings.from_generation_config(None, **kwargs)
    assert not isinstance(info.value, UnsupportedSettingError)
    for w in words:
        assert w in str(info.value)


def test_missing_inputs_are_explained():
    with pytest.raises(ValueError, match="seen-token mask"):
        filter_logits(torch.zeros(1, 5), None, SamplingSettings(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="uniforms"):
        choose_next(torch.zeros(1, 5), SamplingSettings(do_sample=True), None)


# ---- seen mask ----


def test_seen_mask_marks_prompt_tokens_skips_padding_and_ids_beyond_the_head():
    ids = torch.tensor([[9, 9, 2, 5, 2], [1, 7, 7, 12, 3]])
    seen = new_seen_mask(ids, 10, pad_lengths=torch.tensor([2, 0]))
    assert seen.dtype == torch.bool and seen.shape == (2, 10) and seen.is_contiguous()
    assert seen[0].nonzero().flatten().tolist() == [2, 5]  # the two leading 9s are padding
    assert seen[1].nonzero().flatten().tolist() == [1, 3, 7]  # 12 >= V is not counted
    mark_seen(seen, torch.tensor([9, 0]))
    assert seen[0].nonzero().flatten().tolist() == [2, 5, 9] and seen[1, 0]


# ---- choose_next ----


def test_greedy_is_torch_argmax_first_maximum():
    for vocab in VOCABS:
        x = tied_logits(6, vocab, seed=vocab)
        assert torch.equal(choose_next(x, SamplingSettings()), torch.argmax(x, dim=-1))
    x = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    assert choose_next(x, SamplingSettings()).tolist() == [1]


def test_sampling_is_gumbel_max_of_the_given_uniforms():
    """Exact: the chosen token is argmax(x_i - log(-log u_i)) computed by hand in float64."""
    s = SamplingSettings(do_sample=True)
    x = smooth_logits(64, 97, seed=11)
    u = torch.rand(64, 97, generator=torch.Generator().manual_seed(12))
    chosen = choose_next(x, s, u)
    assert chosen.dtype == torch.int64 and chosen.shape == (64,)
    for b in range(64):
        keys = [float(x[b, i]) - math.log(-math.log(float(u[b, i]))) for i in range(97)]
        best = max(range(97), key=keys.__getitem__)
        gap = keys[best] - max(k for i, k in enumerate(keys) if i != best)
        assert gap > 1e-4  # the data is far from a near-tie, so fp32 and float64 agree
        assert int(chosen[b]) == best
    # extreme uniforms: 0 and values next to 1 still never pick a dropped (-inf) token
    x = torch.tensor([[0.0, float("-inf"), 1.0]])
    for edge in (0.0, 1.0 - 2**-24, 1.0):
        u = torch.tensor([[0.5, edge, 0.5]])
        assert choose_next(x, s, u).item() != 1


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square statistic of ``counts`` against ``probs`` (categories with p > 0)."""
    n = counts.sum().double()
    expected = n * probs.double()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    df = probs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_samples_follow_the_softmax_of_the_filtered_logits():
    """200,000 draws with seeded uniforms: the frequencies fit softmax(filtered logits) (chi-square),
    dropped tokens are never drawn; the same test rejects the unfiltered and the untempered softmax."""
    n, vocab = 200_000, 23
    s = SamplingSettings(do_sample=True, temperature=0.8, top_k=12, top_p=0.95, min_p=0.02, repetition_penalty=1.3)
    base = smooth_logits(1, vocab, seed=21)
    seen = new_seen_mask(torch.cat([base.topk(2).indices, torch.tensor([[0, 1]])], dim=1), vocab)
    filtered = filter_logits(base, seen, s)
    kept = torch.isfinite(filtered[0])
    assert 3 <= int(kept.sum()) < vocab - 2  # the filters drop some tokens and keep several
    probs = torch.softmax(filtered[0].double(), dim=-1)
    u = torch.rand(n, vocab, generator=torch.Generator().manual_seed(22))
    draws = choose_next(filtered.expand(n, vocab), s, u)
    counts = torch.bincount(draws, minlength=vocab)
    assert int(counts[~kept].sum()) == 0
    assert _chi_square_p_value(counts[kept], probs[kept]) > 1e-3
    # negative controls: the same counts against slightly wrong distributions over the kept tokens
    untempered = torch.softmax(filtered[0, kept].double() * 0.8, dim=-1)  # the temperature left out
    assert _chi_square_p_value(counts[kept], untempered) < 1e-6
    assert (kept & seen[0]).any()
    unpenalised = torch.softmax(base[0, kept].double() / 0.8, dim=-1)  # the repetition penalty left out
    assert _chi_square_p_value(counts[kept], unpenalised) < 1e-6


# ---- graph safety (CPU side; the CUDA-graph capture itself is the gpu test below) ----

_HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
               "unique_dim", "item", "is_nonzero", "equal", "allclose"}


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = tuple(tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                       if isinstance(t, torch.Tensor))
        self.ops.append((func.overloadpacket.__name__, shapes))
        return out


def _one_step(logits, seen, uniform, s):
    chosen = choose_next(filter_logits(logits, seen, s), s, uniform)
    mark_seen(seen, chosen)
    return chosen


@pytest.mark.parametrize("name,kwargs", [c for c in CASES if c[0] in ("greedy_penalty", "all", "top_p_09", "min_p_03")])
def test_a_step_is_the_same_ops_and_shapes_whatever_the_values(name, kwargs):
    """No host read and no data-dependent shape: two steps on different values run the same aten
    ops with the same output shapes (what a CUDA graph needs to replay them)."""
    s = SamplingSettings.from_generation_config(GenerationConfig(**kwargs))
    runs = []
    for seed in (0, 1):
        logits = tied_logits(4, 97, seed) if seed else smooth_logits(4, 97, seed)
        seen = new_seen_mask(prompt(4, 97, seed), 97)
        uniform = torch.rand(4, 97, generator=torch.Generator().manual_seed(seed))
        with _OpRecorder() as rec:
            _one_step(logits, seen, uniform, s)
        runs.append(rec.ops)
    names = {op for op, _ in runs[0]}
    assert not names & _HOST_READS, names & _HOST_READS
    assert runs[0] == runs[1]


# ---- GPU: capture in a CUDA graph, replay with new logits ----


@pytest.mark.gpu
@pytest.mark.parametrize("name,kwargs", [c for c in CASES if c[0] in ("greedy_penalty", "all", "all_hot")])
def test_cuda_graph_replays_filter_and_choice_with_new_logits(name, kwargs):
    device = torch.device("cuda")
    batch, vocab = 8, 128_257
    s = SamplingSettings.from_generation_config(GenerationConfig(**kwargs))
    static_logits = torch.zeros(batch, vocab, device=device)
    static_seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
    static_uniform = torch.rand(batch, vocab, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph, as capture requires
        for _ in range(2):
            filter_logits(static_logits, static_seen, s)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_filtered = filter_logits(static_logits, static_seen, s)
        static_next = choose_next(static_filtered, s, static_uniform)
        mark_seen(static_seen, static_next)
    gen = torch.Generator(device=device).manual_seed(0)
    for step in range(4):
        logits = 3.0 * torch.randn(batch, vocab, device=device, generator=gen)
        logits[:, :7] = logits[:, 7:8]  # ties at the top
        ids = torch.randint(0, vocab, (batch, 50), device=device, generator=gen)
        seen = new_seen_mask(ids, vocab)
        uniform = torch.rand(batch, vocab, device=device, generator=gen)
        static_logits.copy_(logits)
        static_seen.copy_(seen)
        static_uniform.copy_(uniform)
        graph.replay()
        want_filtered = filter_logits(logits, seen, s)
        want_next = choose_next(want_filtered, s, uniform)
        mark_seen(seen, want_next)
        torch.cuda.synchronize()
        assert not torch.isnan(static_filtered).any()
        assert torch.equal(static_filtered, want_filtered), f"step {step}"
        assert torch.equal(static_next, want_next), f"step {step}"
        assert torch.equal(static_seen, seen), f"step {step}"


@pytest.mark.gpu
def test_cuda_filter_logits_equals_hf_processors(hf_model):
    """The same equality on the GPU (its sort, softmax and cumsum kernels), with a Llama-3 vocabulary."""
    device = torch.device("cuda")
    for name, kwargs in CASES:
        config = GenerationConfig(**kwargs)
        logits = smooth_logits(8, 128_256, seed=1).to(device)
        ids = prompt(8, 128_256, seed=2, length=200).to(device)
        ref = hf_processors(hf_model, config, ids)(ids, logits.clone())
        ours = filter_logits(logits, new_seen_mask(ids, 128_256), SamplingSettings.from_generation_config(config))
        assert_same(ours, ref, f"({name})")
