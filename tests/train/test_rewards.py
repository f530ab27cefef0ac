"""Reward helpers for GRPO: the format and correctness rewards on the bundled grpo_math rows, and the checks
that report a reward function's failure with its name and the offending row (no model needed)."""

from __future__ import annotations

import pytest

from notebookkit.train.rewards import (
    RewardFunctionError,
    check_reward_functions,
    checked_reward,
    completion_text,
    correctness_reward,
    extract_tagged_answer,
    format_reward,
)


def _chat(text):
    return [{"role": "assistant", "content": text}]


def test_bundled_solutions_get_full_rewards():
    from notebookkit.data import load_bundled

    rows = load_bundled("grpo_math").select(range(40))
    solutions = [r["solution"] for r in rows]
    assert format_reward(solutions) == [1.0] * 40
    assert correctness_reward([_chat(s) for s in solutions], answer=[r["answer"] for r in rows]) == [1.0] * 40
    wrong = [str(int(r["answer"]) + 1) for r in rows]
    assert correctness_reward(solutions, answer=wrong) == [0.0] * 40


@pytest.mark.parametrize("text, score", [
    ("6 + 2 = 8\n<answer>8</answer>", 1.0),
    ("6 + 2 = 8\n<answer> 8 </answer>\n", 1.0),           # spaces and a final newline are allowed
    ("<answer>8</answer>", 0.5),                            # no working line
    ("6 + 2 = 8 <answer>8</answer>", 0.5),                  # tag on the working line
    ("6 + 2 = 8\n<answer>8</answer> so it is 8", 0.5),      # text after the tag
    ("six plus two\nis eight\n<answer>8</answer>", 0.5),    # two lines of working
    ("6 + 2 = 8\n<answer>eight</answer>", 0.0),             # no number in the tag
    ("6 + 2 = 8\n<answer>8", 0.0),                          # unclosed
    ("The answer is 8.", 0.0),
    ("", 0.0),
])
def test_format_reward_levels(text, score):
    assert format_reward([text]) == [score]
    assert format_reward([_chat(text)]) == [score]


def test_correctness_compares_numbers_and_takes_the_last_tag():
    got = correctness_reward(
        ["<answer>12</answer>", "<answer>1,000</answer>", "<answer>3</answer> no, <answer>4</answer>",
         "<answer>12.0</answer>", "12", "<answer>-5</answer>"],
        answer=["12", "1000", "4", "12", "12", "-5"],
    )
    assert got == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    assert extract_tagged_answer("a <answer> 7 </answer> b") == "7"
    assert extract_tagged_answer("no tag") is None
    assert completion_text([{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}]) == "xy"


def _call(fn, completions, **columns):
    """Call a wrapped reward function the way TRL's GRPOTrainer does (keywords only)."""
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(len(completions))]
    return checked_reward(fn)(prompts=prompts, completions=completions, completion_ids=[[1]] * len(completions),
                              trainer_state=None, log_extra=lambda *a: None, log_metric=lambda *a: None, **columns)


def test_checked_reward_passes_a_good_function_through():
    completions = ["<answer>3</answer>", "x"]
    assert _call(correctness_reward, completions, answer=["3", "4"]) == [1.0, 0.0]
    wrapped = checked_reward(correctness_reward)
    assert wrapped.__name__ == "correctness_reward" and checked_reward(wrapped) is wrapped


def test_a_raising_reward_is_reported_with_its_name_and_row():
    def parse_int_reward(completions, answer, **kwargs):
        return [float(int(completion_text(c).strip()) == int(a)) for c, a in zip(completions, answer)]

    with pytest.raises(RewardFunctionError) as info:
        _call(parse_int_reward, ["3", "4", "four", "5"], answer=["3", "4", "4", "5"])
    message = str(info.value)
    assert "'parse_int_reward' raised ValueError" in message
    assert "row 2 of 4" in message
    assert "completions: 'four'" in message and "prompts: 'question 2'" in message and "answer: '4'" in message
    assert isinstance(info.value.__cause__, ValueError)


def test_a_reward_returning_too_few_values_is_reported_with_the_row_that_drops_out():
    def tagged_only_reward(completions, **kwargs):
        return [1.0 for c in completions if "<answer>" in completion_text(c)]

    with pytest.raises(RewardFunctionError) as info:
        _call(tagged_only_reward, ["<answer>1</answer>", "nothing", "<answer>2</answer>"])
    message = str(info.value)
    assert "'tagged_only_reward' returned 2 values for 3 completions" in message
    assert "On row 1 alone it returned 0 values" in message and "completions: 'nothing'" in message


def test_a_reward_returning_a_scalar_or_text_is_reported():
    def total_reward(completions, **kwargs):
        return 1.0

    with pytest.raises(RewardFunctionError, match=r"'total_reward' returned a float for 2 completions"):
        _call(total_reward, ["a", "b"])

    def label_reward(completions, **kwargs):
        return [1.0, "good"]

    with pytest.raises(RewardFunctionError, match=r"'label_reward' returned 'good' \(str\) for row 1 of 2"):
        _call(label_reward, ["a", "b"])


def test_none_scores_are_allowed():
    def maybe_reward(completions, **kwargs):
        return [None if completion_text(c) == "skip" else 1.0 for c in completions]

    assert _call(maybe_reward, ["skip", "keep"]) == [None, 1.0]


def test_signature_checks_name_the_missing_column():
    columns = ["prompt", "question", "answer"]
    check_reward_functions([format_reward, correctness_reward], columns)  # fine

    def needs_reference(completions, reference, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError) as info:
        check_reward_functions([needs_reference], columns)
    assert "'needs_reference' needs ['reference']" in str(info.value)
    assert "['prompt', 'question', 'answer']" in str(info.value)

    def singular(prompt, completion, **kwargs):
        return []

    with pytest.raises(RewardFunctionError, match=r"prompts= and completions= \(plural\)"):
        check_reward_functions([singular], columns)

    def no_kwargs(completions, answer):
        return []

    with pytest.raises(RewardFunctionError, match=r"'no_kwargs' has no \*\*kwargs, but GRPO calls it with \['prompts'"):
        check_reward_functions([no_kwargs], columns)
