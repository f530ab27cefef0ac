"""SentencePiece-style tokenizers (Llama 2, Mistral v0.3, Gemma layouts) in GGUF: the metadata as written,
and in llama.cpp the same token ids as Hugging Face and the same greedy continuations.

The tokenizers and the random-weight models are built offline (tests/export/sentencepiece_models.py)."""

from __future__ import annotations

import json
import os

import gguf
import pytest

from notebookkit.export.checks import ExportError
from notebookkit.export.gguf_sentencepiece import merge_scores, sentencepiece_metadata, space_prefix_rule
from tests.export.conftest import lora_model_from
from tests.export.sentencepiece_models import VARIANTS, build_model_folder
from tests.export.gguf_reading import read_gguf

STRINGS = [
    "Hello world, the café ☕ costs 12 coins.\n\nNew  line",  # bytes for é and ☕, a double space, newlines
    " leading space",
    "Sam has 11 apples and gets 12 more, so Sam has 23 apples.",
    "tab\there 多くの",
    "x",
]
SPACE_PREFIX = {"llama2": True, "mistral": False, "gemma": False}
EOT = {"llama2": "</s>", "mistral": "</s>", "gemma": "<end_of_turn>"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sentencepiece")
    return {v: build_model_folder(v, root / v) for v in VARIANTS}


def _adapted(folder):
    return lora_model_from(folder, load_in_4bit=False)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sentencepiece_metadata_as_written(variant, folders, tmp_path):
    model, tokenizer = _adapted(folders[variant])
    (result,) = model.save_pretrained_gguf(tmp_path, tokenizer, "f16", verbose=False)
    tensors, value = read_gguf(result.path)
    arch = value("general.architecture")
    assert arch == {"llama2": "llama", "mistral": "llama", "gemma": "gemma"}[variant]
    assert value("tokenizer.ggml.model") == "llama" and value("tokenizer.ggml.pre") == "default"
    assert "tokenizer.ggml.merges" not in gguf.GGUFReader(result.path).fields
    tokens, types, scores = value("tokenizer.ggml.tokens"), value("tokenizer.ggml.token_type"), value("tokenizer.ggml.scores")
    vocab = tokenizer.get_vocab()
    assert len(tokens) == len(types) == len(scores) == len(vocab) == model.get_base_model().config.vocab_size
    assert all(tokens[i] == t for t, i in vocab.items())
    assert [types[vocab[f"<0x{b:02X}>"]] for b in range(256)] == [6] * 256
    assert types[tokenizer.unk_token_id] == 2 and types[tokenizer.bos_token_id] == 3 and types[tokenizer.eos_token_id] == 3
    for extra in VARIANTS[variant]["extra"]:
        assert types[vocab[extra]] == 3
    assert set(types) <= {1, 2, 3, 6}
    # scores order the merges as Hugging Face ranks them: the token of merge k scores at least -k
    merges = [m if isinstance(m, list) else m.split(" ") for m in json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]]
    for k, (left, right) in enumerate(merges):
        assert scores[vocab[left + right]] >= -k
    assert scores[vocab["".join(merges[0])]] == 0.0 and min(scores) < -len(merges) / 2
    assert value("tokenizer.ggml.add_space_prefix") is SPACE_PREFIX[variant]
    assert value("tokenizer.ggml.add_bos_token") is True and value("tokenizer.ggml.add_eos_token") is False
    assert value("tokenizer.ggml.bos_token_id") == tokenizer.bos_token_id
    assert value("tokenizer.ggml.eot_token_id") == vocab[EOT[variant]]
    assert value("tokenizer.chat_template") == tokenizer.chat_template


