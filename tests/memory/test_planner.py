"""The activation planner: budget respected, keep > recompute > offload, errors that say what to change."""

import pytest

from notebookkit.memory import (DoesNotFitError, estimate_training_memory, model_shape, parse_card, parse_memory,
                                plan_activations)
from notebookkit.memory.planner import DEFAULT_SAFETY_MARGIN

GiB = 2**30
USABLE = 1.0 - DEFAULT_SAFETY_MARGIN  # the share of a budget a plan may fill
LLAMA8B = "meta-llama/Llama-3.1-8B-Instruct"
QLORA = dict(load_in_4bit=True, dtype="float16", batch_size=2, seq_len=4096, host_memory_bytes=64 * GiB)


def _ordered(modes, layout="front"):
    """Recomputed before kept layers; the offloaded ones first, or (``"spread"``, with two kept layers or more)
    spread evenly from layer 0, in gaps that differ by one layer at most, up to the two kept layers at the end."""
    offloading = ("offload", "offload_mlp")
    others = [m for m in modes if m not in offloading]
    if others != sorted(others, key=lambda m: m != "recompute"):
        return False
    at = [i for i, m in enumerate(modes) if m in offloading]
    if not at or layout == "front" or others.count("keep") < 2:
        return at == list(range(len(at)))
    gaps = [b - a for a, b in zip(at, at[1:] + [len(modes) - 2])]
    return at[0] == 0 and modes[-2:] == ("keep", "keep") and max(gaps) - min(gaps) <= 1


def test_big_budget_keeps_everything():
    plan = plan_activations(LLAMA8B, "h200", **QLORA)
    assert set(plan.modes) == {"keep"} and plan.step_overhead == 0
    plan = plan_activations("meta-llama/Llama-3.2-1B-Instruct", max_memory="80GB", batch_size=8, seq_len=2048,
                            host_memory_bytes=64 * GiB)
    assert set(plan.modes) == {"keep"}


def test_t4_budget_on_8b_offloads_and_fits():
    plan = plan_activations(LLAMA8B, "t4", **QLORA)
    counts = plan.counts()
    assert counts["offload"] + counts["offload_mlp"] > 0
    assert plan.estimate.total <= parse_card("t4").memory_bytes * USABLE
    # each offloaded layer's input, and the parked layers' gate/up outputs (module planner, offload_mlp)
    assert plan.host_bytes == ((counts["offload"] + counts["offload_mlp"]) * 2 * 4096 * 4096 * 2
                               + counts["offload_mlp"] * 2 * 2 * 4096 * 14336 * 2)
    assert _ordered(plan.modes)  # offloaded first, kept last


@pytest.mark.parametrize("layout", ["front", "spread"])
@pytest.mark.parametrize("gib", [12, 16, 20, 24, 28, 32, 40])
def test_budget_is_respected(gib, layout):
    plan = plan_activations(LLAMA8B, budget_bytes=gib * GiB, layout=layout, **QLORA)
    assert plan.estimate.total <= gib * GiB * USABLE
    assert _ordered(plan.modes, layout)


def test_per_layer_costs_rank_keep_then_recompute_then_offload():
    from notebookkit.memory.planner import _layer_costs
    from notebookkit.memory.shapes import model_shape

    for card in ("t4", "l4", "a100-80gb", "h200"):
        _, recompute, offload = _layer_costs(model_shape(LLAMA8B), dict(QLORA), parse_card(card))
        assert 0 < recompute < offload


def test_prefers_keep_over_recompute_over_offload():
    kw = {k: v for k, v in QLORA.items() if k != "host_memory_bytes"}
    full = estimate_training_memory(LLAMA8B, activation_plan="keep", **kw)
    # Enough for everything kept: nothing recomputed.
    plan = plan_activations(LLAMA8B, budget_bytes=int(full.total / USABLE) + 2**20, card="t4", **QLORA)
    assert plan.counts() == {"keep": 32, "recompute": 0, "offload": 0, "offload_mlp": 0}
    # Without offloading allowed, a budget between all-recompute and all-keep mixes keep and recompute.
    plan = plan_activations(LLAMA8B, budget_bytes=24 * GiB, card="t4", allow_offload=False, **QLORA)
    assert plan.counts()["offload"] == 0 and plan.counts()["recompute"] > 0 and plan.counts()["keep"] > 0
    # Shrinking the budget never keeps more layers, and never makes the step faster.
    previous = None
    for gib in (40, 30, 24, 18, 14, 10):
        plan = plan_activations(LLAMA8B, budget_bytes=gib * GiB, card="t4", **QLORA)
        if previous is not None:
            assert plan.counts()["keep"] <= previous.counts()["keep"]
            assert plan.extra_seconds >= previous.extra_seconds
        previous = plan


