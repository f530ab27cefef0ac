"""Never-trained token rows on the tiny default: found among the answer format's tokens, and trained (only
those rows) alongside LoRA until the model can write the tag it could not write before."""

from __future__ import annotations

import pytest
import torch

from notebookkit.models import FastLanguageModel
from notebookkit.train.token_rows import train_token_rows, untrained_tokens

TEXT = "6 + 2 = 8\n<answer>8</answer>"


@pytest.fixture(scope="module")
def tiny():
    model, tok = FastLanguageModel.from_pretrained("notebookkit/tiny-llama", max_seq_length=64, load_in_4bit=False,
                                                   show_banner=False)
    return model, tok


def test_the_tag_tokens_are_found_untrained_and_words_are_not(tiny):
    model, tok = tiny
    found = tok.convert_ids_to_tokens(untrained_tokens(model, tok, [TEXT, tok.eos_token]))
    assert {"<", ">", "/", tok.eos_token} <= set(found)
    assert not {"Ġ+", "Ġ=", "Ġ2", "6"} & set(found)
    assert untrained_tokens(model, tok, ["What colour is a banana?"]) == []


def _tag_loss(model, ids, start):
    with torch.no_grad():
        logits = model(ids).logits[0, start - 1:-1].float()
    return torch.nn.functional.cross_entropy(logits, ids[0, start:]).item()


def test_only_the_chosen_rows_train_and_the_tag_becomes_learnable(one_thread):
    model, tok = FastLanguageModel.from_pretrained("notebookkit/tiny-llama", max_seq_length=64, load_in_4bit=False,
                                                   show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=8, show_banner=False, random_state=0)
    ids = tok(TEXT, return_tensors="pt", add_special_tokens=False).input_ids
    start = tok("6 + 2 = 8\n", add_special_tokens=False, return_tensors="pt").input_ids.shape[1]
    labels = ids.clone()
    labels[:, :start] = -100

    def train(steps):
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=5e-3, weight_decay=0.0)
        model.train()
        for _ in range(steps):
            model(input_ids=ids, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()

    train(40)  # LoRA alone (80 steps): the never-seen rows are near-copies of each other, so the tag stays out of reach
    train(40)
    lora_only = _tag_loss(model, ids, start)
    embedding = model.get_input_embeddings().weight
    before = embedding.detach().clone()
    rows = untrained_tokens(model, tok, [TEXT])
    with train_token_rows(model, rows):
        assert embedding.requires_grad
        train(40)
    assert not embedding.requires_grad
    changed = (embedding.detach() != before).any(dim=1).nonzero()[:, 0].tolist()
    assert changed and set(changed) <= set(rows)
    with_rows = _tag_loss(model, ids, start)
    assert lora_only > 2.0 and with_rows < 0.5 * lora_only, (lora_only, with_rows)
