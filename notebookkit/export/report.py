"""Export each chosen form, reload it, and report one row per form (the export notebook's table).

Row fields: ``form``, ``path``, ``size_on_disk``, ``max_logit_diff`` (largest logit difference
against the adapter model on the fixed prompts; for GGUF, teacher-forced in llama.cpp),
``greedy_equal`` ("k/n" prompts whose greedy continuations are equal), ``within_tolerance`` (for
GGUF also: llama.cpp tokenizes alike and its differences are the size the format's rounding
explains, continuations parting only at near-ties, see ``GGUFCheck.explained``; for
``merged_4bit_forced``: the loaded 4-bit weights are exactly the merge's NF4 quantisation; its
logit difference is stated, with the measured weight rounding in ``note``) and ``canary`` (the
canary fact recalled from the reloaded artefact, when a canary is given).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import torch.nn as nn

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
    if verify and "gguf" in forms:  # before any export: the GGUF check needs llama.cpp
        from .kquants import require_llama_cpp

        require_llama_cpp(purpose="Verifying a GGUF export")
    rows: list[dict] = []
    if "lora" in forms:
        r = model.save_pretrained_merged(out / "lora", tokenizer, save_method="lora", verbose=False)
        rows.append({"form": "lora", "path": str(r.path), "size_on_disk": format_bytes(r.bytes_on_disk)})
    for form in ("merged_16bit", "merged_4bit_forced"):
        if form not in forms:
            continue
        with warnings.catch_warnings():  # merged_4bit_forced's rounding warning: its numbers go into the row
            warnings.simplefilter("ignore", UserWarning)
            r = model.save_pretrained_merged(out / form, tokenizer, save_method=form, maximum_memory_usage=maximum_memory_usage,
                                             verbose=False)
        row = {"form": form, "path": str(r.path), "size_on_disk": format_bytes(r.bytes_on_disk)}
        if "nf4_relative_error" in r.measurements:
            row["note"] = f"NF4 rounding {r.measurements['nf4_relative_error']:.1%} of the weights"
        if verify:
            from .verify import check_merged_folder, reload_merged_folder

            check = check_merged_folder(model, r.path, tokenizer, n_tokens=8)
            row.update(max_logit_diff=f"{check.max_abs_diff:.2e}", greedy_equal=f"{check.greedy_equal}/{check.prompts}",
                       within_tolerance=check.ok)
            if canary is not None:
                row["canary"] = canary.recalled_by(reload_merged_folder(r.path), tokenizer)
        rows.append(row)
    if "gguf" in forms:
        results = model.save_pretrained_gguf(out / "gguf", tokenizer, list(gguf_methods), maximum_memory_usage=maximum_memory_usage, verbose=False)
        for r in results:
            row = {"form": f"gguf {r.form}", "path": str(r.path), "size_on_disk": format_bytes(r.bytes_on_disk)}
            if verify:
                from .verify import _llama, check_gguf_file, greedy_llama_cpp

                check = check_gguf_file(model, r.path, tokenizer, n_tokens=8, method=r.form)
                row.update(max_logit_diff=f"{check.max_abs_diff:.2e}", greedy_equal=f"{check.greedy_equal}/{check.prompts}",
                           within_tolerance=check.within(r.form) and check.tokenizer_equal and check.explained())
                if canary is not None:
                    llm = _llama(r.path)
                    try:
                        tokens, _ = greedy_llama_cpp(llm, canary.prompt_ids(tokenizer), canary.recall_tokens)
                    finally:
                        llm.close()
                    row["canary"] = canary.recalled(tokenizer, tokens)
            rows.append(row)
    return rows
