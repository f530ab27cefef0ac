"""The model panel's weight formats come from the base-format record; a 70B on a 24 GB card: 2-bit fits, NF4 not."""

import dataclasses

import pytest

from notebookkit.base_formats import BASE_FORMATS
from notebookkit.widgets import ModelPanel, TrainingPanel
from notebookkit.widgets.model_panel import ModelChoice

LLAMA70 = "meta-llama/Llama-3.1-70B-Instruct"


def test_the_weight_choice_offers_every_format_of_the_record_and_passes_its_flag():
    p = ModelPanel(model_name="meta-llama/Llama-3.1-8B-Instruct", max_seq_length=1024, card="a100-40gb")
    assert [label for label, _ in p.weights.options] == [f.label for f in BASE_FORMATS.values()]
    assert p.weights.value == "nf4" and p.value.load_in_4bit  # the default stays QLoRA
    nf4 = p.last_result.estimate.base_weights
    p.weights.value = "2bit"
    v = p.value
    assert (v.load_in_4bit, v.load_in_2bit, v.load_in_ternary) == (False, True, False)
    assert v.from_pretrained_kwargs()["load_in_2bit"] is True and v.from_pretrained_kwargs()["load_in_4bit"] is False
    two = p.last_result.estimate
    assert two.inputs["base_format"] == "2bit" and two.base_weights < nf4
    p.weights.value = "ternary"
    assert p.value.base_format == "ternary" and p.last_result.estimate.base_weights < two.base_weights
    # every quantised format of the record is a flag the panel can hand to from_pretrained
    fields = {f.name for f in dataclasses.fields(ModelChoice)}
    assert all(f.load_flag in fields for f in BASE_FORMATS.values() if f.load_flag)


def test_70b_on_a_24_gb_card_two_bit_fits_with_its_plan_and_nf4_does_not():
    p = ModelPanel(model_name=LLAMA70, load_in_2bit=True, max_seq_length=2048, card="rtx4090")
    p.link(training=TrainingPanel(per_device_train_batch_size=1, optim="adamw_torch"))
    text = p.estimate_text
    assert "does not fit" in text  # LoRA r=16 with the embedding on the card does not
    lines = {f.base_format.name: f for f in p.last_result.formats}
    assert lines["2bit"].rank == 2 and lines["2bit"].offload_embedding and lines["nf4"].rank == 0
    assert ("2-bit (groups of 64): fits with LoRA r≤2 (fp32 adapters + adamw), input embedding in host RAM "
            "(offload_embedding=True), activations") in text
    assert "max_seq_length 2,048" in text
    assert "NF4 (4-bit): does not fit at any LoRA rank" in text
    assert "offload_embedding=True with LoRA rank r=2" in text  # what to change, from the planner


def test_two_formats_at_once_are_refused():
    with pytest.raises(ValueError, match="Keep one flag"):
        ModelPanel(model_name=LLAMA70, load_in_4bit=True, load_in_ternary=True, card="rtx4090")
