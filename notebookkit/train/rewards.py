"""Reward functions for GRPO on verifiable answers, and how to write your own.

GRPO samples ``G`` completions per prompt, scores each with every reward function, sums the scores
(``GRPOConfig(reward_weights=...)`` weights them) and trains on the advantage of each completion
within its group, ``A_i = (r_i - mean(r_group)) / std(r_group)``. A reward that never varies within a
group teaches nothing, so a graded reward (partial credit) helps a model that rarely gets it right.

For the bundled ``grpo_math`` data (prompts asking for one line of working, then the final number in
``<answer></answer>`` tags):

* :func:`format_reward`: 1.0 for exactly that format (one line, a newline, ``<answer>N</answer>``, nothing
  after), 0.5 for an ``<answer>N</answer>`` tag anywhere, else 0.0.
* :func:`correctness_reward`: 1.0 when the number in the last answer tag equals the row's ``answer``,
  else 0.0.

Writing your own (TRL's convention)::

    def my_reward(prompts, completions, answer, **kwargs) -> list[float | None]:
        return [1.0 if answer_text in completion_text(c) else 0.0 for c, answer_text in zip(completions, answer)]

It is called once per generation batch, with keywords:

* ``prompts``: one per completion (each prompt repeated ``num_generations`` times): a string, or a
  list of chat turns ``[{"role": ..., "content": ...}]`` when the data set's prompts are chats;
* ``completions``: the sampled completions, aligned with ``prompts``: strings, or
  ``[{"role": "assistant", "content": text}]`` for chat prompts (:func:`completion_text` gives the text
  of either);
* every other column of the data set (``answer``, ``question``, ...), as a list aligned with
  ``completions``, under its column name;
* ``completion_ids`` (the sampled token ids), ``trainer_state`` (``state.global_step``, ...), and
  ``log_extra`` / ``log_metric`` (callables that add a column to TRL's completion table or a scalar
  to the logs).

Name the columns you need as parameters and end with ``**kwargs`` to accept the rest. Return one
number per completion (higher is better), or ``None`` where your function does not apply to that
row (TRL leaves it out of the sum). :class:`~notebookkit.train.grpo.FastGRPOTrainer` checks the
parameters against the data set's columns before training and wraps every function with
:func:`checked_reward`, so a function that raises or returns the wrong number of values is reported
with its name and the offending row.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import re
from fractions import Fraction
from typing import Any, Callable, Iterable, Optional, Sequence

from notebookkit.marks import CHECKED_REWARD

__all__ = [
    "RewardFunctionError",
    "completion_text",
    "extract_tagged_answer",
    "follows_answer_format",
    "format_reward",
    "correctness_reward",
    "checked_reward",
    "check_reward_functions",
    "TRL_REWARD_KEYWORDS",
]


class RewardFunctionError(ValueError):
    """A reward function that cannot be called as GRPO calls it, or that failed on a batch."""


#: keywords TRL passes to every reward function besides the data set's columns
TRL_REWARD_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                       "environments")

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_ANSWER_TAG = re.compile(rf"<answer>\s*({_NUMBER})\s*</answer>", re.IGNORECASE)
_EXACT_FORMAT = re.compile(rf"\A[ \t]*[^\n<]*[^\s<][^\n<]*\n[ \t]*<answer>\s*{_NUMBER}\s*</answer>\s*\Z", re.IGNORECASE)


def completion_text(completion: Any) -> str:
    """The text of one completion as TRL passes it: a string, or a list of chat turns (their contents joined)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, (list, tuple)):
        return "".join(completion_text(turn) for turn in completion)
    return str(completion)