@pytest.mark.parametrize("model_type, targets", [("llama", None), ("gemma2", ["q_proj", "v_proj"])])
def test_a_recomputed_layer_costs_its_forward_less_the_skipped_down_projection(model_type, targets):
    """The extra seconds of a keep/recompute plan are ``m`` times the docstring's per-layer cost, written
    out here from the shapes: ``t_f = N (2 P_layer + 2 P_lora + 2 T dq) / rate`` less the down projection
    ``N 2 H I / rate``, which only a post-MLP norm (Gemma 2) makes the recompute run again."""
    H, I, heads, kv, d, L, r, B, T = 64, 256, 4, 2, 16, 6, 16, 2, 64
    cfg = dict(model_type=model_type, hidden_size=H, num_hidden_layers=L, num_attention_heads=heads,
               num_key_value_heads=kv, head_dim=d, intermediate_size=I, vocab_size=128)
    kw = dict(batch_size=B, seq_len=T, dtype="float16", cuda_context_bytes=0, lora_r=r, target_modules=targets)
    card = parse_card("t4")
    keep = estimate_training_memory(cfg, activation_plan="keep", **kw).total
    recompute = estimate_training_memory(cfg, activation_plan="recompute", **kw).total
    plan = plan_activations(cfg, budget_bytes=int((keep + recompute) / 2 / USABLE), card=card, allow_offload=False,
                            host_memory_bytes=GiB, **kw)
    m = plan.counts()["recompute"]
    assert 0 < m < L and plan.counts()["offload"] == 0

    N, dq, dk = B * T, heads * d, kv * d
    p_layer = H * dq + 2 * H * dk + dq * H + 3 * H * I  # q, k, v, o; gate, up, down
    lora_in_out = {"q_proj": H + dq, "k_proj": H + dk, "v_proj": H + dk, "o_proj": dq + H,
                   "gate_proj": H + I, "up_proj": H + I, "down_proj": I + H}
    p_lora = r * sum(n for name, n in lora_in_out.items() if targets is None or name in targets)
    rate = card.tflops * 1e12
    t_f = N * (2 * p_layer + 2 * p_lora + 2 * T * dq) / rate
    t_down = 0.0 if model_type == "gemma2" else N * 2 * H * I / rate
    assert plan.extra_seconds == pytest.approx(m * (t_f - t_down), rel=1e-9, abs=0)
    assert plan.step_overhead == pytest.approx(m * (t_f - t_down) / (3 * L * t_f), rel=1e-9, abs=0)


@pytest.mark.parametrize("budget_kib", [1200, 1400, 1600, 1800, 2200, 3000])
def test_plan_is_the_cheapest_that_fits_brute_force(budget_kib):
    """On a 6-layer toy model, compare with every (keep, recompute, offload) split."""
    from notebookkit.memory.planner import _layer_costs, _modes
    from notebookkit.memory.shapes import model_shape

    cfg = dict(model_type="llama", hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, intermediate_size=256, vocab_size=128)
    kw = dict(batch_size=2, seq_len=64, dtype="float16", cuda_context_bytes=0)
    budget = budget_kib * 1024
    card = parse_card("t4")
    _, c_rec, c_off = _layer_costs(model_shape(cfg), kw, card)
    best = None
    for k in range(7):
        for m in range(7 - k):
            est = estimate_training_memory(cfg, activation_plan=_modes(6, k, m), **kw)
            if est.total <= budget * USABLE:
                cost = m * c_rec + (6 - k - m) * c_off
                if best is None or cost < best - 1e-15:
                    best = cost
    if best is None:
        with pytest.raises(DoesNotFitError):
            plan_activations(cfg, budget_bytes=budget, card=card, host_memory_bytes=GiB, **kw)
        return
    plan = plan_activations(cfg, budget_bytes=budget, card=card, host_memory_bytes=GiB, **kw)
    assert plan.extra_seconds == pytest.approx(best)
    assert plan.estimate.total <= budget * USABLE


def test_cpu_plan_never_offloads():
    plan = plan_activations("Qwen/Qwen3-0.6B", budget_bytes=12 * GiB, allow_offload=False, batch_size=4,
                            seq_len=2048, dtype="float32")
    assert plan.counts()["offload"] == 0


