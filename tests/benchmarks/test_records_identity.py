"""CPU tests of the ``--losses`` section of ``benchmarks/records_identity.py`` (the before/after record of a
refactor): a run is repeatable to the bit, a changed training changes the record while the load and the
adapters' initialisation stay recorded as they were, checkpointing shows in the first step's probe, and the
section covers every text family x checkpointing mode and every tiny VLM. One tiny model (qwen3, no
pre-training), a few runs of 3 steps."""

from __future__ import annotations

import os
import sys

import pytest
import torch

BENCHMARKS = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
sys.path.insert(0, BENCHMARKS)

import records_identity as ri  # noqa: E402

FAMILY = "qwen3"


@pytest.fixture(scope="module")
def record():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield lambda mode=False, generate=False: ri._text_run(FAMILY, "float32", mode, generate=generate)
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def reference(record):
    return record(generate=True)


def test_a_run_is_repeatable_to_the_bit(record, reference):
    assert record(generate=True) == reference
    losses = [float.fromhex(x) for x in reference["losses"]]
    assert len(losses) == ri.LOSS_STEPS and [repr(x) for x in losses] == reference["losses_repr"]
    assert losses[-1] < losses[0]  # it trained
    assert reference["adapter_sha256"] != reference["adapter_init_sha256"]
    assert reference["banner"]["features"]["LoRA fast path"][0]
    prompt = 2  # "The old": the ids end with 6 new tokens
    assert len(reference["generate"]["ids"][0]) >= prompt + 6
    assert len(reference["generate_left_padded"]["ids"]) == 2


def test_a_changed_training_changes_the_record(record, reference, monkeypatch):
    from notebookkit import FastLanguageModel

    original = FastLanguageModel.get_peft_model
    monkeypatch.setattr(FastLanguageModel, "get_peft_model",
                        staticmethod(lambda model, **kw: original(model, **{**kw, "lora_alpha": 17})))
    changed = record()
    assert changed["base_sha256"] == reference["base_sha256"]
    assert changed["adapter_init_sha256"] == reference["adapter_init_sha256"]  # alpha only scales
    assert changed["losses"] != reference["losses"]
    assert changed["adapter_sha256"] != reference["adapter_sha256"]


def test_checkpointing_shows_in_the_first_step(record, reference):
    recomputed = record(mode=True)
    assert recomputed["banner"]["features"]["checkpointing"][0]
    assert not reference["banner"]["features"]["checkpointing"][0]
    assert recomputed["module_calls_step1"] > reference["module_calls_step1"]  # layers run again in the backward
    assert recomputed["saved_tensors_step1"][1] < reference["saved_tensors_step1"][1]  # only layer inputs kept


def test_the_section_covers_every_family_and_mode(monkeypatch):
    from notebookkit.families import FAMILIES

    runs = []
    monkeypatch.setattr(ri, "_text_run", lambda *args, **kw: runs.append(("text", *args)) or {})
    monkeypatch.setattr(ri, "_vision_run", lambda *args, **kw: runs.append(("vision", *args)) or {})
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    out = ri.losses()
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == (threads, deterministic)
    text = {(f, d, m) for _, f, d, m in (r for r in runs if r[0] == "text")}
    assert text == {(f, "float32", m) for f in FAMILIES for m in ri.CHECKPOINT_MODES} | {(f, "bfloat16", False)
                                                                                         for f in FAMILIES}
    vision = {(f, m) for _, f, m in (r for r in runs if r[0] == "vision")}
    assert vision == {(f, m) for f, row in FAMILIES.items() if row.vision for m in ri.CHECKPOINT_MODES}
    assert len(out) == len(runs) == len(set(out))
    assert len(FAMILIES) == 9 and ri.CHECKPOINT_MODES == (False, True, "unsloth")  # 7 dense + 2 MoE rows
