"""Checks of the values a notebook passes to ``FastLanguageModel``, made before anything is loaded
or changed, with messages that say what went wrong and what to write instead.

Each check either returns the value in its canonical form (``2048.0`` -> ``2048``) or raises
``ValueError`` / ``TypeError`` naming the function, the argument and the value, so that a failed
call leaves the model exactly as it was.
"""

from __future__ import annotations

import difflib
import numbers
import re
from typing import Any, Iterable, Optional


def positive_int(value: Any, name: str, where: str, hint: str) -> int:
    """``value`` as an ``int`` > 0 (a float with an integral value is accepted), else ``ValueError``.

    ``hint`` says what the argument is and what a good value looks like.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = "a bool" if isinstance(value, bool) else f"a {type(value).__name__}"
        raise TypeError(f"{where}: {name}={value!r} is {kind}, not a whole number. {hint}")
    if not float(value).is_integer() or value <= 0:
        raise ValueError(f"{where}: {name}={value!r} is not a positive whole number. {hint}")
    return int(value)


def positive_number(value: Any, name: str, where: str, hint: str) -> float:
    """``value`` if it is a real number > 0 (not a bool), else ``ValueError`` / ``TypeError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = "a bool" if isinstance(value, bool) else f"a {type(value).__name__}"
        raise TypeError(f"{where}: {name}={value!r} is {kind}, not a number. {hint}")
    if not value > 0:  # also refuses NaN
        raise ValueError(f"{where}: {name}={value!r} must be greater than 0. {hint}")
    return value


def probability(value: Any, name: str, where: str, hint: str) -> float:
    """``value`` if it is a real number in ``[0, 1)`` (not a bool), else ``ValueError`` / ``TypeError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = "a bool" if isinstance(value, bool) else f"a {type(value).__name__}"
        raise TypeError(f"{where}: {name}={value!r} is {kind}, not a number. {hint}")
    if not 0 <= value < 1:
        raise ValueError(f"{where}: {name}={value!r} must be in [0, 1). {hint}")
    return value


def require_model(obj: Any, where: str, api: str = "FastLanguageModel", second: str = "tokenizer") -> None:
    """Refuse what is not a model: the ``(model, tokenizer)`` pair, a tokenizer, anything else.

    The pair is the usual slip: ``model = FastLanguageModel.from_pretrained(...)`` keeps both values
    (``api`` names the class the user called, ``second`` its second value: ``"processor"`` for
    ``FastVisionModel``).
    """
    import torch.nn as nn

    if isinstance(obj, nn.Module):
        return
    if isinstance(obj, tuple) and obj and isinstance(obj[0], nn.Module):
        raise TypeError(
            f"{where}: the model argument is a tuple ({', '.join(type(x).__name__ for x in obj)}), not a model. "
            f"{api}.from_pretrained returns two values: write "
            f"`model, {second} = {api}.from_pretrained(...)` and pass `model`."
        )
    if hasattr(obj, "apply_chat_template") or hasattr(obj, "convert_tokens_to_ids"):
        raise TypeError(
            f"{where}: got a tokenizer ({type(obj).__name__}) where the model is expected. Pass the model, "
            f"e.g. `model = {api}.get_peft_model(model, r=16)`."
        )
    raise TypeError(
        f"{where}: expected the model returned by {api}.from_pretrained (a torch nn.Module), "
        f"got {type(obj).__name__}."
    )


def max_memory_bytes(value: Any, where: str) -> int:
    """Bytes of a ``max_memory`` cap (``"16GB"``, ``"15 GiB"``, a card name such as ``"t4"``, or bytes).

    Raises ``ValueError`` / ``TypeError`` naming the argument, with the forms accepted.
    """
    from notebookkit.memory.cards import CARDS, parse_memory

    try:
        return parse_memory(value)
    except (ValueError, TypeError) as exc:
        error, reason = type(exc), str(exc).removeprefix("notebookkit: ")
    if reason.startswith("unknown GPU card"):
        reason = "it is neither a size with a unit nor a known GPU card"
    if "write" in reason.lower():  # the reason already says what to write
        raise error(f"{where}: max_memory={value!r}: {reason}")
    raise error(
        f"{where}: max_memory={value!r} is not a memory size: {reason.rstrip('.')}. Write a size such as '15GB' "
        f"(10**9 bytes) or '15GiB' (2**30 bytes), a card name ({', '.join(CARDS)}) or a number of bytes; leave it "
        "out to use the GPU's free memory."
    )


_UNEXPECTED_KEYWORD = re.compile(r"unexpected keyword argument '(\w+)'")


def unknown_keyword(exc: TypeError, passed: Iterable[str]) -> Optional[str]:
    """The keyword of ``passed`` that ``exc`` (a ``TypeError`` from a call) says was not expected."""
    match = _UNEXPECTED_KEYWORD.search(str(exc))
    return match.group(1) if match and match.group(1) in set(passed) else None


def unknown_keyword_error(where: str, keyword: str, known: Iterable[str], passed_on_to: str) -> TypeError:
    """A ``TypeError`` for a keyword nobody reads, with the closest known spelling when there is one."""
    known = sorted(set(known))
    close = difflib.get_close_matches(keyword, known, n=1, cutoff=0.75)
    unknown = f"{where}: unknown argument {keyword}=. "
    if close:
        return TypeError(
            unknown + f"Did you mean {close[0]}=? (Keywords {where} does not take go to {passed_on_to}, "
            f"which does not take {keyword}= either.)"
        )
    return TypeError(
        unknown + f"{where} takes {', '.join(known)}; other keywords go to {passed_on_to}, which does not take "
        f"{keyword}= either."
    )
