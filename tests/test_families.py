"""Every row of the family record (``notebookkit.families``) is known to every consumer, and its
facts are true of the Hugging Face model it names.

A family added to the table without one of its consumers fails here: the patcher (the fused
path covers every layer), the memory model's shapes (q/k norms, sandwich norms, soft-cap), the
tiny builder (config class, tokenizer set-up, reserved name), the chat templates (the family's
name picks its format), the GGUF export (llama.cpp's architecture and conversions; a mixture of
experts' split expert tensors too), the memory model's vision shapes (the wrapper's tower), the widget
catalogue and the test helpers. A mixture-of-experts row (``Family.moe``) is patched block and router by
block; the consumers that do not serve it yet refuse it with a message (decode, the memory estimate's DPO and
GRPO steps and 2-bit / ternary loading in ``tests/models/test_moe.py``, merged_4bit_forced in
``tests/export/test_merged_moe.py``), and so does ``get_chat_template`` for a row without a format.
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
    """The patched model runs every norm, MLP and attention fused (an MoE family: every sparse block and
    its router); the norm count checks the row's q/k-norm and
    sandwich-norm facts against the Hugging Face class."""
    from notebookkit.models.common.architectures import lookup
    from notebookkit.models.common.decoder_layers import decoder_layers
    from notebookkit.models.patching.patcher import patch_model, patch_summary

    row = FAMILIES[name]
    model = helpers.random_model(name)
    assert lookup(model.config) is row
    assert decoder_layers(model) == list(model.model.layers)
    patch_model(model)
    counts = patch_summary(model)
    layers = model.config.num_hidden_layers
    mlp = "moe" if row.moe is not None else "mlp"
    assert counts[mlp] == layers
    assert counts.get("moe_router", 0) == (layers if row.moe is not None else 0)
    assert counts.get("attention", 0) == layers
    norms = layers * (2 + 2 * row.sandwich_norm + 2 * row.qk_norm) + 1
    assert counts.get("rms_norm", 0) == norms


@pytest.mark.parametrize("name", [n for n in NAMES if FAMILIES[n].moe is not None])
def test_moe_facts_are_true_of_the_model(name):
    """The MoE record's layout is the Hugging Face model's: router (and its bias), stacked experts in
    ``[E, out, in]`` or transposed, expert biases, what the block returns, the config attributes holding
    ``E`` and the experts' width, the names PEFT's ``target_parameters`` take; the memory shape counts them."""
    import torch

    moe = FAMILIES[name].moe
    model = helpers.random_model(name)
    config, block = model.config, model.model.layers[0].mlp
    E, I, H = getattr(config, moe.num_experts), getattr(config, moe.intermediate), config.hidden_size
    router, experts = getattr(block, moe.router), getattr(block, moe.experts)
    assert tuple(router.weight.shape) == (E, H) and (getattr(router, "bias", None) is not None) == moe.router_bias
    gate_up = (E, H, 2 * I) if moe.transposed else (E, 2 * I, H)
    down = (E, I, H) if moe.transposed else (E, H, I)
    assert (tuple(experts.gate_up_proj.shape), tuple(experts.down_proj.shape)) == (gate_up, down)
    assert hasattr(experts, "gate_up_proj_bias") == hasattr(experts, "down_proj_bias") == moe.expert_bias
    out = block(torch.randn(1, 3, H))
    assert isinstance(out, tuple) == moe.returns_scores
    assert all(f"layers.0.{p}" in dict(model.named_parameters()) or f"model.layers.0.{p}" in dict(model.named_parameters())
               for p in moe.lora_parameters)
    assert model_shape(config).num_params == sum(p.numel() for n, p in model.named_parameters() if not n.endswith("bias")
                                                 and "sinks" not in n)


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
        assert bare.tie_word_embeddings == row.tied_embeddings
    import transformers

    assert getattr(transformers, row.config_class)().tie_word_embeddings == row.tied_embeddings


@pytest.mark.parametrize("name", NAMES)
def test_gguf_layout_follows_the_record(name):
    """The GGUF writer's row is the record's, llama.cpp knows the architecture, and every tensor the
    writer takes from the family's model has a llama.cpp name there (a mixture of experts: its stacked
    experts become llama.cpp's gate / up / down expert tensors and its router ``ffn_gate_inp``)."""
    import gguf
    import torch

    from notebookkit.export.gguf_arch import gguf_family
    from notebookkit.export.merge import plan_merged_tensors

    row = FAMILIES[name]
    assert row.gguf is not None, f"{name}: no GGUF layout (GGUF export would refuse the family)"
    layout = gguf_family(helpers.family_config(name))
    assert (layout.arch, layout.permute_qk, layout.softcaps, layout.sliding_pattern) == (
        row.gguf.arch, row.gguf.permute_qk, row.gguf.attn_softcap, row.gguf.sliding_pattern)
    assert layout.norm_shift == (1.0 if row.gemma_norm else 0.0)
    arch = next(a for a, arch_name in gguf.MODEL_ARCH_NAMES.items() if arch_name == row.gguf.arch)
    model = helpers.random_model(name, tie_word_embeddings=row.tiny.tie_word_embeddings)  # as the tiny model is
    names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    tensors = [t.name for t in plan_merged_tensors(model, torch.float32)]
    if row.moe is not None:  # the stacked experts are split / transposed by the writer (gguf_experts)
        from notebookkit.export.gguf_file import gguf_tensors

        written = {t.name for t in gguf_tensors(model, layout)}
        assert {f"blk.1.{t}.weight" for t in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp")} <= written
        tensors = [n for n in tensors if ".experts." not in n]
    missing = [n for n in tensors if names.get_name(n, try_suffixes=(".weight", ".bias")) is None]
    assert not missing, f"{name}: llama.cpp's {row.gguf.arch} layout has no place for {missing}"


@pytest.mark.parametrize("name", [n for n in NAMES if FAMILIES[n].vision is not None])
def test_vision_shape_follows_the_record(name):
    """The memory model knows the family's vision-language wrapper, and the record's tower formulas and
    text q/k/v bias count the parameters of a model built from the tiny config; its messages name it."""
    import torch
    import transformers

    from notebookkit.embedded import generate_vision_models
    from notebookkit.memory.vision_shapes import is_vlm, vlm_shape

    vision = FAMILIES[name].vision
    base = _Vocab()
    ids = generate_tokenizer.special_token_ids(base, name)
    image_ids = {t: i for i, t in enumerate(vision.image_tokens, start=len(generate_tokenizer.SPECIAL_TOKENS))}
    config = generate_vision_models.vision_model_config(name, len(generate_tokenizer.SPECIAL_TOKENS) + 256 + 8, ids,
                                                        image_ids)
    assert config.model_type == vision.model_type and is_vlm(config)
    shape = vlm_shape(config)
    assert shape.vision.kind == vision.tower and shape.text_qkv_bias == vision.text_qkv_bias
    torch.manual_seed(0)
    model = getattr(transformers, vision.model_class)(config)
    in_text = [n for n, _ in model.named_parameters() if "language_model" in n or n.startswith("lm_head")]
    counts = {n: p.numel() for n, p in model.named_parameters()}
    assert sum(counts.values()) - sum(counts[n] for n in in_text) == shape.vision.num_params
    assert sum(counts[n] for n in in_text) == shape.text_params
    assert vision.label and vision.label in str(_unsupported_vision_message())


def _unsupported_vision_message() -> str:
    from notebookkit.memory.vision_shapes import vlm_shape_from_config

    try:
        vlm_shape_from_config({"model_type": "llava", "vision_config": {}})
    except ValueError as exc:
        return str(exc)
    raise AssertionError("an unknown vision-language model_type was accepted")


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
def test_tiny_tokenizer_carries_the_rows_template(name):
    """The tiny tokenizer's template is the row's one copy, and it renders the token set's turn markers."""
    import jinja2

    row = FAMILIES[name]
    tokens = generate_tokenizer.family_tokens(name)
    assert generate_tokenizer.tokenizer_config(name, _Spec())["chat_template"] is row.tokenizer_template

    def refuse(message: str):
        raise ValueError(message)

    template = jinja2.Environment().from_string(row.tokenizer_template)
    text = template.render(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                           bos_token=tokens.bos or "", eos_token=tokens.eos, add_generation_prompt=False,
                           raise_exception=refuse)
    assert tokens.response_marker in text, "the template does not open the answer with the token set's marker"
    assert any("yo" + stop in text for stop in (tokens.eos, *tokens.stop)), "the answer's turn never ends"


@pytest.mark.parametrize("name", NAMES)
def test_family_name_picks_its_chat_template(name):
    """The family's name picks its format; a family without one (gpt-oss's harmony) is refused with the row's
    reason, and its tiny tokenizer's own template (a stand-in) is one notebookkit knows."""
    row = FAMILIES[name]
    if row.chat_template is None:
        from notebookkit.data.chat_templates import get_chat_template

        assert row.chat_template_missing
        for spelling in (name, name.replace("_", "-")):
            with pytest.raises(ValueError, match="No chat template .*do not call get_chat_template"):
                template_spec(spelling)
        with pytest.raises(ValueError, match="harmony"):
            get_chat_template(_Vocab(), name)
        assert guess_chat_template(_Vocab(), row.tiny_name) in CHAT_TEMPLATES
        return
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
    assert name in helpers.FAMILIES + helpers.MOE_FAMILIES
    config = helpers.family_config(name)
    assert type(config).__name__ == row.config_class and config.model_type in row.model_types
