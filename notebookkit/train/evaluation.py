"""Evaluation on a held-back split: answer loss and exact match, before and after training.

For a prompt x (the conversation up to the last user turn, rendered with the chat template and the
generation prompt) and its reference answer y = (y_1..y_m) (the held-back assistant turn plus the
turn-end token), the *answer loss* is the mean negative log-likelihood under teacher forcing,

    NLL(y | x) = - (1/m) * sum_j log p(y_j | x, y_<j) ,

averaged over items weighted by m (so it is the held-out per-token cross-entropy on answers only;
exp(NLL) is the answer perplexity). *Exact match* greedily decodes an answer and compares it with
the reference after normalising case, surrounding whitespace and trailing punctuation. The loss moves
smoothly with training even when a small model's generations are not yet exactly right.

Nothing here trains; models are switched to eval mode and back.
"""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = [
    "QAItem",
    "ExactMatchResult",
    "split_heldout",
    "qa_items",
    "answer_loss",
    "exact_match",
    "generate_reply",
    "normalize_answer",
]


@dataclass
class QAItem:
    """A held-out question: the prompt messages and the reference answer text."""

    messages: list[dict[str, str]]
    reference: str

    @property
    def question(self) -> str:
        """The last user message."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")


def split_heldout(dataset: Any, n_eval: int = 16, seed: int = 3407) -> tuple[Any, Any]:
    """Hold back ``n_eval`` rows (a seeded shuffle, so the split is the same every run).

    Returns ``(train, heldout)``; the held-back rows are never trained on.
    """
    n_eval = min(n_eval, max(1, len(dataset) // 5))
    parts = dataset.train_test_split(test_size=n_eval, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def qa_items(dataset: Any, column: str = "messages", limit: int | None = None) -> list[QAItem]:
    """Turn conversations into :class:`QAItem`: the last assistant turn is the reference, everything
    before it the prompt."""
    items = []
    for row in dataset:
        msgs = list(row[column])
        last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
        if last is None or last == 0:
            continue
        items.append(QAItem(messages=msgs[:last], reference=msgs[last]["content"]))
        if limit is not None and len(items) >= limit:
            break
    return items


def normalize_answer(text: str) -> str:
    """Lower-case, collapse whitespace, drop surrounding whitespace and trailing punctuation."""
    text = re.sub(r"\s+", " ", text.strip().lower())
    return text.rstrip(" .!?;:,")


def _eval_mode(model: Any):
    """Evaluation mode and the fast decode path for the block, restored after (:mod:`notebookkit.models.generation_mode`)."""
    from notebookkit.models.generation_mode import generation_mode

    return generation_mode(model)


def _device(model: Any) -> Any:
    try:
        return model.get_input_embeddings().weight.device
    except Exception:
        return next(model.parameters()).device


def _prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def answer_loss(model: Any, tokenizer: Any, items: Sequence[QAItem]) -> float:
    """Held-out answer loss: mean per-token NLL of the reference answers given their prompts."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    device = _device(model)
    with _eval_mode(model):
        for item in items:
            prompt = _prompt_ids(tokenizer, item.messages)
            full = list(tokenizer.apply_chat_template(
                item.messages + [{"role": "assistant", "content": item.reference}], tokenize=True, return_dict=True
            )["input_ids"])
            start = 0
            while start < min(len(prompt), len(full)) and prompt[start] == full[start]:
                start += 1
            if start >= len(full):
                continue
            ids = torch.tensor([full], device=device)
            logits = model(input_ids=ids).logits[0].float()
            targets = ids[0, start:]
            nll = F.cross_entropy(logits[start - 1 : len(full) - 1], targets, reduction="sum")
            total += float(nll)
            count += len(full) - start
    if count == 0:
        raise ValueError("answer_loss: no answer tokens to score (empty references?).")
    return total / count


def generate_reply(
    model: Any,
    tokenizer: Any,
    messages: list[dict[str, str]] | str,
    max_new_tokens: int = 64,
    stream: bool = False,
    do_sample: bool = False,
    **generate_kwargs: Any,
) -> str:
    """Answer a conversation (or a single user message) with the chat template.

    ``stream=True`` prints tokens as they are generated (``transformers.TextStreamer``). Decoding
    is greedy unless ``do_sample=True``. Generation stops at the tokenizer's EOS (the turn-end token
    after ``get_chat_template``).
    """
    import torch

    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    ids = torch.tensor([_prompt_ids(tokenizer, messages)], device=_device(model))
    streamer = None
    if stream:
        from transformers import TextStreamer

        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        eos_token_id=sorted(eos_ids) or None,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        streamer=streamer,
    )
    if not do_sample:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    kwargs.update(generate_kwargs)
    with _eval_mode(model):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@dataclass
class ExactMatchResult:
    """Exact-match score and the per-question table (displays as HTML in Jupyter)."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def score(self) -> float:
        """Fraction of questions answered exactly (after normalisation)."""
        return sum(r["match"] for r in self.rows) / len(self.rows) if self.rows else 0.0

    def __str__(self) -> str:
        lines = [f"exact match {self.score:.0%} ({sum(r['match'] for r in self.rows)}/{len(self.rows)})"]
        for r in self.rows:
            lines.append(f"  [{'x' if r['match'] else ' '}] {r['question'][:60]!r} -> {r['answer'][:60]!r} "
                         f"(expected {r['reference'][:40]!r})")
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))

    def _repr_html_(self) -> str:
        head = "<tr><th>question</th><th>expected</th><th>model</th><th>match</th></tr>"
        body = "".join(
            f"<tr><td>{html.escape(r['question'])}</td><td>{html.escape(r['reference'])}</td>"
            f"<td>{html.escape(r['answer'])}</td><td>{'✔' if r['match'] else '✘'}</td></tr>"
            for r in self.rows
        )
        return f"<p>Exact match: <b>{self.score:.0%}</b></p><table>{head}{body}</table>"


def exact_match(model: Any, tokenizer: Any, items: Sequence[QAItem], max_new_tokens: int = 32) -> ExactMatchResult:
    """Greedy answers to held-out questions compared with the references (see :func:`normalize_answer`)."""
    rows = []
    for item in items:
        answer = generate_reply(model, tokenizer, item.messages, max_new_tokens=max_new_tokens)
        rows.append(dict(
            question=item.question,
            reference=item.reference,
            answer=answer.strip(),
            match=normalize_answer(answer) == normalize_answer(item.reference),
        ))
    return ExactMatchResult(rows)


def perplexity(loss: float) -> float:
    """exp(loss), capped to stay finite."""
    return math.exp(min(loss, 50.0))
