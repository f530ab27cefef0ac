"""Response-only loss: train on what the assistant says, not on the prompt.

A causal LM is trained with next-token cross-entropy over every position whose label is not -100::

    loss = sum_t  m_t * CE(logits_t, y_t)  /  sum_t m_t ,   m_t = [y_t != -100]

(forward only — this step changes labels, not the model, so there is no backward of its own; the
gradient of the positions with m_t = 0 is simply zero.) By default ``labels == input_ids``, so the
model also learns to *write the user's questions and the system prompt*. With response-only loss the
labels outside assistant turns become -100 and every gradient step is spent on answers.

Which tokens are assistant tokens is read from the text itself, with two markers:

* ``response_part``  — the text that opens an assistant turn (``<|im_start|>assistant\\n``);
  labels are kept from the token *after* it,
* ``instruction_part`` — the text that opens a user turn (``<|im_start|>user\\n``);
  labels are dropped from its first token on.

So the assistant's turn-end token (``<|im_end|>``) stays in the loss: that is how the model learns to
stop. Markers are matched as token sequences; a marker string can tokenise differently depending on
the text before it, so a few context variants are tried. When the markers are not given they are
read off the tokenizer's chat template by rendering a probe conversation.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

__all__ = [
    "MarkerNotFoundError",
    "ResponseOnlyStats",
    "detect_markers",
    "marker_token_candidates",
    "response_only_labels",
    "train_on_responses_only",
]

IGNORE_INDEX = -100
_PROBE = ("QZUSERONEQZ", "QZASSTONEQZ", "QZUSERTWOQZ")


class MarkerNotFoundError(ValueError):
    """A response or instruction marker never occurs in the tokenised training data."""


@dataclass
class ResponseOnlyStats:
    """What :func:`train_on_responses_only` did to the labels.

    Attributes:
        instruction_part / response_part: the marker strings used.
        kept_tokens: label tokens left in the loss (assistant turns).
        total_tokens: all tokens of the examples kept.
        examples: examples kept; ``dropped_examples``: examples removed because no assistant token
            was left (for example, the answer was cut off by ``max_length``).
    """

    instruction_part: str
    response_part: str
    kept_tokens: int
    total_tokens: int
    examples: int
    dropped_examples: int

    @property
    def kept_fraction(self) -> float:
        """Fraction of tokens that are trained on (0..1)."""
        return self.kept_tokens / self.total_tokens if self.total_tokens else 0.0

    def __str__(self) -> str:
        s = (
            f"train_on_responses_only: {self.kept_fraction:.1%} of {self.total_tokens:,} tokens are trained on "
            f"(assistant turns) in {self.examples:,} examples"
        )
        if self.dropped_examples:
            s += f"; dropped {self.dropped_examples:,} examples with no assistant token left"
        return s


# ----------------------------------------------------------------------------------------------
# markers


def detect_markers(tokenizer: Any) -> tuple[str, str]:
    """Read ``(instruction_part, response_part)`` off ``tokenizer.chat_template``.

    Templates installed by :func:`notebookkit.data.get_chat_template` carry their markers. For any
    other template a probe conversation is rendered: the response marker is the generation prompt
    (what ``add_generation_prompt=True`` appends), the instruction marker is what stands between the
    end of an assistant turn and the next user message.
    """
    from .chat_templates import template_spec

    spec = template_spec(tokenizer)
    if spec is not None:
        return spec.instruction_part, spec.response_part
    if not getattr(tokenizer, "chat_template", None):
        raise MarkerNotFoundError(
            "The tokenizer has no chat template, so the response markers cannot be detected. Pass them "
            "explicitly, e.g. train_on_responses_only(trainer, instruction_part='### Instruction:\\n', "
            "response_part='### Response:\\n'), or set a template with get_chat_template(tokenizer, 'chatml')."
        )
    u1, a1, u2 = _PROBE

    def render(messages: list[dict[str, str]], gen: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    user1 = [{"role": "user", "content": u1}]
    turn = user1 + [{"role": "assistant", "content": a1}]
    try:
        with_prompt, without = render(user1, True), render(user1, False)
        one_turn = render(turn, False)
        two_turns = render(turn + [{"role": "user", "content": u2}], False)
    except Exception as err:  # a template may refuse the probe (e.g. it demands a system turn)
        raise MarkerNotFoundError(
            f"Could not render a probe conversation with the tokenizer's chat template ({err}). Pass "
            "instruction_part= and response_part= explicitly."
        ) from err

    response = with_prompt[len(without) :] if with_prompt.startswith(without) else ""
    if not response.strip():  # formats without a generation prompt, e.g. [INST] u [/INST] a
        response = one_turn[one_turn.index(u1) + len(u1) : one_turn.index(a1)].strip()
    assistant_end = one_turn[one_turn.index(a1) + len(a1) :]
    between = two_turns[two_turns.index(a1) + len(a1) : two_turns.index(u2)]
    if assistant_end and between.startswith(assistant_end) and len(between) > len(assistant_end):
        instruction = between[len(assistant_end) :]
    else:
        instruction = between
    instruction = instruction.strip() or instruction
    if not response.strip() or not instruction.strip():
        raise MarkerNotFoundError(
            f"Could not detect the turn markers from the chat template (got response_part={response!r}, "
            f"instruction_part={instruction!r}). Pass both explicitly."
        )
    return instruction, response


def marker_token_candidates(tokenizer: Any, text: str) -> list[tuple[int, ...]]:
    """The token sequences ``text`` can appear as inside a tokenised example, longest first.

    BPE merges depend on neighbours, so ``text`` is tokenised after a few typical left contexts
    (nothing, newline, space, a letter) and with its surrounding whitespace stripped. When a space or
    newline merges into the marker's first token, the marker is matched together with it.
    """
    variants = {text, text.strip(), text.rstrip(), text.lstrip()} - {""}
    found: set[tuple[int, ...]] = set()
    for variant in variants:
        for prefix in ("", "\n", "\n\n", " ", "a", "."):
            full = tokenizer.encode(prefix + variant, add_special_tokens=False)
            head = tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
            if full[: len(head)] == head and len(full) > len(head):
                found.add(tuple(full[len(head) :]))
            elif prefix.isspace():  # the space merged into the marker's first token: match it with the space
                found.add(tuple(full))
    return sorted(found, key=lambda c: (-len(c), c))


def _match_spans(ids: np.ndarray, candidates: Sequence[tuple[int, ...]]) -> dict[int, int]:
    """start -> end (exclusive) of the longest candidate matching at each start."""
    spans: dict[int, int] = {}
    n = len(ids)
    for cand in candidates:
        k = len(cand)
        if k == 0 or k > n:
            continue
        starts = np.flatnonzero(ids[: n - k + 1] == cand[0])
        for j in range(1, k):
            if starts.size == 0:
                break
            starts = starts[ids[starts + j] == cand[j]]
        for s in starts.tolist():
            if spans.get(s, -1) < s + k:
                spans[s] = s + k
    return spans


def _keep_mask(
    ids: np.ndarray,
    response: Sequence[tuple[int, ...]],
    instruction: Sequence[tuple[int, ...]],
    boundaries: Sequence[int] = (),
) -> tuple[np.ndarray, int, int]:
    """Boolean mask of assistant tokens, plus the number of response / instruction matches.

    Walks the marker events in order: the end of a response marker switches labels on, the start of an
    instruction marker or of a new packed sequence (``boundaries``) switches them off.
    """
    resp = _match_spans(ids, response)
    instr = _match_spans(ids, instruction)
    events = [(end, 0) for end in resp.values()]
    events += [(start, 1) for start in instr]
    events += [(b, 1) for b in boundaries]
    events.sort()
    keep = np.zeros(len(ids), dtype=bool)
    on_from: int | None = None
    for pos, kind in events:
        if kind == 0:
            if on_from is None:
                on_from = pos
        elif on_from is not None:
            keep[on_from:pos] = True
            on_from = None
    if on_from is not None:
        keep[on_from:] = True
    return keep, len(resp), len(instr)


def response_only_labels(
    input_ids: Sequence[int],
    response: Sequence[tuple[int, ...]],
    instruction: Sequence[tuple[int, ...]],
    labels: Sequence[int] | None = None,
    seq_lengths: Sequence[int] | None = None,
) -> list[int]:
    """Labels for one (possibly packed) example: ``input_ids`` inside assistant turns, -100 elsewhere.

    ``response`` / ``instruction`` are token candidates from :func:`marker_token_candidates`.
    Existing -100 labels stay -100. ``seq_lengths`` splits a packed row into its sequences.
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    bounds = np.cumsum(seq_lengths)[:-1].tolist() if seq_lengths is not None else []
    keep, _, _ = _keep_mask(ids, response, instruction, bounds)
    base = ids if labels is None else np.asarray(labels, dtype=np.int64)
    return np.where(keep & (base != IGNORE_INDEX), base, IGNORE_INDEX).tolist()


