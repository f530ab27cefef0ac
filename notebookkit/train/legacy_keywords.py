"""``SFTTrainer`` keywords of older TRL releases, moved to where the installed TRL reads them.

Until TRL 0.12 a trainer took the tokenizer as ``tokenizer=`` and the data settings as its own
keywords; since then the tokenizer is ``processing_class=`` and the data settings are
``SFTConfig`` fields. The most used fine-tuning notebooks still write the old form::

    SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=dataset,
               dataset_text_field="text", max_seq_length=2048, packing=False, args=SFTConfig(...))

:class:`~notebookkit.train.sft.FastSFTTrainer` accepts it and means the same: the tokenizer becomes
``processing_class`` and each data keyword overrides that field of ``args`` (``max_seq_length`` is
now called ``max_length``), on a copy, so the caller's config object is not changed.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

__all__ = ["OLD_TRAINER_FIELDS", "move_old_sft_keywords"]

#: old trainer keyword -> SFTConfig field it became
OLD_TRAINER_FIELDS: dict[str, str] = {
    "max_seq_length": "max_length",
    "dataset_text_field": "dataset_text_field",
    "packing": "packing",
    "dataset_num_proc": "dataset_num_proc",
    "dataset_kwargs": "dataset_kwargs",
    "eval_packing": "eval_packing",
    "model_init_kwargs": "model_init_kwargs",
    "neftune_noise_alpha": "neftune_noise_alpha",
}


def move_old_sft_keywords(arguments: dict[str, Any]) -> dict[str, Any]:
    """``SFTTrainer`` arguments with the old keywords moved (a new dict; ``arguments`` is unchanged).

    ``tokenizer`` becomes ``processing_class`` (both given: ``TypeError``); the keywords of
    :data:`OLD_TRAINER_FIELDS` are set on a copy of ``args`` (an ``SFTConfig``; a plain
    ``TrainingArguments`` is first turned into one, as TRL does; none: TRL's default config).
    """
    from transformers import TrainingArguments
    from trl import SFTConfig

    out = dict(arguments)
    tokenizer = out.pop("tokenizer", None)
    if tokenizer is not None:
        if out.get("processing_class") is not None:
            raise TypeError(
                "SFTTrainer got both tokenizer= and processing_class=; they are the same argument (TRL renamed "
                "tokenizer to processing_class). Pass one of them."
            )
        out["processing_class"] = tokenizer
    moved = {OLD_TRAINER_FIELDS[k]: out.pop(k) for k in list(out) if k in OLD_TRAINER_FIELDS}
    if not moved:
        return out
    args = out.get("args")
    if args is None:
        model = out.get("model")
        name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
        args = SFTConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1] or 'model'}-SFT", **moved)
    else:
        if not isinstance(args, SFTConfig) and isinstance(args, TrainingArguments):
            values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
            args = SFTConfig(**values)
        else:
            args = copy.copy(args)
        for field, value in moved.items():
            setattr(args, field, value)
    out["args"] = args
    return out
