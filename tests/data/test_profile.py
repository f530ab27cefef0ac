"""Token-length profile and the suggested max_seq_length."""

from __future__ import annotations

import numpy as np
import pytest

from notebookkit.data.chat_templates import get_chat_template
from notebookkit.data.profile import profile_lengths, round_up_length
from tests.data.chat_tokenizer import make_tokenizer


def test_round_up_length():
    assert round_up_length(1) == 64
    assert round_up_length(64) == 64
    assert round_up_length(64.2) == 128
    assert round_up_length(300) == 320
    assert round_up_length(300, "power_of_two") == 512
    assert round_up_length(10, "power_of_two") == 64
    with pytest.raises(ValueError):
        round_up_length(3, "nearest")


def test_profile_of_tokenised_rows():
    lengths = list(range(1, 201))
    prof = profile_lengths([{"input_ids": [7] * n} for n in lengths])
    assert prof.p50 == pytest.approx(np.percentile(lengths, 50))
    assert prof.p99 == pytest.approx(np.percentile(lengths, 99))
    assert prof.max == 200 and prof.suggested_max_seq_length == 256
    assert prof.truncated_at_suggestion == 0
    assert "multiple of 64" in str(prof)
    fig = prof.plot()
    assert fig.axes[0].get_xlabel() == "tokens per example"
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_profile_of_messages_and_text_uses_the_chat_template():
    tok = get_chat_template(make_tokenizer(), "chatml")
    msgs = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "good morning"}]
    prof = profile_lengths([{"messages": msgs}] * 3, tok)
    n = len(tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"])
    assert prof.max == n and prof.p50 == n
    prof = profile_lengths([{"text": "hello world"}], tok, rounding="power_of_two")
    assert prof.suggested_max_seq_length == 64 and "power of two" in str(prof)
    with pytest.raises(ValueError, match="tokenizer"):
        profile_lengths([{"text": "x"}])