def test_space_prefix_rule_of_each_layout():
    prepend = {"type": "Prepend", "prepend": "\u2581"}
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    assert space_prefix_rule({"normalizer": {"type": "Sequence", "normalizers": [prepend, replace]}, "pre_tokenizer": None})
    assert not space_prefix_rule({"normalizer": replace, "pre_tokenizer": None})
    assert not space_prefix_rule({"normalizer": replace, "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}}})
    for scheme, expected in (("always", True), ("first", False), ("never", False)):
        meta = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": scheme, "split": False}
        assert space_prefix_rule({"normalizer": None, "pre_tokenizer": meta}) is expected
    with pytest.raises(ExportError, match=r"Metaspace pre-tokenizer with split=False.*convert_hf_to_gguf"):
        space_prefix_rule({"normalizer": None, "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "split": True}})
    with pytest.raises(ExportError, match="normalizer"):
        space_prefix_rule({"normalizer": {"type": "NFKC"}, "pre_tokenizer": None})


def test_pairs_that_are_not_merges_are_counted_and_warned():
    vocab = {t: i for i, t in enumerate(["<unk>", "<0x0A>", "a", "b", "ab", "bb", "abb"])}
    merges = ["a b", "b b", "ab b"]
    scores, missing = merge_scores(vocab, merges)
    assert scores == {"ab": 0.0, "bb": -1.0, "abb": -2.0} and missing == 1  # ("a", "bb") makes "abb" but is no merge
    spec = {"model": {"type": "BPE", "byte_fallback": True, "vocab": vocab, "merges": merges, "unk_token": "<unk>"},
            "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}, "pre_tokenizer": None}
    with pytest.warns(UserWarning, match="1 pairs of vocabulary tokens join into a token without being one of the tokenizer's merges"):
        meta = sentencepiece_metadata(spec, 9)
    assert meta["token_type"] == [2, 6, 1, 1, 1, 1, 1, 5, 5] and meta["scores"][4:7] == [0.0, -1.0, -2.0]


# ------------------------------------------------------------------------------------- llama.cpp

def _llama_cpp_or_skip():
    if os.environ.get("NOTEBOOKKIT_REQUIRE_LLAMA_CPP") != "1":
        pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make setup installs it)")


def _tokenizations(llm, tokenizer, variant) -> list[tuple[str, list[int], list[int]]]:
    """(text, Hugging Face ids, llama.cpp ids) of each string, after BOS and, where llama.cpp's rule
    matches Hugging Face's there, at the start of the input too (module docstring of gguf_sentencepiece)."""
    out = []
    for s in STRINGS:
        cases = [tokenizer.bos_token + s]
        if variant != "mistral":  # Metaspace "first" prepends at the very start only: see the next test
            cases.append(s)
        for text in cases:
            out.append((text, tokenizer(text, add_special_tokens=False)["input_ids"],
                        llm.tokenize(text.encode(), add_bos=False, special=True)))
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sentencepiece_in_llama_cpp(variant, folders, tmp_path):
    """llama.cpp's tokens equal Hugging Face's; greedy continuations equal for f32 and f16."""
    _llama_cpp_or_skip()
    from notebookkit.export.verify import check_gguf_file, load_llama_cpp

    model, tokenizer = _adapted(folders[variant])
    results = model.save_pretrained_gguf(tmp_path, tokenizer, ["f32", "f16"], verbose=False)
    llm = load_llama_cpp(results[0].path)
    try:
        for text, hf, cpp in _tokenizations(llm, tokenizer, variant):
            assert cpp == hf, f"{variant} {text!r}: llama.cpp {tokenizer.convert_ids_to_tokens(cpp)} != HF {tokenizer.convert_ids_to_tokens(hf)}"
        if variant == "mistral":  # the stated difference: no leading "▁" for text at the very start
            for s in STRINGS:
                hf = tokenizer(s, add_special_tokens=False)["input_ids"]
                assert llm.tokenize((s if s.startswith(" ") else " " + s).encode(), add_bos=False, special=True) == hf
    finally:
        llm.close()
    checks = {r.form: check_gguf_file(model, r.path, tokenizer, n_tokens=12, method=r.form) for r in results}
    for method, check in checks.items():
        print(f"{variant} {check.summary(checks['f32'] if method != 'f32' else None)}")
        assert check.tokenizer_equal and check.within(method), check.summary()
        assert check.greedy_equal == check.prompts, check.continuations
    assert checks["f16"].explained(checks["f32"])


def test_scores_are_what_makes_tokens_agree(folders, tmp_path, monkeypatch):
    """Negative control: with every score equal (as llama.cpp's converter writes a tokenizer.json-only
    Llama vocabulary: -1000), llama.cpp merges leftmost-first and its tokens differ from Hugging Face's."""
    _llama_cpp_or_skip()
    import notebookkit.export.gguf_sentencepiece as sp
    from notebookkit.export.verify import load_llama_cpp

    real = sp.merge_scores
    monkeypatch.setattr(sp, "merge_scores", lambda vocab, merges: ({t: -1000.0 for t in real(vocab, merges)[0]}, 0))
    model, tokenizer = _adapted(folders["llama2"])
    (result,) = model.save_pretrained_gguf(tmp_path, tokenizer, "f16", verbose=False)
    llm = load_llama_cpp(result.path)
    try:
        differ = [text for text, hf, cpp in _tokenizations(llm, tokenizer, "llama2") if hf != cpp]
    finally:
        llm.close()
    assert differ, "equal scores gave the same tokens: the test strings do not exercise the merge order"