# ----------------------------------------------------------------------------------------------
# trainer integration


def _short_decode(tokenizer: Any, ids: Sequence[int], limit: int = 700) -> str:
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    return text if len(text) <= limit else text[:limit] + f" ... [{len(text) - limit} more characters]"


def _marker_error(which: str, instruction_part: str, response_part: str, tokenizer: Any, example_ids: Any) -> str:
    return (
        f"train_on_responses_only: the {which} marker never occurs in the training data.\n"
        f"  instruction_part = {instruction_part!r}\n"
        f"  response_part    = {response_part!r}\n"
        "Every label would be -100 or the user turns would be trained on. This is the first training example "
        "as the model sees it (decoded):\n"
        "----------------------------------------\n"
        f"{_short_decode(tokenizer, example_ids)}\n"
        "----------------------------------------\n"
        "Pass the exact strings that open the user turn and the assistant turn in this text, e.g. "
        "train_on_responses_only(trainer, instruction_part='<|im_start|>user\\n', "
        "response_part='<|im_start|>assistant\\n'), or build the dataset with the chat template you "
        "set with get_chat_template."
    )


def _mask_dataset(
    dataset: Any,
    tokenizer: Any,
    instruction_part: str,
    response_part: str,
    num_proc: int | None,
    name: str,
) -> tuple[Any, ResponseOnlyStats]:
    from datasets import IterableDataset

    response = marker_token_candidates(tokenizer, response_part)
    instruction = marker_token_candidates(tokenizer, instruction_part)
    columns = list(dataset.column_names or [])
    if "input_ids" not in columns:
        raise ValueError(
            f"train_on_responses_only needs a tokenised {name} dataset with an 'input_ids' column, but it has "
            f"{columns}. Build the trainer first (SFTTrainer tokenises the data when it is created), then call "
            "train_on_responses_only(trainer)."
        )

    def fn(batch: dict[str, list]) -> dict[str, list]:
        out_labels, kept, total, n_resp, n_instr = [], [], [], [], []
        has_labels = "labels" in batch
        has_lengths = "seq_lengths" in batch
        for i, ids in enumerate(batch["input_ids"]):
            arr = np.asarray(ids, dtype=np.int64)
            lengths = batch["seq_lengths"][i] if has_lengths else None
            bounds = np.cumsum(lengths)[:-1].tolist() if lengths is not None else []
            keep, r, s = _keep_mask(arr, response, instruction, bounds)
            base = np.asarray(batch["labels"][i], dtype=np.int64) if has_labels else arr
            lab = np.where(keep & (base != IGNORE_INDEX), base, IGNORE_INDEX)
            out_labels.append(lab.tolist())
            kept.append(int((lab != IGNORE_INDEX).sum()))
            total.append(len(arr))
            n_resp.append(r)
            n_instr.append(s)
        return {"labels": out_labels, "_nk_kept": kept, "_nk_total": total, "_nk_resp": n_resp, "_nk_instr": n_instr}

    stats_cols = ["_nk_kept", "_nk_total", "_nk_resp", "_nk_instr"]
    if isinstance(dataset, IterableDataset):
        first = list(dataset.take(64))
        probe = fn({k: [row[k] for row in first] for k in first[0]}) if first else None
        if probe is not None:
            _check_matches(probe, first[0]["input_ids"], instruction_part, response_part, tokenizer)
        mapped = dataset.map(fn, batched=True).remove_columns(stats_cols)
        mapped = mapped.filter(lambda row: any(t != IGNORE_INDEX for t in row["labels"]))
        stats = ResponseOnlyStats(
            instruction_part,
            response_part,
            int(sum(probe["_nk_kept"])) if probe else 0,
            int(sum(probe["_nk_total"])) if probe else 0,
            len(first),
            0,
        )
        return mapped, stats

    kwargs: dict[str, Any] = {"batched": True, "desc": f"Masking non-assistant tokens ({name})"}
    if num_proc:
        kwargs["num_proc"] = num_proc
    mapped = dataset.map(fn, **kwargs)
    cols = {c: mapped[c] for c in stats_cols}
    _check_matches(cols, dataset[0]["input_ids"], instruction_part, response_part, tokenizer)
    kept = np.asarray(cols["_nk_kept"])
    totals = np.asarray(cols["_nk_total"])
    empty = np.flatnonzero(kept == 0)
    if len(empty) == len(kept):
        raise MarkerNotFoundError(
            _marker_error("response", instruction_part, response_part, tokenizer, dataset[0]["input_ids"]).replace(
                "never occurs in the training data", "occurs, but no assistant token is left after it in any example"
            )
        )
    mapped = mapped.remove_columns(stats_cols)
    if len(empty):
        mapped = mapped.select(np.flatnonzero(kept > 0).tolist())
    stats = ResponseOnlyStats(
        instruction_part,
        response_part,
        int(kept.sum()),
        int(totals[kept > 0].sum()),
        int((kept > 0).sum()),
        int(len(empty)),
    )
    return mapped, stats


