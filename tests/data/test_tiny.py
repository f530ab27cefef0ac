"""The embedded tiny default: names, caching, determinism, loading, tokenizer, chat templates,
pre-training and the offline error.

The models come from the shared cache (built once per machine, ~40 s on 2 cores, then reused by
every test session and every xdist worker); determinism tests build small pieces into temporary
caches.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from notebookkit.embedded import cache, cli, generate_models, tiny
from notebookkit.embedded.generate_tokenizer import FAMILY_TOKENS, SPECIAL_TOKENS, VOCAB_SIZE
from notebookkit.families import FAMILIES as FAMILY_RECORDS
from notebookkit.models.loading.offline import (ModelUnreachableError, explain_unreachable, is_unreachable_error,
                                      raise_unreachable)
from notebookkit.embedded.cache import cached_build
from notebookkit.embedded.tiny import TINY_MODELS, UnknownTinyModelError, ensure_tiny_model, resolve_model_name

FAMILIES = list(TINY_MODELS.values())
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
               "gemma2": "gemma2", "gemma3": "gemma3_text", "qwen3_moe": "qwen3_moe", "gpt_oss": "gpt_oss"}
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What colour is a banana?"},
    {"role": "assistant", "content": "A banana is yellow."},
    {"role": "user", "content": "What sound does a cow make?"},
]
TEMPLATE_MARKERS = {
    "llama": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "mistral": ["<s>", "[INST]", "[/INST]", "</s>"],
    "qwen2": ["<|im_start|>", "<|im_end|>"],
    "qwen3": ["<|im_start|>", "<|im_end|>"],
    "gemma": ["<bos>", "<start_of_turn>", "<end_of_turn>"],
    "gemma2": ["<bos>", "<start_of_turn>", "<end_of_turn>"],
    "gemma3": ["<bos>", "<start_of_turn>", "<end_of_turn>"],
    "qwen3_moe": ["<|im_start|>", "<|im_end|>"],
    "gpt_oss": ["<|im_start|>", "<|im_end|>"],  # a ChatML stand-in: the tiny vocabulary has no harmony tokens
}


def _name(family: str) -> str:
    return f"notebookkit/tiny-{family}"


@pytest.fixture(scope="session")
def tiny_folders() -> dict[str, Path]:
    """Every tiny model folder, from the shared cache (built on first use)."""
    return {fam: ensure_tiny_model(_name(fam)) for fam in FAMILIES}


@pytest.fixture(scope="session")
def tokenizers_by_family(tiny_folders):
    from transformers import AutoTokenizer

    return {fam: AutoTokenizer.from_pretrained(folder) for fam, folder in tiny_folders.items()}


# ------------------------------------------------------------------------------- names

def test_reserved_names_cover_every_family():
    assert sorted(FAMILIES) == sorted(["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3",
                                       "qwen3_moe", "gpt_oss"])
    assert all(n.startswith("notebookkit/tiny-") for n in TINY_MODELS)


def test_resolve_model_name(tiny_folders, tmp_path):
    assert resolve_model_name("notebookkit/tiny-llama") == str(tiny_folders["llama"])
    assert resolve_model_name("NotebookKit/Tiny-Qwen3") == str(tiny_folders["qwen3"])
    assert resolve_model_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model_name(str(tmp_path)) == str(tmp_path)
    assert resolve_model_name(tmp_path) == str(tmp_path)


@pytest.mark.parametrize("call", [resolve_model_name, ensure_tiny_model])
def test_unknown_reserved_name_lists_valid_names(call):
    with pytest.raises(UnknownTinyModelError) as info:
        call("notebookkit/tiny-xyz")
    message = str(info.value)
    assert "notebookkit/tiny-xyz" in message
    for name in TINY_MODELS:
        assert name in message
    assert isinstance(info.value, ValueError)


def test_cached_call_is_instant(tiny_folders, monkeypatch):
    """A cached model is returned without building anything (a wall-clock bound here would measure the
    machine's load, not the cache: this suite runs on shared 2-core CI machines)."""

    def no_build(*args, **kwargs):
        raise AssertionError("ensure_tiny_model built a model that is already in the cache")

    monkeypatch.setattr(tiny, "cached_build", no_build)
    monkeypatch.setattr(tiny, "build_model_folder", no_build)
    for fam in FAMILIES:
        assert ensure_tiny_model(_name(fam)) == tiny_folders[fam]


# ------------------------------------------------------------------------------- folders

@pytest.mark.parametrize("family", FAMILIES)
def test_folder_is_a_normal_hf_folder(tiny_folders, family):
    folder = tiny_folders[family]
    for f in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", cache.STAMP_FILE):
        assert (folder / f).is_file(), f
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"]
    assert tok_cfg["eos_token"] and tok_cfg["pad_token"]
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] is not None and gen["pad_token_id"] is not None
    assert gen["bos_token_id"] is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_and_generates(tiny_folders, tokenizers_by_family, family):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folders[family])
    tok = tokenizers_by_family[family]
    cfg = model.config
    assert cfg.model_type == MODEL_TYPES[family]
    assert tok.is_fast
    assert cfg.vocab_size == len(tok) == VOCAB_SIZE
    assert cfg.hidden_size == 128 and cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2
    assert cfg.head_dim == 32 and cfg.max_position_embeddings == 2048
    assert cfg.tie_word_embeddings == FAMILY_RECORDS[family].tiny.tie_word_embeddings

    ids = tok.apply_chat_template(CHAT, add_generation_prompt=family != "mistral", return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=6, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
    assert torch.isfinite(model(**ids).logits).all()


def test_family_specific_features(tiny_folders):
    from transformers import AutoConfig

    cfg = {fam: AutoConfig.from_pretrained(tiny_folders[fam]) for fam in FAMILIES}

    def rope(c):
        return getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}

    assert rope(cfg["llama"])["rope_type"] == "llama3"
    assert cfg["gemma2"].attn_logit_softcapping == 50.0 and cfg["gemma2"].final_logit_softcapping == 30.0
    assert cfg["gemma2"].sliding_window == 512 and "sliding_attention" in cfg["gemma2"].layer_types
    assert cfg["gemma3"].sliding_window == 512 and cfg["gemma3"].layer_types[0] == "sliding_attention"
    assert cfg["mistral"].sliding_window == 1024
    assert cfg["gemma3"].architectures == ["Gemma3ForCausalLM"]
    # mixture of experts: few experts, top-2, each family's quirks
    qwen, oss = cfg["qwen3_moe"], cfg["gpt_oss"]
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.norm_topk_prob, qwen.moe_intermediate_size) == (8, 2, True, 96)
    assert (oss.num_local_experts, oss.num_experts_per_tok, oss.intermediate_size, oss.swiglu_limit) == (4, 2, 96, 7.0)
    assert oss.sliding_window == 512 and oss.layer_types == ["sliding_attention", "full_attention"]
    assert oss.attention_bias