def test_error_when_nothing_fits_says_what_to_change():
    with pytest.raises(DoesNotFitError) as info:
        plan_activations(LLAMA8B, "12GB", load_in_4bit=False, batch_size=2, seq_len=2048, host_memory_bytes=64 * GiB)
    msg = str(info.value)
    assert "does not fit" in msg and "What to change" in msg
    assert "load_in_4bit=True" in msg and "smaller model" in msg
    assert info.value.estimate is not None and info.value.budget_bytes == 12 * 10**9
    # When no single change is enough, the longest sequence that fits with all of them is named.
    with pytest.raises(DoesNotFitError, match=r"max_seq_length <= \d+ together with"):
        plan_activations(LLAMA8B, "8GB", load_in_4bit=True, batch_size=1, seq_len=65536, host_memory_bytes=64 * GiB)


def test_vision_model_that_does_not_fit_is_told_what_to_change():
    """A VLM's message reads the decoder's numbers and offers what FastVisionModel loads: NF4 (not 2-bit), a
    smaller vision-language model (not a text model)."""
    vlm = dict(dtype="bfloat16", batch_size=4, seq_len=325, images_per_row=1, image_size=448,
               finetune_vision_layers=True, host_memory_bytes=64 * GiB)
    with pytest.raises(DoesNotFitError) as info:
        plan_activations("Qwen/Qwen2.5-VL-7B-Instruct", "12GiB", load_in_4bit=False, **vlm)
    msg = str(info.value)
    assert "load_in_4bit=True" in msg and "google/gemma-3-4b-it" in msg
    assert "Llama" not in msg and "load_in_2bit" not in msg
    with pytest.raises(DoesNotFitError) as info:
        plan_activations("Qwen/Qwen2.5-VL-7B-Instruct", "7.7GiB", load_in_4bit=True, **vlm)
    msg = str(info.value)
    assert "offload_embedding=True" in msg and "load_in_2bit" not in msg


def test_host_memory_is_checked_for_offloading():
    with pytest.raises(DoesNotFitError, match="pinned host"):
        plan_activations(LLAMA8B, "9GiB", load_in_4bit=True, batch_size=2, seq_len=4096, host_memory_bytes=2**20)


def test_card_and_size_parsing():
    assert parse_card("t4").key == "t4" and parse_card("Tesla T4").key == "t4"
    assert parse_card("a100-40gb").key == "a100-40gb" and parse_card("A100 80GB").key == "a100-80gb"
    assert parse_card("NVIDIA A100-SXM4-40GB").key == "a100-40gb"
    assert parse_card("NVIDIA H200").key == "h200" and parse_card("L4").key == "l4"
    assert parse_memory("16GB") == 16 * 10**9
    assert parse_memory("16 GiB") == 16 * 2**30
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("1.5gb") == 1_500_000_000
    assert parse_memory(123) == 123
    assert parse_memory("t4") == parse_card("t4").memory_bytes
    with pytest.raises(ValueError, match="no unit"):
        parse_memory("16")
    with pytest.raises(ValueError, match="ambiguous"):
        parse_card("a100")
    with pytest.raises(ValueError, match="Known cards"):
        parse_card("voodoo2")


def test_plan_from_card_name_and_max_memory_agree():
    a = plan_activations(LLAMA8B, "t4", **QLORA)
    b = plan_activations(LLAMA8B, card="t4", **QLORA)
    assert a.modes == b.modes and "T4" in a.summary()


def test_pinned_budget_leaves_the_offload_pools_reserve_free(monkeypatch):
    """By default offloading may pin 80% of the host RAM above the 2 GiB the pool keeps available: with 3 GiB
    available an 8B plan for a T4 pins 0.47 GiB of layer inputs and parks no MLP output (counting the reserve in, it
    would pin 2.3 GiB)."""
    from notebookkit.memory import meters

    monkeypatch.setattr(meters, "host_memory", lambda: meters.HostMemory(rss=0, available=3 * GiB, total=16 * GiB))
    plan = plan_activations(LLAMA8B, "t4", load_in_4bit=True, dtype="float16", batch_size=1, seq_len=4096)
    assert 0 < plan.host_bytes <= 0.8 * GiB