def extract_tagged_answer(text: str) -> Optional[str]:
    """The number in the last ``<answer>N</answer>`` tag of ``text``, commas dropped; ``None`` when there is none."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].replace(",", "") if found else None


def follows_answer_format(text: str) -> bool:
    """Whether ``text`` is exactly one line of working, a newline, then ``<answer>N</answer>`` and nothing else."""
    return bool(_EXACT_FORMAT.match(text))


def _as_number(value: Any) -> Optional[Fraction]:
    try:
        return Fraction(str(value).replace(",", "").strip())
    except (ValueError, ZeroDivisionError):
        return None


def format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 for the exact answer format of the bundled prompts, 0.5 for an answer tag with a number anywhere, else 0.0."""
    scores = []
    for completion in completions:
        text = completion_text(completion)
        scores.append(1.0 if follows_answer_format(text) else 0.5 if extract_tagged_answer(text) is not None else 0.0)
    return scores


def correctness_reward(completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the number in the last answer tag equals the row's ``answer`` (as numbers: ``"12.0" == "12"``), else 0.0."""
    scores = []
    for completion, reference in zip(completions, answer):
        got = extract_tagged_answer(completion_text(completion))
        expected = _as_number(reference)
        scores.append(1.0 if got is not None and expected is not None and _as_number(got) == expected else 0.0)
    return scores


# ------------------------------------------------------------------------------------- checking

def _name(fn: Any) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def _is_async(fn: Any) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _looks_like_turns(value: Any) -> bool:
    turns = value if isinstance(value, list) else [value]
    return bool(turns) and all(isinstance(t, dict) and "content" in t for t in turns)


def _short(value: Any, limit: int = 160) -> str:
    """A value for an error message: chat turns as the text of their last turn, cut to ``limit`` characters."""
    if _looks_like_turns(value):
        value = (value[-1] if isinstance(value, list) else value)["content"]
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def _row(kwargs: dict[str, Any], n: int, i: int) -> dict[str, Any]:
    """Row ``i`` of a reward call's keyword arguments (per-completion lists sliced, the rest kept)."""
    out = {}
    for key, value in kwargs.items():
        if key in ("log_extra", "log_metric"):
            out[key] = lambda *a, **k: None  # probing a row must not log twice
        elif isinstance(value, (list, tuple)) and len(value) == n:
            out[key] = type(value)([value[i]]) if isinstance(value, tuple) else [value[i]]
        else:
            out[key] = value
    return out


def _describe_row(kwargs: dict[str, Any], n: int, i: int) -> str:
    lines = []
    for key, value in kwargs.items():
        if key in ("trainer_state", "log_extra", "log_metric", "completion_ids", "environments"):
            continue
        if isinstance(value, (list, tuple)) and len(value) == n:
            lines.append(f"    {key}: {_short(value[i])}")
    return "\n".join(lines)


def _is_score(value: Any) -> bool:
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, numbers.Real):
        return True
    item = getattr(value, "item", None)  # a 0-d tensor / numpy scalar
    if callable(item) and getattr(value, "ndim", 1) == 0:
        return isinstance(item(), numbers.Real)
    return False


def _first_failing_row(fn: Callable, kwargs: dict[str, Any], n: int, check: Callable[[Any], bool]) -> Optional[tuple[int, Any]]:
    """The first row whose single-row call fails ``check`` (or raises): ``(row, result or exception)``."""
    for i in range(n):
        try:
            result = fn(**_row(kwargs, n, i))
        except Exception as err:  # noqa: BLE001 - reported to the user
            return i, err
        if not check(result):
            return i, result
    return None


def _count(result: Any) -> Optional[int]:
    if isinstance(result, (str, bytes, dict)) or not hasattr(result, "__len__"):
        return None
    return len(result)