def _check_matches(cols: dict, example_ids: Any, instruction_part: str, response_part: str, tokenizer: Any) -> None:
    if sum(cols["_nk_resp"]) == 0:
        raise MarkerNotFoundError(_marker_error("response", instruction_part, response_part, tokenizer, example_ids))
    if sum(cols["_nk_instr"]) == 0:
        raise MarkerNotFoundError(
            _marker_error("instruction", instruction_part, response_part, tokenizer, example_ids)
        )


class ResponseOnlyCollator:
    """Wraps a data collator and sets labels to -100 outside assistant turns of each collated batch.

    Used when the trainer's collator rebuilds labels from ``input_ids`` and ignores a ``labels``
    column (older TRL releases). Packed, padding-free batches are split at ``position_ids == 0``.
    """

    def __init__(self, inner: Callable, response: Sequence[tuple[int, ...]], instruction: Sequence[tuple[int, ...]]):
        self.inner = inner
        self.response = list(response)
        self.instruction = list(instruction)

    def __call__(self, examples: list[dict]) -> dict:
        import torch

        batch = self.inner(examples)
        ids = batch["input_ids"].cpu().numpy()
        pos = batch.get("position_ids")
        pos = pos.cpu().numpy() if pos is not None and "attention_mask" not in batch else None
        keep = np.zeros_like(ids, dtype=bool)
        for row in range(ids.shape[0]):
            bounds = np.flatnonzero(pos[row] == 0)[1:].tolist() if pos is not None else []
            keep[row], _, _ = _keep_mask(ids[row], self.response, self.instruction, bounds)
        labels = batch["labels"]
        batch["labels"] = torch.where(torch.from_numpy(keep).to(labels.device), labels, IGNORE_INDEX)
        return batch