def test_offloaded_layers_park_their_mlps_where_the_host_link_keeps_up():
    """On a T4 every offloaded layer's gate/up copy hides behind its forward, so the plan parks them (as many as
    the pinned host memory holds) and is predicted faster; an H200 carries about two thirds; a post-MLP norm
    parks none; park_mlps=False plans without."""
    from notebookkit.memory.planner import park_offloaded_mlps, parked_mlp_fraction

    kw = dict(load_in_4bit=True, dtype="float16", batch_size=1, seq_len=4096)
    roomy = plan_activations(LLAMA8B, "t4", host_memory_bytes=10 * GiB, **kw)
    tight = plan_activations(LLAMA8B, "t4", host_memory_bytes=3 * GiB, **kw)
    none = plan_activations(LLAMA8B, "t4", host_memory_bytes=2**20, **kw)
    assert "offload_mlp" not in none.modes
    assert "offload_mlp" not in plan_activations(LLAMA8B, "t4", host_memory_bytes=10 * GiB, park_mlps=False, **kw).modes
    parked = [p.modes.count("offload_mlp") for p in (roomy, tight)]
    assert parked[0] > parked[1] > 0
    assert roomy.extra_seconds < tight.extra_seconds < none.extra_seconds
    per_layer = 2 * 4096 * 14336 * 2
    assert tight.host_bytes <= 3 * GiB and tight.host_bytes >= parked[1] * per_layer
    for plan in (roomy, tight):  # room for two parked layers' e, g whose copies may still run
        assert plan.estimate.total + 2 * per_layer <= parse_card("t4").memory_bytes * USABLE
        assert plan.estimate.plan == plan.modes
    shape = model_shape(LLAMA8B)
    assert parked_mlp_fraction(shape, kw, parse_card("t4"))[0] == 1.0
    assert 0.5 < parked_mlp_fraction(shape, dict(kw, batch_size=2), parse_card("h200"))[0] < 0.75
    assert parked_mlp_fraction(model_shape("google/gemma-2-2b-it"), kw, parse_card("t4"))[0] == 0.0
    # spread evenly over the offloaded layers, never the last layer (its input stays on the GPU)
    o, p = "offload", "offload_mlp"
    assert park_offloaded_mlps((o,) * 6, 0.5) == (o, o, p, o, p, o)
    assert park_offloaded_mlps((o,) * 5, 1.0, most=2) == (o, p, o, p, o)
    assert park_offloaded_mlps((o, o, "recompute", "keep"), 1.0) == (p, p, "recompute", "keep")


def test_spread_offloaded_layers_leave_two_kept_at_the_end_and_let_the_link_park_them_all():
    """Spread among kept layers (``layout="spread"``), each offloaded layer's copies ride behind the forwards up to
    the next one: the H200's link, which carries about three fifths of a run of offloaded layers, then carries all
    of them (the T4 emulation's plan, 4096 tokens in fp16 under a 15 GiB cap), and the plan is predicted faster than
    the same layers offloaded first, at the same predicted peak."""
    from notebookkit.memory.planner import offload_spacing, parked_mlp_fraction, spread_offloaded

    o, p, r, k = "offload", "offload_mlp", "recompute", "keep"
    assert spread_offloaded((o,) * 3 + (k,) * 5) == (o, k, o, k, o, k, k, k)
    assert spread_offloaded((o, p, r, k, k, k)) == (o, r, p, k, k, k)
    assert spread_offloaded((o,) * 4 + (r, k)) == (o,) * 4 + (r, k)  # one kept layer: as it is
    assert spread_offloaded((r, k, k)) == (r, k, k)
    assert offload_spacing((o, k, o, k, o, k, k, k)) == 2.0
    assert offload_spacing((o, o, k, k)) == offload_spacing((o, k, k)) == 1.0
    shape = model_shape(LLAMA8B)
    kw = dict(load_in_4bit=True, dtype="float16", batch_size=1, seq_len=4096)
    h200 = parse_card("h200")
    assert parked_mlp_fraction(shape, kw, h200)[0] < 0.8 < parked_mlp_fraction(shape, kw, h200, spacing=1.875)[0]
    plans = {layout: plan_activations(LLAMA8B, budget_bytes=15 * GiB, card=h200, host_memory_bytes=20 * GiB,
                                      layout=layout, **kw) for layout in ("front", "spread")}
    front, spread = plans["front"], plans["spread"]
    assert _ordered(front.modes) and _ordered(spread.modes, "spread") and spread.modes[0] == p
    counts = spread.counts()
    assert counts["keep"] == front.counts()["keep"] and counts["offload"] == 0
    assert counts["offload_mlp"] == len(spread) - counts["keep"] > front.counts()["offload_mlp"]
    assert spread.extra_seconds < front.extra_seconds
    assert spread.estimate.peak_allocated == front.estimate.peak_allocated
    with pytest.raises(ValueError, match="layout"):
        plan_activations(LLAMA8B, budget_bytes=15 * GiB, layout="middle", **kw)
