"""One readable error for a model name that cannot be fetched from the Hugging Face Hub.

When ``from_pretrained("some/model")`` fails because the machine is offline (or the name is
misspelled, private or gated), transformers raises a chain of connection and file errors several
screens long. :func:`explain_unreachable` turns that into one short :class:`ModelUnreachableError`
that says what happened and offers the bundled tiny models (one per row of
:mod:`notebookkit.families`), which need no download. ``from_pretrained`` raises it::

    try:
        model = AutoModelForCausalLM.from_pretrained(name)
    except Exception as exc:
        if is_unreachable_error(exc):
            raise explain_unreachable(name, exc) from None    # no stack-trace wall
        raise
"""

from __future__ import annotations

import os

from notebookkit.families import FAMILIES

_OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")

# Words in error messages of huggingface_hub / transformers / requests / httpx / urllib that mean
# "could not get the file" rather than "the file is broken".
_UNREACHABLE_HINTS = (
    "offline", "connection", "connect", "resolve", "name or service not known", "temporary failure",
    "max retries", "timed out", "timeout", "network", "does not appear to have a file",
    "is not a local folder and is not a valid model identifier", "repository not found",
    "couldn't connect", "cannot find the requested files", "we couldn't", "not found on the hub",
    "gated", "401", "404", "outgoing traffic has been disabled", "localentrynotfounderror",
)
_UNREACHABLE_TYPES = (
    "LocalEntryNotFoundError", "RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError",
    "EntryNotFoundError", "OfflineModeIsEnabled", "ConnectionError", "ConnectTimeout", "ReadTimeout",
    "ConnectError", "HTTPError", "HfHubHTTPError", "Timeout", "URLError", "gaierror",
)


class ModelUnreachableError(OSError):
    """A model name could not be loaded from disk or fetched from the Hub."""


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_unreachable_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) means "the Hub could not be reached or
    has no such repository", as opposed to a broken local file or a bug."""
    for e in _chain(exc):
        if type(e).__name__ in _UNREACHABLE_TYPES:
            return True
        text = f"{type(e).__name__}: {e}".lower()
        if any(h in text for h in _UNREACHABLE_HINTS):
            return True
    return False


def _offline_env() -> list[str]:
    return [k for k in _OFFLINE_ENV if os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")]


def _reason(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    innermost = list(_chain(exc))[-1]
    first_line = (str(innermost).strip().splitlines() or [""])[0]
    if len(first_line) > 200:
        first_line = first_line[:197] + "..."
    return f"{type(innermost).__name__}: {first_line}" if first_line else type(innermost).__name__


def explain_unreachable(name: str, exc: BaseException | None = None) -> ModelUnreachableError:
    """Build the one-paragraph error for a model ``name`` that could not be fetched.

    Raise the result with ``from None`` so the notebook shows only this message::

        raise explain_unreachable(name, exc) from None
    """
    env = _offline_env()
    if env:
        why = f"offline mode is switched on ({', '.join(f'{k}=1' for k in env)}), so nothing is downloaded"
    else:
        why = "this machine appears to be offline, or the name is misspelled, private or gated"
    tiny = "\n".join(f"    {f.tiny_name}    ({f.name})" for f in FAMILIES.values())
    detail = _reason(exc)
    message = (
        f"Could not load the model {name!r}: it is not a local folder and could not be fetched from the "
        f"Hugging Face Hub ({why}).\n"
        f"Use one of the bundled tiny models instead; they are built on this machine and need no download:\n"
        f"{tiny}\n"
        f"for example FastLanguageModel.from_pretrained(\"notebookkit/tiny-llama\"), or pass the path of a "
        f"model folder on disk."
    )
    if detail:
        message += f"\n(underlying error: {detail})"
    return ModelUnreachableError(message)


def raise_unreachable(name: str, exc: BaseException | None = None) -> None:
    """``raise explain_unreachable(name, exc) from None``, as a function call."""
    raise explain_unreachable(name, exc) from None


__all__ = ["ModelUnreachableError", "explain_unreachable", "is_unreachable_error", "raise_unreachable"]
