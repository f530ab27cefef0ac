"""The bundled datasets: they load through ``datasets.load_dataset("json")`` with the promised
columns and sizes, the eval splits hold out facts, answers are consistent and verifiable, images
match their captions, and regeneration is byte-identical."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from notebookkit.embedded import bundled
from notebookkit.embedded.bundled import KINDS, dataset_path, extract_answer, list_bundled, load_bundled
from notebookkit.embedded.generate_datasets import CAPTION_COLOURS, BACKGROUNDS, SIZES

COLUMNS = {
    "chat_sharegpt": {"conversations"},
    "chat_messages": {"messages"},
    "alpaca": {"instruction", "input", "output"},
    "preference": {"prompt", "chosen", "rejected"},
    "grpo_math": {"prompt", "question", "answer", "solution"},
    "captions": {"image", "file_name", "caption", "shape", "colour", "background", "size", "messages"},
}
SIZE_KEY = {"chat_sharegpt": "chat", "chat_messages": "chat"}
SMALL_TALK = {"Hello!", "Hi there!", "Good morning!", "Thank you!", "Thanks a lot."}


@pytest.fixture(scope="session")
def root() -> Path:
    return bundled.ensure_bundled_datasets()


def _rows(kind: str, split: str) -> list[dict]:
    with open(dataset_path(kind, split), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("split", ["train", "eval"])
def test_loads_with_datasets_json(root, kind, split):
    from datasets import load_dataset

    ds = load_dataset("json", data_files=str(dataset_path(kind, split)), split="train")
    assert COLUMNS[kind] <= set(ds.column_names)
    assert len(ds) == SIZES[SIZE_KEY.get(kind, kind)][split]
    assert 200 <= SIZES[SIZE_KEY.get(kind, kind)]["train"] <= 2000


def test_listing_has_row_counts(root):
    listing = list_bundled()
    assert {(r["kind"], r["split"]) for r in listing} == {(k, s) for k in KINDS for s in ("train", "eval")}
    for r in listing:
        assert r["rows"] == SIZES[SIZE_KEY.get(r["kind"], r["kind"])][r["split"]]
        assert Path(r["path"]).is_file()


def test_load_bundled_and_split_aliases(root):
    ds = load_bundled("chat_messages", split="eval")
    assert len(ds) == SIZES["chat"]["eval"]
    assert dataset_path("alpaca", "test") == dataset_path("alpaca", "eval")


def test_unknown_kind_and_split_are_explained():
    with pytest.raises(ValueError, match="chat_messages"):
        dataset_path("chat")
    with pytest.raises(ValueError, match="'train' or 'eval'"):
        dataset_path("alpaca", "dev")


def test_chat_styles_hold_the_same_conversations(root):
    role = {"system": "system", "human": "user", "gpt": "assistant"}
    for split in ("train", "eval"):
        share = _rows("chat_sharegpt", split)
        msgs = _rows("chat_messages", split)
        for a, b in zip(share, msgs):
            assert [{"role": role[t["from"]], "content": t["value"]} for t in a["conversations"]] == b["messages"]


def test_chat_is_multi_turn_with_system_prompts(root):
    rows = _rows("chat_messages", "train")
    assert any(r["messages"][0]["role"] == "system" for r in rows)
    assert any(r["messages"][0]["role"] == "user" for r in rows)
    assert any(sum(m["role"] == "user" for m in r["messages"]) >= 3 for r in rows)
    for r in rows:
        turns = [m for m in r["messages"] if m["role"] != "system"]
        assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2)


def _user_questions(kind: str, split: str) -> set[str]:
    out = set()
    for r in _rows(kind, split):
        if kind == "chat_messages":
            out |= {m["content"] for m in r["messages"] if m["role"] == "user"} - SMALL_TALK
        elif kind == "alpaca":
            out.add((r["instruction"], r["input"]))
        elif kind == "preference":
            out.add(r["prompt"])
        elif kind == "grpo_math":
            out.add(r["question"])
    return out


@pytest.mark.parametrize("kind", ["chat_messages", "alpaca", "preference", "grpo_math"])
def test_eval_split_holds_out_facts(root, kind):
    train, held = _user_questions(kind, "train"), _user_questions(kind, "eval")
    assert held and not (train & held)


def test_answers_are_consistent(root):
    answer_of: dict[str, str] = {}
    for split in ("train", "eval"):
        for r in _rows("chat_messages", split):
            turns = [m for m in r["messages"] if m["role"] != "system"]
            for q, a in zip(turns[::2], turns[1::2]):
                assert answer_of.setdefault(q["content"], a["content"]) == a["content"]
    assert answer_of["What colour is a banana?"] == "A banana is yellow."


def test_preference_pairs_differ_and_chosen_is_the_true_answer(root):
    chat_answers = {}
    for r in _rows("chat_messages", "train"):
        turns = [m for m in r["messages"] if m["role"] != "system"]
        chat_answers.update({q["content"]: a["content"] for q, a in zip(turns[::2], turns[1::2])})
    rows = _rows("preference", "train")
    for r in rows:
        assert r["chosen"] != r["rejected"]
        if r["prompt"] in chat_answers:
            assert r["chosen"] == chat_answers[r["prompt"]]


def test_grpo_answers_are_verifiable(root):
    for split in ("train", "eval"):
        for r in _rows("grpo_math", split):
            assert [m["role"] for m in r["prompt"]] == ["system", "user"]
            assert "<answer>" in r["prompt"][0]["content"]
            assert extract_answer(r["solution"]) == r["answer"]
            m = re.match(r"(\d+) ([+\-x]) (\d+) = (\d+)", r["solution"])
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            assert c == {"+": a + b, "-": a - b, "x": a * b}[op] == int(r["answer"])


def test_extract_answer():
    assert extract_answer("so 3 + 4 = 7\n<answer>7</answer>") == "7"
    assert extract_answer("<answer> 1,000 </answer>") == "1000"
    assert extract_answer("first <answer>1</answer> then <answer>2</answer>") == "2"
    assert extract_answer("The answer is\n#### 42") == "42"
    assert extract_answer("I think it is 42.") is None


def test_captions_images_match_their_captions(root):
    from datasets import Image, load_dataset

    ds = load_dataset("json", data_files=str(dataset_path("captions")), split="train").cast_column("image", Image())
    for i in range(0, len(ds), 15):
        row = ds[i]
        img = row["image"].convert("RGB")
        assert img.size == (64, 64)
        assert row["colour"] in row["caption"] and row["shape"] in row["caption"]
        pixels = list(img.getdata())
        assert pixels.count(BACKGROUNDS[row["background"]]) > 0
        assert pixels.count(CAPTION_COLOURS[row["colour"]]) > (20 if row["size"] == "small" else 200)
        assert row["messages"][1]["content"][0]["text"] == row["caption"]
    loaded = load_bundled("captions", split="eval")
    assert loaded[0]["image"].size == (64, 64)


def test_generation_is_deterministic(tmp_path):
    a, b = bundled.ensure_bundled_datasets(tmp_path / "a"), bundled.ensure_bundled_datasets(tmp_path / "b")
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and not p.name.startswith("."))
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert files_a == files_b and len(files_a) > 300
    for rel in files_a:
        da, db = (a / rel).read_bytes(), (b / rel).read_bytes()
        if rel.parts[0] == "captions" and rel.suffix == ".jsonl":
            da = da.replace(str(a).encode(), b"ROOT")
            db = db.replace(str(b).encode(), b"ROOT")
        assert da == db, rel


def test_chat_rows_render_with_every_tiny_template(root):
    from transformers import AutoTokenizer

    from notebookkit.embedded.tiny import TINY_MODELS, ensure_tiny_model

    rows = _rows("chat_messages", "train")[:60]
    for name in TINY_MODELS:
        tok = AutoTokenizer.from_pretrained(ensure_tiny_model(name))
        for r in rows:
            text = tok.apply_chat_template(r["messages"], tokenize=False)
            assert r["messages"][-1]["content"] in text


def test_sft_set_is_learnable_in_tens_of_steps(root):
    """Twenty full fine-tuning steps of the pre-trained tiny-llama on ``chat_messages`` cut the
    loss on the held-out conversations' assistant tokens by more than a third."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from notebookkit.embedded.tiny import ensure_tiny_model

    folder = ensure_tiny_model("notebookkit/tiny-llama")
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder)
    marker = tok("<|start_header_id|>assistant<|end_header_id|>\n\n", add_special_tokens=False)["input_ids"]
    eot = tok.convert_tokens_to_ids("<|eot_id|>")

    def encode(messages):
        ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        labels, on, i = [-100] * len(ids), False, 0
        while i < len(ids):
            if ids[i:i + len(marker)] == marker:
                i, on = i + len(marker), True
                continue
            if on:
                labels[i] = ids[i]
                on = ids[i] != eot
            i += 1
        return ids, labels

    def batch(examples):
        width = max(len(ids) for ids, _ in examples)
        pad = tok.pad_token_id
        x = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in examples])
        y = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in examples])
        return x, (x != pad).long(), y

    train = [encode(r["messages"]) for r in _rows("chat_messages", "train")[:400]]
    held = batch([encode(r["messages"]) for r in _rows("chat_messages", "eval")[:40]])

    def held_loss():
        model.eval()
        with torch.no_grad():
            return model(input_ids=held[0], attention_mask=held[1], labels=held[2]).loss.item()

    before = held_loss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = random.Random(0)
    model.train()
    for _ in range(20):
        x, mask, y = batch(rng.sample(train, 8))
        loss = model(input_ids=x, attention_mask=mask, labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = held_loss()
    assert after < 0.66 * before, (before, after)
