"""The largest LoRA rank a card trains: Llama-3.1-70B's shape on 24 GiB, at 2-bit and NF4, by hand."""

import pytest

from notebookkit.memory import DoesNotFitError, largest_lora_rank, plan_activations

GiB = 1024**3
MiB = 1024**2
LLAMA70 = "meta-llama/Llama-3.1-70B-Instruct"
HOST = dict(card="rtx4090", host_memory_bytes=64 * GiB)  # the speed model's card and a workstation's RAM
H, I, L, V = 8192, 28672, 80, 128256
PROJ = [(H, H), (H, 1024), (H, 1024), (H, H), (H, I), (H, I), (I, H)]  # (in, out) per layer


def test_70b_at_two_bit_fits_24_gib_at_rank_4_with_the_embedding_on_the_host():
    fit = largest_lora_rank(LLAMA70, "24GiB", load_in_2bit=True, max_rank=16, **HOST)
    assert fit.fits and fit.rank == 4 and fit.offload_embedding
    est = fit.plan.estimate
    # by hand: 2-bit projections at 0.3125 bytes, the 16-bit LM head and norms (the input embedding is on the host)
    weights = L * sum(i * o for i, o in PROJ)
    assert weights == 68_451_041_280
    base = weights * 0.3125 + V * H * 2 + (L * 2 * H + H) * 2
    assert est.base_weights == base
    # r=4: L * r * sum(in + out) fp32 weights, grads, AdamW moments (16 bytes) + bf16 casts (2 bytes)
    lora = L * 4 * sum(i + o for i, o in PROJ)
    assert est.adapters == lora * 18
    assert est.host_offload >= V * H * 2  # the table went to pinned host memory
    assert fit.plan.counts()["keep"] == 0  # every layer's activations leave the card or are recomputed
    # peak: base + adapters + activations, loss buffers and the last layer's recompute (~1.07 GiB with the context)
    assert est.total == pytest.approx(base + lora * 18 + 1.071 * GiB, rel=2e-3)
    # the planner's margin is 8% of what the step adds to the base: 24 - 0.08 * (24 GiB - base)
    assert est.total <= 24 * GiB - 0.08 * (24 * GiB - base) < est.total + L * sum(i + o for i, o in PROJ) * 18
    text = str(fit)
    assert "r=4" in text and "offload_embedding=True" in text and "2-bit" in text


def test_70b_in_nf4_does_not_fit_24_gib_and_says_to_use_two_bit():
    fit = largest_lora_rank(LLAMA70, "24GiB", load_in_4bit=True, max_rank=16, **HOST)
    assert not fit.fits and fit.rank == 0 and fit.plan is None
    # the NF4 projections alone: 68.45e9 * (0.5 + 1/64 + 4/16384) bytes = 32.9 GiB, more than the card
    assert 68_451_041_280 * (0.5 + 1 / 64 + 4 / 16384) > 24 * GiB
    assert "does not fit 24.00 GiB at any LoRA rank" in str(fit)
    assert "load_in_2bit=True" in fit.reason and "a card with more memory" in fit.reason


def test_a_plan_that_cannot_fit_names_what_to_change():
    # 2-bit 70B at r=64 with the embedding on the card: the step does not fit 24 GiB; the message names the
    # rank that fits with the embedding on the host (r=4, as above), a smaller model, a bigger card.
    with pytest.raises(DoesNotFitError) as info:
        plan_activations(LLAMA70, "24GiB", load_in_2bit=True, lora_r=64, seq_len=2048, margin_of="step", **HOST)
    message = str(info.value)
    assert "offload_embedding=True with LoRA rank r=4" in message
    assert "a smaller model" in message and "a card with more memory" in message
    fit = largest_lora_rank(LLAMA70, "16GiB", load_in_2bit=True, max_rank=16, **HOST)
    assert not fit.fits and "Even LoRA rank r=1 does not fit" in str(fit) and "a card with more memory" in str(fit)


def test_a_smaller_card_or_a_tighter_margin_lowers_the_rank():
    rtx = largest_lora_rank(LLAMA70, "rtx4090", load_in_2bit=True, max_rank=16, host_memory_bytes=64 * GiB)
    assert rtx.rank == 2  # 23.64 GiB: 1.5 GiB less headroom than 24 GiB, 0.217 GiB per rank
    assert largest_lora_rank(LLAMA70, "24GiB", load_in_2bit=True, max_rank=16, margin_of="budget", **HOST).rank == 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_rank"):
        largest_lora_rank(LLAMA70, "24GiB", load_in_2bit=True, max_rank=0)
    with pytest.raises(ValueError, match="Keep one flag"):
        largest_lora_rank(LLAMA70, "24GiB", load_in_2bit=True, load_in_4bit=True)
