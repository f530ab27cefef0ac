"""longest_sequence: the planner's longest trainable length under a budget (CPU, no GPU needed)."""

import pytest

from notebookkit.memory import DoesNotFitError, longest_sequence, plan_activations

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # curated shape: no download
KW = dict(load_in_4bit=True, host_memory_bytes=200 * 2**30)


def _fits(seq_len, budget):
    try:
        plan_activations(MODEL, budget, seq_len=seq_len, **KW)
        return True
    except DoesNotFitError:
        return False


@pytest.mark.parametrize("budget", ["t4", "16GB", "24GB"])
def test_answer_is_the_boundary_of_what_the_planner_fits(budget):
    found = longest_sequence(MODEL, budget, step=512, max_seq=2**20, **KW)  # past the model's 131,072 positions
    assert found.seq_len > 0 and found.seq_len % 512 == 0
    assert _fits(found.seq_len, budget)
    assert not _fits(found.seq_len + 512, budget)
    assert f"{found.seq_len:,} tokens" in str(found)


def test_more_memory_or_smaller_batch_gives_longer_sequences():
    t4 = longest_sequence(MODEL, "t4", step=1024, **KW).seq_len
    l4 = longest_sequence(MODEL, "24GB", step=1024, **KW).seq_len
    batch2 = longest_sequence(MODEL, "24GB", step=1024, batch_size=2, **KW).seq_len
    assert t4 < l4 and batch2 < l4


def test_limits_nothing_fits_and_bad_arguments():
    roomy = longest_sequence(MODEL, "a100-80gb", step=1024, max_seq=8192, **KW)
    assert roomy.seq_len == 8192 and "upper limit" in str(roomy)
    tiny = longest_sequence(MODEL, "4GB", step=1024, **KW)  # the 4-bit weights alone need more
    assert tiny.seq_len == 0 and tiny.plan is None and "not even" in str(tiny)
    with pytest.raises(ValueError):
        longest_sequence(MODEL, "t4", step=0, **KW)
    with pytest.raises(ValueError):
        longest_sequence(MODEL, "t4", step=1024, max_seq=512, **KW)