def test_qwen_and_gemma_modules(tiny_folders):
    from transformers import AutoModelForCausalLM

    qwen3 = AutoModelForCausalLM.from_pretrained(tiny_folders["qwen3"])
    attn = qwen3.model.layers[0].self_attn
    assert hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
    qwen2 = AutoModelForCausalLM.from_pretrained(tiny_folders["qwen2"])
    assert qwen2.model.layers[0].self_attn.q_proj.bias is not None
    gemma2 = AutoModelForCausalLM.from_pretrained(tiny_folders["gemma2"])
    layer = gemma2.model.layers[0]
    assert hasattr(layer, "pre_feedforward_layernorm") and hasattr(layer, "post_feedforward_layernorm")


# ----------------------------------------------------------------------------- tokenizer

ROUNDTRIP_TEXTS = [
    "The colour of a banana is yellow.",
    "  two leading spaces, trailing  ",
    "emoji 🙂👍🏽🇫🇷 and CJK 日本語 and ümlauts, ½ · ∑",
    "tabs\tand\nnew\r\nlines\n\n",
    "What is 123456 + 7?",
    "",
    "<|im_start|> looks special but is text here",
]


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_roundtrip(tokenizers_by_family, family):
    import unicodedata

    tok = tokenizers_by_family[family]
    for text in ROUNDTRIP_TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        expected = unicodedata.normalize("NFC", text) if family.startswith("qwen") else text
        assert tok.decode(ids) == expected


def test_tokenizer_roundtrip_arbitrary_utf8(tokenizers_by_family):
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings, strategies as st

    tok = tokenizers_by_family["llama"]

    @settings(max_examples=60, deadline=None)
    @given(st.text(max_size=40))
    def check(text):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids or tok.unk_token_id is None
        assert tok.decode(ids) == text

    check()


