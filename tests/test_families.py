"""Every row of the family record (``notebookkit.families``) is known to every consumer, and its
facts are true of the Hugging Face model it names.

A family added to the table without one of its consumers fails here: the patcher (the fused
path covers every layer), the memory model's shapes (q/k norms, sandwich norms, soft-cap), the
tiny builder (config class, tokenizer set-up, reserved name), the chat templates (the family's
name picks its format), the widget catalogue and the test helpers.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from notebookkit.data.chat_templates import CHAT_TEMPLATES, guess_chat_template, template_spec
from notebookkit.embedded import generate_models, generate_tokenizer
from notebookkit.embedded.tiny import TINY_MODELS
from notebookkit.families import FAMILIES, family, for_model_type, supported_model_types
from notebookkit.memory.shapes import model_shape
from notebookkit.widgets import catalog

from .models import helpers

NAMES = list(FAMILIES)


class _Vocab:
    """Stands for the tiny tokenizer: every special token of the shared vocabulary, by id."""

    name_or_path = ""

    def get_vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(generate_tokenizer.SPECIAL_TOKENS)}

    def token_to_id(self, token: str) -> int:
        return generate_tokenizer.SPECIAL_TOKENS.index(token)


def test_record_imports_without_torch():
    code = ("import sys, notebookkit.families, notebookkit.memory.shapes; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lookup_by_model_type():
    assert supported_model_types() == sorted(t for f in FAMILIES.values() for t in f.model_types)
    assert family("gemma3").model_types == ("gemma3_text",)
    assert for_model_type("gemma3") is None  # the multimodal wrapper is not patched
    assert for_model_type("gemma3", multimodal=True) is FAMILIES["gemma3"]
    with pytest.raises(ValueError, match="supported families are: llama"):
        family("gemma3_text")


@pytest.mark.parametrize("name", NAMES)
def test_patcher_covers_every_layer(name):
    """The patched model runs every norm, MLP and attention fused; the norm count checks the row's
    q/k-norm and sandwich-norm facts against the Hugging Face class."""
    from notebookkit.models.architectures import lookup
    from notebookkit.models.decoder_layers import decoder_layers
    from notebookkit.models.patcher import patch_model, patch_summary

    row = FAMILIES[name]
    model = helpers.random_model(name)
    assert lookup(model.config) is row
    assert decoder_layers(model) == list(model.model.layers)
    patch_model(model)
    counts = patch_summary(model)
    layers = model.config.num_hidden_layers
    assert counts["mlp"] == counts["attention"] == layers
    assert counts["rms_norm"] == layers * (2 + 2 * row.sandwich_norm + 2 * row.qk_norm) + 1


@pytest.mark.parametrize("name", NAMES)
def test_memory_shape_follows_the_record(name):
    row = FAMILIES[name]
    config = helpers.family_config(name)
    shape = model_shape(config)
    assert (shape.qk_norm, shape.sandwich_norms) == (row.qk_norm, row.sandwich_norm)
    softcap = getattr(config, row.attn_softcap_attr, None) if row.attn_softcap_attr else None
    assert shape.attn_softcap == (softcap is not None)
    numbers = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=300)
    for model_type in row.model_types + row.multimodal_model_types:  # a config that does not say: the family default
        bare = model_shape(dict(numbers, model_type=model_type))
        assert (bare.qk_norm, bare.sandwich_norms) == (row.qk_norm, row.sandwich_norm)
        assert bare.attn_softcap == (row.default_attn_softcap is not None)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_builder_knows_the_family(name):
    row = FAMILIES[name]
    assert TINY_MODELS[row.tiny_name] == name
    base = _Vocab()
    ids = generate_tokenizer.special_token_ids(base, name)
    config = generate_models.family_config(name, len(generate_tokenizer.SPECIAL_TOKENS) + 256, ids)
    assert type(config).__name__ == row.config_class and config.model_type in row.model_types
    assert config.num_hidden_layers == row.tiny.layers
    assert generate_tokenizer.tokenizer_config(name, _Spec())["chat_template"]


class _Spec:
    """A base tokenizer with no added tokens, for ``tokenizer_config``."""

    def to_str(self) -> str:
        return '{"added_tokens": []}'


@pytest.mark.parametrize("name", NAMES)
def test_family_name_picks_its_chat_template(name):
    row = FAMILIES[name]
    assert row.chat_template in CHAT_TEMPLATES
    assert template_spec(name).name == row.chat_template
    assert set(CHAT_TEMPLATES[row.chat_template].special_tokens) <= set(generate_tokenizer.SPECIAL_TOKENS)
    assert guess_chat_template(_Vocab(), row.tiny_name) == row.chat_template


@pytest.mark.parametrize("name", NAMES)
def test_catalogue_lists_the_tiny_model(name):
    row = FAMILIES[name]
    assert row.tiny_name in catalog.model_names("Tiny (CPU / CI)")
    shape = catalog._tiny_shape_from_generator(row.tiny_name)
    assert shape.model_type in row.model_types and shape.num_layers == row.tiny.layers
    assert shape.tie_word_embeddings == row.tiny.tie_word_embeddings


@pytest.mark.parametrize("name", NAMES)
def test_test_helpers_build_the_family(name):
    row = FAMILIES[name]
    assert name in helpers.FAMILIES
    config = helpers.family_config(name)
    assert type(config).__name__ == row.config_class and config.model_type in row.model_types