def _collator_honours_labels(trainer: Any, dataset: Any) -> bool:
    """Collate two examples and check that tokens we masked stay masked."""
    collator = getattr(trainer, "data_collator", None)
    if collator is None or len(dataset) == 0:
        return True
    rows = [dataset[i] for i in range(min(2, len(dataset)))]
    keys = [k for k in ("input_ids", "labels", "seq_lengths") if k in rows[0]]
    try:
        batch = collator([{k: row[k] for k in keys} for row in rows])
    except Exception:
        return True  # a collator that needs other columns: trust it (the masking check will show the result)
    got = batch["labels"].reshape(-1).tolist()
    ours = [t for row in rows for t in row["labels"]]
    kept_got = sum(t != IGNORE_INDEX for t in got)
    kept_ours = sum(t != IGNORE_INDEX for t in ours)
    return kept_got <= kept_ours


def train_on_responses_only(
    trainer: Any,
    instruction_part: str | None = None,
    response_part: str | None = None,
    *,
    num_proc: int | None = None,
    verbose: bool = True,
) -> Any:
    """Keep only the assistant turns in the loss of a TRL ``SFTTrainer`` (labels -100 elsewhere).

    Call it after building the trainer and before ``trainer.train()``::

        trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=ds, args=cfg)
        trainer = train_on_responses_only(trainer)          # markers read from the chat template

    Args:
        trainer: an ``SFTTrainer`` whose ``train_dataset`` is tokenised (it is after construction).
        instruction_part: text that opens a user turn, e.g. ``"<|im_start|>user\\n"``.
        response_part: text that opens an assistant turn, e.g. ``"<|im_start|>assistant\\n"``.
            Both are detected from ``tokenizer.chat_template`` when left out.
        num_proc: processes for ``datasets.map``.
        verbose: print the fraction of tokens kept in the loss.

    Raises:
        MarkerNotFoundError: a marker never matches the data; the message names both strings and
            shows one decoded example, so you can copy the right marker from it.

    Returns:
        The trainer (its datasets now carry response-only ``labels``; ``trainer.responses_only_stats``
        holds a :class:`ResponseOnlyStats`).
    """
    tokenizer = getattr(trainer, "processing_class", None) or getattr(trainer, "tokenizer", None)
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a multimodal processor wraps its tokenizer
    if tokenizer is None:
        raise ValueError("train_on_responses_only: the trainer has no tokenizer (processing_class).")
    if instruction_part is None or response_part is None:
        found_instruction, found_response = detect_markers(tokenizer)
        instruction_part = instruction_part if instruction_part is not None else found_instruction
        response_part = response_part if response_part is not None else found_response

    trainer.train_dataset, stats = _mask_dataset(
        trainer.train_dataset, tokenizer, instruction_part, response_part, num_proc, "train"
    )
    eval_ds = getattr(trainer, "eval_dataset", None)
    if eval_ds is not None:
        if isinstance(eval_ds, dict):
            trainer.eval_dataset = {
                k: _mask_dataset(v, tokenizer, instruction_part, response_part, num_proc, f"eval/{k}")[0]
                for k, v in eval_ds.items()
            }
        else:
            trainer.eval_dataset = _mask_dataset(
                eval_ds, tokenizer, instruction_part, response_part, num_proc, "eval"
            )[0]

    from datasets import Dataset

    if isinstance(trainer.train_dataset, Dataset) and not _collator_honours_labels(trainer, trainer.train_dataset):
        trainer.data_collator = ResponseOnlyCollator(
            trainer.data_collator,
            marker_token_candidates(tokenizer, response_part),
            marker_token_candidates(tokenizer, instruction_part),
        )
    if stats.dropped_examples:
        warnings.warn(
            f"train_on_responses_only dropped {stats.dropped_examples} examples that had no assistant token left "
            "(often an answer cut off by max_length).",
            stacklevel=2,
        )
    trainer.responses_only_stats = stats
    if verbose:
        print(stats)
    return trainer