def test_special_tokens_are_single_ids(tokenizers_by_family):
    tok = tokenizers_by_family["llama"]
    vocab = tok.get_vocab()
    for i, t in enumerate(SPECIAL_TOKENS):
        assert vocab[t] == i
        assert tok(t, add_special_tokens=False)["input_ids"] == [i]


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_renders_special_tokens(tokenizers_by_family, family):
    tok = tokenizers_by_family[family]
    fam = FAMILY_TOKENS[family]
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=family != "mistral")
    for marker in TEMPLATE_MARKERS[family]:
        assert marker in text, (marker, text)
    assert "What colour is a banana?" in text and "A banana is yellow." in text
    assert text.count("You are a helpful assistant.") == 1
    if family != "mistral":
        assert text.endswith(fam.response_marker)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for marker in TEMPLATE_MARKERS[family]:
        assert tok.convert_tokens_to_ids(marker) in ids
    assert tok.eos_token == fam.eos and tok.pad_token == fam.pad and tok.bos_token == fam.bos
    assert tok.pad_token_id != tok.eos_token_id


def test_bos_added_as_the_family_does(tokenizers_by_family):
    for family, tok in tokenizers_by_family.items():
        ids = tok("hello")["input_ids"]
        if FAMILY_TOKENS[family].add_bos:
            assert ids[0] == tok.bos_token_id, family
        else:
            assert tok.bos_token is None and ids == tok("hello", add_special_tokens=False)["input_ids"]


def test_qwen3_thinking_switch(tokenizers_by_family):
    tok = tokenizers_by_family["qwen3"]
    off = tok.apply_chat_template(CHAT[1:2], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    on = tok.apply_chat_template(CHAT[1:2], tokenize=False, add_generation_prompt=True)
    assert off.endswith("<think>\n\n</think>\n\n") and on.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("<think>x</think>")["input_ids"], skip_special_tokens=True) == "<think>x</think>"


# ------------------------------------------------------------------------- pre-training

def test_pretrained_llama_beats_fresh_init(tiny_folders):
    import torch
    from transformers import AutoModelForCausalLM

    from notebookkit.embedded.generate_models import build_random_model
    from notebookkit.embedded.generate_pretrain import mean_loss, token_stream, windows
    from notebookkit.embedded.generate_tokenizer import special_token_ids

    base = tiny.load_base_tokenizer()
    held = windows(token_stream(base, tiny.load_corpus("heldout"), "<|begin_of_text|>", "<|end_of_text|>"), 128)
    held = held[:32]
    trained = AutoModelForCausalLM.from_pretrained(tiny_folders["llama"])
    fresh = build_random_model("llama", base.get_vocab_size(), special_token_ids(base, "llama"), seed=7)
    with torch.no_grad():
        trained_loss, fresh_loss = mean_loss(trained, held), mean_loss(fresh, held)
    assert trained_loss < fresh_loss - 3.0, (trained_loss, fresh_loss)
    assert trained_loss < 3.0
    info = json.loads((tiny_folders["llama"] / generate_models.INFO_FILE).read_text())
    assert info["pretrained"] and info["pretrain"]["heldout_loss_after"] < info["pretrain"]["heldout_loss_before"]


# --------------------------------------------------------------------------- determinism

def _files(folder: Path) -> dict[str, bytes]:
    names = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    return {n: (folder / n).read_bytes() for n in names}


def test_build_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for fam in ("qwen3", "gemma2"):
        fa, fb = ensure_tiny_model(_name(fam), cache_dir=a), ensure_tiny_model(_name(fam), cache_dir=b)
        assert fa != fb
        assert _files(fa) == _files(fb), fam
    assert (tiny.ensure_tokenizer(a) / "tokenizer.json").read_bytes() == \
        (tiny.ensure_tokenizer(b) / "tokenizer.json").read_bytes()


def test_shared_cache_matches_fresh_build(tmp_path, tiny_folders):
    fresh = ensure_tiny_model(_name("mistral"), cache_dir=tmp_path)
    assert _files(fresh) == _files(tiny_folders["mistral"])


