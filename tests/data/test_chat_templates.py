"""Chat templates: rendering, EOS mapping, aliases, ShareGPT conversion, marker detection."""

from __future__ import annotations

import warnings

import pytest

from notebookkit.data.chat_templates import (
    CHAT_TEMPLATES,
    apply_generation_eos,
    get_chat_template,
    list_chat_templates,
    template_spec,
)
from notebookkit.data.responses_only import detect_markers
from notebookkit.data.sharegpt import standardize_sharegpt, to_role_content
from tests.data.chat_tokenizer import CONVO, make_tokenizer


@pytest.mark.parametrize("name", list_chat_templates())
def test_renders_every_turn_and_generation_prompt(name):
    tok = get_chat_template(make_tokenizer(), name)
    spec = CHAT_TEMPLATES[name]
    text = tok.apply_chat_template(CONVO, tokenize=False)
    for msg in CONVO:
        assert msg["content"] in text
    assert text.count(spec.response_part.strip()) == 2
    prompt = tok.apply_chat_template(CONVO[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.rstrip().endswith(spec.response_part.strip())
    assert template_spec(tok).jinja == spec.jinja


@pytest.mark.parametrize("name", list_chat_templates())
def test_eos_is_the_turn_end_token(name):
    tok = get_chat_template(make_tokenizer(), name)
    spec = CHAT_TEMPLATES[name]
    expected = spec.stop_token or "</s>"
    assert tok.eos_token == expected
    assert tok.pad_token is not None and tok.pad_token != tok.eos_token
    # Every assistant turn ends with the EOS token, so a model trained on it learns to stop.
    # (Formats with a turn-end token close user/system turns with it too; gemma folds the system turn.)
    ids = tok.apply_chat_template(CONVO, tokenize=True, return_dict=True)["input_ids"]
    expected_count = {"mistral": 2, "alpaca": 2, "gemma": 4, "gemma-3": 4}.get(name, 5)
    assert ids.count(tok.eos_token_id) == expected_count


def test_generation_config_gets_turn_end_id():
    class Gen:
        eos_token_id = 2
        pad_token_id = None

    class Model:
        generation_config = Gen()

    tok = make_tokenizer()
    model = Model()
    get_chat_template(tok, "chatml", model=model)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == [im_end, 2]
    assert apply_generation_eos(model, tok) == [im_end, 2]


def test_aliases_and_unknown_name():
    assert template_spec("llama3").name == "llama-3"
    assert template_spec("Qwen2.5").name == "qwen-2.5"
    get_chat_template(make_tokenizer(), chat_template="gemma3")
    with pytest.raises(ValueError, match="chatml"):
        get_chat_template(make_tokenizer(), "vicuna-9")


def test_missing_special_tokens_are_added_with_a_warning():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<s>", "</s>", "a", "b"])}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    with pytest.warns(UserWarning, match="resize_token_embeddings"):
        get_chat_template(tok, "chatml")
    assert tok.convert_tokens_to_ids("<|im_end|>") >= 4
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "</s>"
    with pytest.raises(ValueError, match="add_missing_tokens"):
        get_chat_template(PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>"), "gemma",
                          add_missing_tokens=False)


@pytest.mark.parametrize("name", list_chat_templates())
def test_marker_detection_from_a_foreign_template(name):
    """A template we did not install (same text, different source) is probed by rendering."""
    tok = get_chat_template(make_tokenizer(), name)
    tok.chat_template = tok.chat_template + "{#- a copy #}"
    assert template_spec(tok) is None
    instruction, response = detect_markers(tok)
    spec = CHAT_TEMPLATES[name]
    assert response.strip() == spec.response_part.strip()
    assert instruction.strip() == spec.instruction_part.strip()


def test_standardize_sharegpt():
    from datasets import Dataset

    ds = Dataset.from_list(
        [
            {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                               {"from": "gpt", "value": "A"}], "id": 1},
        ]
    )
    out = standardize_sharegpt(ds)
    assert out.column_names == ["conversations", "id"]
    assert out[0]["conversations"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]
    msgs = standardize_sharegpt(ds, output_column="messages")
    assert "conversations" not in msgs.column_names and msgs[0]["messages"][2]["role"] == "assistant"
    with pytest.raises(ValueError, match="unknown role"):
        to_role_content([{"from": "narrator", "value": "x"}])


def test_guess_chat_template_prefers_formats_the_vocabulary_has():
    from notebookkit.data.chat_templates import guess_chat_template

    assert guess_chat_template(make_tokenizer()) == "llama-3"  # the test vocabulary has every format's tokens
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(vocab={"<s>": 0, "</s>": 1, "<|im_start|>": 2, "<|im_end|>": 3}, merges=[]))
    assert guess_chat_template(PreTrainedTokenizerFast(tokenizer_object=raw)) == "chatml"
    raw = Tokenizer(models.BPE(vocab={"<s>": 0, "</s>": 1}, merges=[]))
    assert guess_chat_template(PreTrainedTokenizerFast(tokenizer_object=raw)) == "alpaca"


def test_guess_chat_template_from_model_name():
    from notebookkit.data.chat_templates import guess_chat_template

    tok = make_tokenizer()
    assert guess_chat_template(tok, "Qwen/Qwen3-0.6B") == "qwen-3"
    assert guess_chat_template(tok, "notebookkit/tiny-gemma3") == "gemma-3"
    assert guess_chat_template(tok, "notebookkit/tiny-mistral") == "mistral"
    assert guess_chat_template(tok, "meta-llama/Llama-3.2-1B-Instruct") == "llama-3.1"


def test_install_chat_template_keeps_a_harmony_tokenizers_own():
    """A notebook's template cell (``install_chat_template``): gpt-oss (no notebookkit format) keeps the
    template its tokenizer ships and stops at its EOS; a name given, or a family with a format, installs one."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from notebookkit.data.chat_templates import install_chat_template

    def model(model_type):
        return SimpleNamespace(config=SimpleNamespace(model_type=model_type), generation_config=GenerationConfig())

    own = "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    tok, gpt_oss = make_tokenizer(), model("gpt_oss")
    tok.chat_template = own
    assert install_chat_template(tok, gpt_oss) is None
    assert tok.chat_template == own and tok.eos_token_id in [gpt_oss.generation_config.eos_token_id]
    tok = make_tokenizer()
    tok.chat_template = own
    assert install_chat_template(tok, model("gpt_oss"), "chatml") == "chatml"
    assert template_spec(tok).name == "chatml"
    tok = make_tokenizer()
    tok.chat_template = own
    name = install_chat_template(tok, model("llama"), model_name="meta-llama/Llama-3.2-1B")
    assert name in CHAT_TEMPLATES and template_spec(tok).jinja == CHAT_TEMPLATES[name].jinja
