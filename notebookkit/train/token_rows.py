"""Tokens a model never learned, and training their embedding rows alongside the LoRA adapters.

A token that never occurred in pre-training gets no gradient of its own; with tied input/output
embeddings every such row is pushed the same way by the softmax (away from the hidden states the model
did produce), so the rows end up nearly parallel. The model then cannot tell them apart: it can put
probability on "one of the never-seen tokens" but not on one of them, and LoRA cannot fix that, since
the logit of token ``v`` is ``h . e_v`` and ``e_v`` is frozen. (The tiny default never saw ``<``, ``>``,
``/`` or its end-of-turn token in pre-training; reserved special tokens of real checkpoints are the
same case.) :func:`untrained_tokens` finds such rows among the tokens of some text; :func:`train_token_rows`
makes exactly those rows trainable for a run.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Sequence

__all__ = ["untrained_tokens", "train_token_rows"]


def _output_rows(model: Any) -> Any:
    head = model.get_output_embeddings()
    return head.weight if head is not None else model.get_input_embeddings().weight


def untrained_tokens(model: Any, tokenizer: Any, texts: Iterable[str], *, cosine: float = 0.98,
                     min_duplicates: int = 16) -> list[int]:
    """Ids of the tokens of ``texts`` whose output embedding is a near-copy of many others.

    A row counts as untrained when at least ``min_duplicates`` other rows have a cosine similarity
    above ``cosine`` with it (trained rows of a real vocabulary have a handful of near neighbours at
    most). Returns the ids sorted; empty when every token of ``texts`` has its own embedding.
    """
    import torch

    ids = sorted({i for text in texts for i in tokenizer(text, add_special_tokens=False)["input_ids"]})
    if not ids:
        return []
    rows = _output_rows(model).detach().float()
    unit = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-12)
    with torch.no_grad():
        similar = (unit @ unit[ids].T > cosine).sum(dim=0) - 1  # minus the row itself
    return [i for i, n in zip(ids, similar.tolist()) if n >= min_duplicates]


@contextlib.contextmanager
def train_token_rows(model: Any, token_ids: Sequence[int]) -> Iterator[None]:
    """Inside the block, the embedding rows of ``token_ids`` train with whatever trains the adapters.

    The input embedding (and the output embedding, when it is a separate matrix) becomes trainable,
    and a gradient hook zeroes every row but ``token_ids``, so an optimizer built inside the block
    moves only those rows. Use ``weight_decay=0`` for that run: decoupled weight decay would shrink
    every row of a trainable matrix, gradient or not. On leaving, the matrices are frozen again; the
    trained rows keep their new values (they are part of the base weights from then on, so save the
    model, not only the adapter, to keep them).

    In an fp16 model the rows train as fp32 master weights like every trainable parameter
    (:mod:`notebookkit.models.patching.master_weights` casts the matrices at the first training forward); on
    leaving, the matrices go back to the dtype they had, so the rest of the notebook holds them in fp16.
    """
    import torch

    weights = [model.get_input_embeddings().weight]
    head = model.get_output_embeddings()
    if head is not None and head.weight is not weights[0]:
        weights.append(head.weight)
    hooks, was, dtypes = [], [w.requires_grad for w in weights], [w.dtype for w in weights]
    for weight in weights:
        mask = torch.zeros(weight.shape[0], 1, dtype=weight.dtype, device=weight.device)
        mask[list(token_ids)] = 1
        weight.requires_grad_(True)
        hooks.append(weight.register_hook(lambda grad, mask=mask: grad * mask))
    try:
        yield
    finally:
        for weight, hook, before, dtype in zip(weights, hooks, was, dtypes):
            hook.remove()
            weight.requires_grad_(before)
            if weight.dtype != dtype:
                weight.data = weight.data.to(dtype)
