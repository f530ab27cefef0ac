"""DPO on a FastLanguageModel: TRL's ``DPOTrainer`` with the data checked first and no second model.

Direct Preference Optimisation trains on pairs (prompt ``x``, chosen ``y_w``, rejected ``y_l``). With the
implicit reward ``r(x, y) = beta * (log pi_theta(y | x) - log pi_ref(y | x))`` (log-probabilities summed
over the completion's tokens), the losses are

    sigmoid (DPO):  L = -log sigmoid(r(x, y_w) - r(x, y_l))
    ipo:            L = ((log-ratio_w / |y_w| - log-ratio_l / |y_l|) - 1 / (2 beta))^2

(``DPOConfig(loss_type="ipo")``; TRL averages IPO's log-ratios per token). TRL logs, per step,
``rewards/chosen`` and ``rewards/rejected`` (the mean ``r`` of each side), ``rewards/margins`` (their
difference) and ``rewards/accuracies`` (the fraction of pairs with ``r_w > r_l``); before the first
update ``pi_theta = pi_ref``, so all four are 0, and training should raise the margin and accuracy.

:class:`FastDPOTrainer` is ``trl.DPOTrainer``, used the same way, plus:

* the data sets are checked before TRL sees them (:func:`check_preference_dataset`): a missing
  ``prompt`` / ``chosen`` / ``rejected`` column is named, with the expected format;
* the reference is the same weights (:mod:`notebookkit.train.reference`): a fresh adapter's reference
  is the model with the adapters disabled, and a model without adapters is refused rather than
  copied;
* the loss of a micro-batch is computed in one method, :meth:`FastDPOTrainer._loss`. Today it is TRL's
  own computation: per-token log-probs from TRL's chunked LM head on ``lm_head.weight`` (no full
  logits), for the policy and, under ``torch.no_grad``, for the reference. It is the seam where
  ``notebookkit.train.rl_losses`` takes over; whatever replaces it must log the same
  ``rewards/*`` / ``logps/*`` metrics, which the dashboard reads.
"""

from __future__ import annotations

from typing import Any, Optional

from .trainer_glue import built_once

__all__ = ["PreferenceInputError", "check_preference_dataset", "FastDPOTrainer", "PREFERENCE_COLUMNS"]

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")
_TOKENISED = ("prompt_ids", "chosen_ids", "rejected_ids")


class PreferenceInputError(ValueError):
    """A preference data set (DPO, ORPO) a trainer cannot train on; the message says what to change."""


def _is_turns(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, dict) and {"role", "content"} <= set(t) for t in value)


def _kind(value: Any) -> Optional[str]:
    if isinstance(value, str):
        return "text"
    if _is_turns(value):
        return "chat"
    return None


_EXPECTED = (
    "Expected format, one row per preference pair:\n"
    "  - 'prompt': the question, a string or a list of chat turns [{'role': 'user', 'content': ...}]\n"
    "  - 'chosen': the preferred answer, a string or [{'role': 'assistant', 'content': ...}]\n"
    "  - 'rejected': a worse answer to the same prompt, in the same form as 'chosen'\n"
    "for example {'prompt': 'What colour is a banana?', 'chosen': 'A banana is yellow.', "
    "'rejected': 'A banana is blue.'}"
)


def _rename_hint(columns: list[str], row: dict[str, Any], missing: list[str]) -> str:
    spare = [c for c in columns if c not in PREFERENCE_COLUMNS and _kind(row.get(c)) is not None]
    if len(spare) == len(missing):
        pairs = ", ".join(f"{old!r}: {new!r}" for old, new in zip(spare, missing))
    else:
        pairs = ", ".join(f"'<your {new} column>': {new!r}" for new in missing)
    return f"  dataset = dataset.rename_columns({{{pairs}}})"


