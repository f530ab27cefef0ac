"""The held-out caption score of the vision notebook, and greedy replies of a VLM to image prompts."""

from __future__ import annotations

import pytest

from notebookkit.embedded.caption_scores import caption_words, score_captions
from notebookkit.models.vision_generate import generate_vision_replies, prompt_messages


def test_caption_words_follow_the_grammar():
    assert caption_words("A small red star on a white background in the top left.") == ("red", "star")
    assert caption_words("a LARGE Blue circle on a black background") == ("blue", "circle")
    for text in ("A red star.", "A small teal star on a white background.", "3 + 4 = 7", ""):
        assert caption_words(text) is None


def test_scores_count_each_word():
    rows = [{"caption": "A small red star on a grey background.", "colour": "red", "shape": "star"},
            {"caption": "A large blue circle on a white background.", "colour": "blue", "shape": "circle"}]
    got = score_captions(["A small red circle on a grey background.", "Q: what?"], rows, train_rows=rows[:1])
    assert (got.colour, got.shape, got.well_formed, got.accuracy) == (0.5, 0.0, 0.5, 0.25)
    assert got.chance == 0.5  # always "red star": right on the first row, wrong on the second
    assert got.rows[1][2] == "malformed" and got.rows[0][2] == "colour ok, shape wrong"
    assert "caption accuracy 25%" in str(got)
    with pytest.raises(ValueError, match="1 captions for 2 rows"):
        score_captions(["x"], rows)


def test_replies_are_greedy_and_leave_the_mode(vlm_folder, caption_rows):
    import torch

    from notebookkit import FastVisionModel

    model, processor = FastVisionModel.from_pretrained(vlm_folder("gemma3"), max_seq_length=128,
                                                       dtype=torch.float32, load_in_4bit=False, show_banner=False)
    rows = caption_rows(3)
    assert prompt_messages(rows[0]["messages"]) == rows[0]["messages"][:1]
    model.train()
    first = generate_vision_replies(model, processor, rows, max_new_tokens=6, batch_size=2)
    assert model.training and processor.tokenizer.padding_side == "right"
    assert len(first) == 3 and first == generate_vision_replies(model, processor, rows, max_new_tokens=6)
    alone = generate_vision_replies(model, processor, rows[2:], max_new_tokens=6)
    assert alone == first[2:]  # left padding: a row's reply does not depend on its batch