def test_pretraining_is_deterministic(tmp_path):
    from notebookkit.embedded.generate_pretrain import PretrainConfig

    base = tiny.load_base_tokenizer()
    docs, held = tiny.load_corpus("train")[:300], tiny.load_corpus("heldout")[:40]
    cfg = PretrainConfig(steps=3, batch_size=4, seq_len=32, warmup=1)
    infos = []
    for sub in ("a", "b"):
        infos.append(tiny.build_model_folder("llama", tmp_path / sub, base, tiny.MODEL_SEED, cfg, heldout_docs=held,
                                             train_docs=docs, log=None))
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert infos[0]["pretrain"]["last_loss"] == infos[1]["pretrain"]["last_loss"]


# --------------------------------------------------------------------------------- cache

def test_half_built_folder_is_rebuilt(tmp_path):
    root = cache.cache_root(tmp_path)
    (root / "thing-v1").mkdir(parents=True)
    (root / "thing-v1" / "junk.bin").write_bytes(b"half written")

    def build(tmp, final):
        (tmp / "data.txt").write_text("complete")
        return {"answer": 42}

    folder = cached_build("thing", "v1", build, cache_dir=tmp_path)
    assert not (folder / "junk.bin").exists()
    assert (folder / "data.txt").read_text() == "complete"
    assert json.loads((folder / cache.STAMP_FILE).read_text())["answer"] == 42


def test_failed_build_leaves_nothing(tmp_path):
    def build(tmp, final):
        (tmp / "partial").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        cached_build("broken", "v1", build, cache_dir=tmp_path)
    root = cache.cache_root(tmp_path)
    assert not (root / "broken-v1").exists()
    assert not list(root.glob(".tmp-broken-*"))


def _slow_build_worker(cache_dir: str, counter: str, start_evt) -> None:
    start_evt.wait()

    def build(tmp, final):
        with open(counter, "a") as fh:
            fh.write("built\n")
        time.sleep(0.5)
        (tmp / "payload").write_text("ok")

    folder = cached_build("race", "v1", build, cache_dir=cache_dir)
    assert (folder / "payload").read_text() == "ok"


def test_concurrent_builders_build_once(tmp_path):
    ctx = mp.get_context("spawn" if os.name == "nt" else "fork")
    counter = tmp_path / "count.txt"
    evt = ctx.Event()
    procs = [ctx.Process(target=_slow_build_worker, args=(str(tmp_path), str(counter), evt)) for _ in range(3)]
    for p in procs:
        p.start()
    evt.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert counter.read_text().count("built") == 1


def test_cache_env_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTEBOOKKIT_CACHE", str(tmp_path))
    assert cache.cache_root() == tmp_path / "tiny"
    monkeypatch.delenv("NOTEBOOKKIT_CACHE")
    assert cache.cache_root() == Path.home() / ".cache" / "notebookkit" / "tiny"


def test_main_prints_table(tiny_folders, capsys):
    assert cli.main(["--quiet"]) == 0
    out = capsys.readouterr().out
    for name in TINY_MODELS:
        assert name in out
    for kind in ("chat_sharegpt", "chat_messages", "alpaca", "preference", "grpo_math", "captions"):
        assert kind in out
    assert "params" in out and "rows" in out


# ------------------------------------------------------------------------------- offline

def test_offline_error_is_one_clear_message():
    cause = OSError("We couldn't connect to 'https://huggingface.co' to load the files")
    err = explain_unreachable("meta-llama/Llama-3.2-1B", cause)
    assert isinstance(err, ModelUnreachableError) and isinstance(err, OSError)
    text = str(err)
    assert "meta-llama/Llama-3.2-1B" in text and "offline" in text
    for name in TINY_MODELS:
        assert name in text
    with pytest.raises(ModelUnreachableError) as info:
        raise_unreachable("meta-llama/Llama-3.2-1B", cause)
    assert info.value.__suppress_context__ and info.value.__cause__ is None


def test_offline_error_from_a_real_hub_lookup(monkeypatch):
    from transformers import AutoConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        AutoConfig.from_pretrained("notebookkit-test-org/does-not-exist-anywhere")
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises
        assert is_unreachable_error(exc)
        err = explain_unreachable("notebookkit-test-org/does-not-exist-anywhere", exc)
        assert "HF_HUB_OFFLINE=1" in str(err)
    else:  # pragma: no cover
        pytest.fail("loading a non-existent model offline should fail")


def test_unrelated_errors_are_not_called_unreachable():
    assert not is_unreachable_error(ValueError("shapes (3,4) and (5,6) do not match"))
    assert not is_unreachable_error(KeyError("lm_head.weight"))
