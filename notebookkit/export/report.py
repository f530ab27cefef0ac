"""Export each chosen form, reload it, and report one row per form (the export notebook's table).

Row fields: ``form``, ``path``, ``size_on_disk``, ``max_logit_diff`` (largest logit difference
against the adapter model on the fixed prompts; for GGUF, teacher-forced in llama.cpp),
``greedy_equal`` ("k/n" prompts whose greedy continuations are equal), ``within_tolerance`` (for
GGUF also: llama.cpp tokenizes alike and its differences are the size the format's rounding
explains, continuations parting only at near-ties, see ``GGUFCheck.explained``; for
``merged_4bit_forced``: the loaded 4-bit weights are exactly the merge's NF4 quantisation; its
logit difference is stated, with the measured weight rounding in ``note``) and ``canary`` (the
canary fact recalled from the reloaded artefact, when a canary is given).

The forms are the rows of :mod:`notebookkit.export_forms`, written in that table's order: a form that
takes GGUF types gives one row per type, the others one row; a form without a reload check (the
adapter) gets no check columns.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import torch.nn as nn

from notebookkit.export_forms import EXPORT_FORMS, ExportForm

from .canary import Canary
from .checks import format_bytes

__all__ = ["export_and_verify"]


def export_and_verify(
    model: nn.Module,
    tokenizer: Any,
    output_dir: os.PathLike,
    forms: Sequence[str] = ("lora", "merged_16bit", "gguf"),
    gguf_methods: Sequence[str] = ("q8_0",),
    maximum_memory_usage: float = 0.75,
    verify: bool = True,
    canary: Optional[Canary] = None,
) -> list[dict]:
    """Write ``forms`` under ``output_dir`` (``lora/``, ``merged_16bit/``, ``merged_4bit_forced/``, ``gguf/``) and check each."""
    out = Path(output_dir)
    chosen = [form for form in EXPORT_FORMS.values() if form.name in forms]
    if verify and any(form.check == "gguf_file" for form in chosen):  # before any export: the check needs llama.cpp
        from .kquants import require_llama_cpp

        require_llama_cpp(purpose="Verifying a GGUF export")
    rows: list[dict] = []
    for form in chosen:
        if form.quantized:
            rows += _gguf_rows(model, tokenizer, out, form, gguf_methods, maximum_memory_usage, verify, canary)
        elif form.check is None:
            rows.append(_unchecked_row(model, tokenizer, out, form))
        else:
            rows.append(_merged_row(model, tokenizer, out, form, maximum_memory_usage, verify, canary))
    return rows


def _row(form: str, result: Any) -> dict:
    return {"form": form, "path": str(result.path), "size_on_disk": format_bytes(result.bytes_on_disk)}


def _unchecked_row(model: nn.Module, tokenizer: Any, out: Path, form: ExportForm) -> dict:
    """A form with nothing to reload against (the adapter alone)."""
    r = model.save_pretrained_merged(out / form.name, tokenizer, save_method=form.name, verbose=False)
    return _row(form.name, r)


def _merged_row(model: nn.Module, tokenizer: Any, out: Path, form: ExportForm, maximum_memory_usage: float, verify: bool,
                canary: Optional[Canary]) -> dict:
    """A merged folder, reloaded with transformers and compared (``merged_16bit``, ``merged_4bit_forced``)."""
    with warnings.catch_warnings():  # merged_4bit_forced's rounding warning: its numbers go into the row
        warnings.simplefilter("ignore", UserWarning)
        r = model.save_pretrained_merged(out / form.name, tokenizer, save_method=form.name,
                                         maximum_memory_usage=maximum_memory_usage, verbose=False)
    row = _row(form.name, r)
    if "nf4_relative_error" in r.measurements:
        row["note"] = f"NF4 rounding {r.measurements['nf4_relative_error']:.1%} of the weights"
    if verify:
        from .verify import check_merged_folder, reload_merged_folder

        check = check_merged_folder(model, r.path, tokenizer, n_tokens=8)
        row.update(max_logit_diff=f"{check.max_abs_diff:.2e}", greedy_equal=f"{check.greedy_equal}/{check.prompts}",
                   within_tolerance=check.ok)
        if canary is not None:
            row["canary"] = canary.recalled_by(reload_merged_folder(r.path), tokenizer)
    return row


def _gguf_rows(model: nn.Module, tokenizer: Any, out: Path, form: ExportForm, gguf_methods: Sequence[str], maximum_memory_usage: float,
               verify: bool, canary: Optional[Canary]) -> list[dict]:
    """One GGUF file per type, each loaded in llama.cpp and compared."""
    rows = []
    results = model.save_pretrained_gguf(out / form.name, tokenizer, list(gguf_methods), maximum_memory_usage=maximum_memory_usage,
                                         verbose=False)
    for r in results:
        row = _row(f"{form.name} {r.form}", r)
        if verify:
            from .verify import check_gguf_file, greedy_llama_cpp, load_llama_cpp

            check = check_gguf_file(model, r.path, tokenizer, n_tokens=8, method=r.form)
            row.update(max_logit_diff=f"{check.max_abs_diff:.2e}", greedy_equal=f"{check.greedy_equal}/{check.prompts}",
                       within_tolerance=check.within(r.form) and check.tokenizer_equal and check.explained())
            if canary is not None:
                llm = load_llama_cpp(r.path)
                try:
                    tokens, _ = greedy_llama_cpp(llm, canary.prompt_ids(tokenizer), canary.recall_tokens)
                finally:
                    llm.close()
                row["canary"] = canary.recalled(tokenizer, tokens)
        rows.append(row)
    return rows