def checked_reward(fn: Callable) -> Callable:
    """``fn`` wrapped so that a failure names the function and the offending row.

    The wrapper calls ``fn`` once per batch, exactly as TRL would. When the call raises, returns
    something that is not one value per completion, or a value that is not a number (or ``None``),
    it finds the first row that shows the problem by calling ``fn`` on single rows, and raises a
    :class:`RewardFunctionError` with the function's name, the row's index, prompt, completion and
    columns, and what to change. Async functions and reward models (``nn.Module``) are returned
    unchanged; wrapping twice is a no-op.
    """
    if getattr(fn, CHECKED_REWARD, False) or _is_async(fn) or hasattr(fn, "parameters"):
        return fn
    name = _name(fn)

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> list:
        if args:  # TRL passes keywords only; keep a positional call working as the function would
            return fn(*args, **kwargs)
        n = len(kwargs.get("completions", ()))
        try:
            result = fn(**kwargs)
        except Exception as err:
            found = _first_failing_row(fn, kwargs, n, lambda r: True)
            if found is None:
                raise RewardFunctionError(
                    f"Reward function {name!r} raised {type(err).__name__}: {err} on a batch of {n} completions, "
                    "but not on any single row of it, so it depends on the whole batch. Row 0 was:\n"
                    f"{_describe_row(kwargs, n, 0)}"
                ) from err
            row, cause = found
            raise RewardFunctionError(
                f"Reward function {name!r} raised {type(cause).__name__}: {cause} on row {row} of {n}:\n"
                f"{_describe_row(kwargs, n, row)}\n"
                "A reward function must return a score for any completion, including one that is empty or "
                "malformed: give it a low score (or None to leave the row out) instead of raising."
            ) from err
        count = _count(result)
        if count != n:
            what = f"{count} values" if count is not None else f"a {type(result).__name__}"
            found = _first_failing_row(fn, kwargs, n, lambda r: _count(r) == 1)
            detail = ""
            if found is not None:
                row, bad = found
                bad_what = f"{_count(bad)} values" if _count(bad) is not None else f"{type(bad).__name__}: {bad!r}"
                detail = f" On row {row} alone it returned {bad_what}:\n{_describe_row(kwargs, n, row)}\n"
            raise RewardFunctionError(
                f"Reward function {name!r} returned {what} for {n} completions; it must return a list of exactly "
                f"one score per completion, in order (None where it does not apply).{detail} "
                "A list comprehension with an `if` drops rows: write `[score(c) if ok(c) else 0.0 for c in completions]`."
            )
        for row, value in enumerate(result):
            if not _is_score(value):
                raise RewardFunctionError(
                    f"Reward function {name!r} returned {value!r} ({type(value).__name__}) for row {row} of {n}; each "
                    "score must be a number (or None to leave the row out):\n"
                    f"{_describe_row(kwargs, n, row)}"
                )
        return result

    setattr(checked, CHECKED_REWARD, True)
    checked.__name__ = name
    return checked


def check_reward_functions(reward_funcs: Iterable[Any], columns: Sequence[str]) -> None:
    """Raise :class:`RewardFunctionError` for a reward function GRPO cannot call with these data set columns.

    TRL calls each function with the keywords :data:`TRL_REWARD_KEYWORDS` plus every column except
    ``prompt`` (passed as ``prompts``). A parameter without a default that none of these fill, or a
    function that accepts no ``**kwargs`` and so cannot take all of them, fails on the first step;
    this check says so before training.
    """
    passed = [c for c in columns if c != "prompt"]
    for fn in reward_funcs:
        if isinstance(fn, str) or hasattr(fn, "parameters") or not callable(fn):
            continue
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            continue
        name = _name(fn)
        named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        takes_rest = any(p.kind is p.VAR_KEYWORD for p in params)
        needed = [p.name for p in params
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty]
        missing = [p for p in needed if p not in TRL_REWARD_KEYWORDS and p not in passed]
        if missing:
            hint = ""
            if "prompt" in missing or "completion" in missing:
                hint = " TRL passes the lists as prompts= and completions= (plural)."
            raise RewardFunctionError(
                f"Reward function {name!r} needs {missing}, which GRPO cannot pass: the data set's columns are "
                f"{list(columns)} and TRL adds {list(TRL_REWARD_KEYWORDS[:6])}.{hint} Add the column to the data "
                f"set (dataset = dataset.add_column({missing[0]!r}, values)) or give the parameter a default."
            )
        if not takes_rest:
            extra = [k for k in ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                                 *passed) if k not in named]
            if extra:
                raise RewardFunctionError(
                    f"Reward function {name!r} has no **kwargs, but GRPO calls it with {extra} as well. End its "
                    f"parameters with **kwargs: def {name}(completions, ..., **kwargs)."
                )