def check_preference_dataset(dataset: Any, *, name: str = "train_dataset", trainer: str = "DPOTrainer",
                             tokenised: bool = True) -> None:
    """Raise a readable error when ``dataset`` is not a preference data set ``trainer`` can read.

    Accepted: ``prompt`` / ``chosen`` / ``rejected`` columns of strings or chat turns (both answers
    in the same form as each other); ``chosen`` / ``rejected`` chats alone, whose shared first turns TRL
    takes as the prompt; and, when ``tokenised``, DPO's pre-tokenised ``prompt_ids`` / ``chosen_ids`` /
    ``rejected_ids``.

    Raises:
        TypeError: not a ``datasets.Dataset`` / ``IterableDataset``.
        PreferenceInputError: no rows, a missing column (named, with the expected format and a line
            that renames columns), or a value of the wrong type (the row's column and its type).
    """
    from .trainer_glue import first_row

    row, columns = first_row(dataset, name, trainer, PreferenceInputError)
    if tokenised and set(_TOKENISED) <= set(columns):
        return
    implicit_prompt = "prompt" not in columns and _is_turns(row.get("chosen")) and _is_turns(row.get("rejected"))
    missing = [c for c in PREFERENCE_COLUMNS if c not in columns and not (c == "prompt" and implicit_prompt)]
    if missing:
        raise PreferenceInputError(
            f"{name} has the columns {columns}; {trainer} needs 'prompt', 'chosen' and 'rejected' (missing: {missing}). "
            f"{_EXPECTED}\nMap your columns onto these names, for example:\n{_rename_hint(columns, row, missing)}"
        )
    present = [c for c in PREFERENCE_COLUMNS if c in columns]
    kinds = {c: _kind(row[c]) for c in present}
    for column, kind in kinds.items():
        if kind is None:
            raise PreferenceInputError(
                f"{name}[0][{column!r}] is a {type(row[column]).__name__} ({str(row[column])[:80]!r}); {trainer} reads "
                f"a string or a list of chat turns with 'role' and 'content' there. {_EXPECTED}"
            )
    if kinds.get("chosen") != kinds.get("rejected"):
        raise PreferenceInputError(
            f"{name}[0] has 'chosen' as {kinds['chosen']} and 'rejected' as {kinds['rejected']}; both answers must "
            "have the same form (two strings, or two lists of chat turns) so that they are scored alike."
        )
    if kinds.get("prompt") == "chat" and kinds["chosen"] == "text":
        raise PreferenceInputError(
            f"{name}[0] has a chat 'prompt' but plain-text answers; with a chat prompt the answers are assistant "
            "turns: dataset = dataset.map(lambda row: {'chosen': [{'role': 'assistant', 'content': row['chosen']}], "
            "'rejected': [{'role': 'assistant', 'content': row['rejected']}]})"
        )


def check_preference_datasets(arguments: dict[str, Any], trainer: str, tokenised: bool) -> None:
    """:func:`check_preference_dataset` on the ``train_dataset`` and every ``eval_dataset`` of a trainer call."""
    if arguments.get("train_dataset") is not None:
        check_preference_dataset(arguments["train_dataset"], trainer=trainer, tokenised=tokenised)
    evaluation = arguments.get("eval_dataset")
    if isinstance(evaluation, dict):
        for key, dataset in evaluation.items():
            check_preference_dataset(dataset, name=f"eval_dataset[{key!r}]", trainer=trainer, tokenised=tokenised)
    elif evaluation is not None:
        check_preference_dataset(evaluation, name="eval_dataset", trainer=trainer, tokenised=tokenised)


@built_once(__name__, "FastDPOTrainer")
def _fast_dpo_trainer_class() -> type:
    from trl import DPOTrainer

    from .reference import describe_reference, refuse_second_model, use_base_as_reference
    from .trainer_glue import bind_trainer_arguments, print_banner

    class FastDPOTrainer(DPOTrainer):
        """TRL's ``DPOTrainer`` for a model from ``FastLanguageModel``: same arguments, same use.

        ``FastDPOTrainer(model=model, ref_model=None, args=DPOConfig(...), train_dataset=pairs,
        processing_class=tokenizer)``. The data sets are checked before TRL builds anything; the
        reference is the same weights (adapters disabled while the adapter is fresh, else TRL's frozen
        adapter copy; never a second model). ``DPOConfig(loss_type="ipo")`` selects IPO. Plus:

        Args:
            show_banner: print one line saying what the reference is.
        """

        def __init__(self, *args: Any, show_banner: bool = True, **kwargs: Any) -> None:
            arguments = bind_trainer_arguments(DPOTrainer, args, kwargs)
            check_preference_datasets(arguments, "DPOTrainer", tokenised=True)
            if not getattr(arguments.get("args"), "precompute_ref_log_probs", False):
                refuse_second_model(
                    arguments.get("model"), arguments.get("ref_model"), arguments.get("peft_config"),
                    trainer="FastDPOTrainer", reference_off="DPOConfig(precompute_ref_log_probs=True)",
                )
            super().__init__(**arguments)
            use_base_as_reference(self.model)
            if show_banner:
                print_banner(self, f"DPO ({', '.join(self.loss_types)}, beta={self.beta}); reference: "
                                   f"{describe_reference(self)}")

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return self._loss(model, inputs, return_outputs)

        def _loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False) -> Any:
            """The DPO loss of one micro-batch (and its ``rewards/*`` metrics): TRL's computation today.

            The seam for notebookkit's chunked log-prob loss (``notebookkit.train.rl_losses``): the
            policy's per-token log-probs of ``chosen`` and ``rejected`` (one concatenated batch), the
            reference's under ``torch.no_grad`` with the adapters disabled, then the loss.
            """
            return super().compute_loss(model, inputs, return_outputs=return_outputs)

    return FastDPOTrainer


def __getattr__(name: str) -> Any:
    if name == "FastDPOTrainer":  # built on first use: importing TRL takes seconds
        return _fast_dpo_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
