"""VisionDataCollator: labels on the assistant's answers only (image tokens, prompt and padding -100),
and the messages a notebook user gets for rows it cannot use."""

from __future__ import annotations

import io

import pytest
import torch

from notebookkit.data.vision_collator import VisionDataCollator, VisionRowError, decode_image, image_placeholders
from notebookkit.families import vision_families

FAMILIES = [f.name for f in vision_families().values()]
END_OF_TURN = {"qwen2": "<|im_end|>", "gemma3": "<end_of_turn>"}


@pytest.fixture(scope="module")
def loaded():
    from notebookkit import FastVisionModel

    cache = {}

    def get(family: str):
        if family not in cache:
            name = vision_families()[{"qwen2": "qwen2_5_vl", "gemma3": "gemma3"}[family]].vision.tiny_name
            cache[family] = FastVisionModel.from_pretrained(name, max_seq_length=128, load_in_4bit=False,
                                                            show_banner=False)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def rows():
    from notebookkit.embedded.bundled import load_bundled

    ds = load_bundled("captions")
    return [ds[i] for i in range(4)]


def _row(row: dict, **changes) -> dict:
    out = {"messages": row["messages"], "images": [row["image"]]}
    out.update(changes)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_only_the_answer_is_trained(family, loaded, rows):
    model, processor = loaded(family)
    collator = VisionDataCollator(model, processor)
    batch = collator([_row(r) for r in rows])
    tok = processor.tokenizer
    vision = vision_families()[model.config.model_type].vision
    image_ids = [tok.convert_tokens_to_ids(t) for t in vision.image_tokens]
    labels, ids, mask = batch["labels"], batch["input_ids"], batch["attention_mask"]
    assert labels.shape == ids.shape and "pixel_values" in batch
    assert (labels[torch.isin(ids, torch.tensor(image_ids))] == -100).all()
    assert (labels[mask == 0] == -100).all()
    assert int((ids == tok.convert_tokens_to_ids(vision.image_token)).sum()) == 16 * len(rows)
    for i, row in enumerate(rows):
        kept = labels[i][labels[i] != -100].tolist()
        assert kept == ids[i][labels[i] != -100].tolist()
        trained = tok.decode(kept)
        # the caption, then the end-of-turn token (how the model learns to stop); nothing of the prompt
        assert trained.strip() == row["caption"] + END_OF_TURN[family], trained
        assert "Describe" not in trained


@pytest.mark.parametrize("family", FAMILIES)
def test_every_text_token_without_responses_only(family, loaded, rows):
    model, processor = loaded(family)
    batch = VisionDataCollator(model, processor, train_on_responses_only=False)([_row(rows[0])])
    trained = processor.tokenizer.decode(batch["labels"][0][batch["labels"][0] != -100].tolist())
    assert "Describe this image." in trained and rows[0]["caption"] in trained
    assert processor.tokenizer.decode(
        batch["input_ids"][0][batch["labels"][0] == -100].tolist()).count(
        vision_families()[model.config.model_type].vision.image_token) == 16


def test_a_row_whose_image_cannot_be_decoded_is_named(loaded, rows, tmp_path):
    model, processor = loaded("qwen2")
    collator = VisionDataCollator(model, processor)
    not_an_image = tmp_path / "notes.txt"
    not_an_image.write_text("not an image")
    with pytest.raises(VisionRowError, match=r"row 2: image 0 .*notes\.txt.* cannot be decoded \(UnidentifiedImageError"):
        collator([_row(rows[0]), _row(rows[1]), _row(rows[2], images=[str(not_an_image)])])
    png = io.BytesIO()
    rows[0]["image"].save(png, format="PNG")
    truncated = {"bytes": png.getvalue()[:60], "path": None}
    with pytest.raises(VisionRowError, match=r"row 1: image 0 \('dict'\) cannot be decoded"):
        collator([_row(rows[0]), _row(rows[1], images=[truncated])])
    with pytest.raises(VisionRowError, match=r"dataset row 3: image 0 .* cannot be decoded"):
        collator.check([_row(r) for r in rows[:3]] + [_row(rows[3], images=[12345])])
    assert decode_image({"bytes": png.getvalue(), "path": None}).size == (64, 64)


def test_placeholders_and_images_must_match(loaded, rows):
    model, processor = loaded("gemma3")
    collator = VisionDataCollator(model, processor)
    two_items = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                               {"type": "text", "text": "Compare these."}]},
                 {"role": "assistant", "content": [{"type": "text", "text": "They differ."}]}]
    assert image_placeholders(two_items) == 2
    with pytest.raises(VisionRowError, match=r"row 1 \('Compare these\.'\.\.\.\) has more image placeholders than "
                                             r"images: its messages hold 2 \{'type': 'image'\} item\(s\) and the row "
                                             r"has 1 image\(s\)"):
        collator([_row(rows[0]), {"messages": two_items, "images": [rows[0]["image"]]}])
    with pytest.raises(VisionRowError, match=r"row 0 .* has more images than image placeholders: its messages hold "
                                             r"1 .* and the row has 2 image"):
        collator([_row(rows[0], images=[rows[0]["image"], rows[1]["image"]])])
    with pytest.raises(VisionRowError, match="row 0 has no 'messages' column .*'caption'"):
        collator([{"caption": "x", "images": []}])


def test_a_model_without_vision_lists_the_supported_ones(loaded):
    from tests.models.helpers import random_model

    _, processor = loaded("qwen2")
    with pytest.raises(ValueError, match=r"model_type 'llama', which has no vision support.*\n  - gemma3 .*\n  - "
                                         r"qwen2_5_vl .*\n'llama' is a text-only model.*FastLanguageModel"):
        VisionDataCollator(random_model("llama"), processor)


def test_the_tokenizer_is_not_the_processor(loaded):
    model, processor = loaded("qwen2")
    with pytest.raises(TypeError, match="not a vision processor. Pass the processor FastVisionModel.from_pretrained"):
        VisionDataCollator(model, processor.tokenizer)


def test_rows_are_never_truncated(loaded, rows):
    model, processor = loaded("qwen2")
    with pytest.raises(VisionRowError, match=r"row 0 .* is 8\d tokens long \(image tokens included\), longer than "
                                             r"max_seq_length=40"):
        VisionDataCollator(model, processor, max_seq_length=40)([_row(rows[0])])


def test_a_row_without_an_answer_is_named(loaded, rows):
    model, processor = loaded("qwen2")
    question_only = {"messages": rows[0]["messages"][:1], "images": [rows[0]["image"]]}
    with pytest.raises(VisionRowError, match=r"row 1 \('Describe this image\.'\.\.\.\) has no assistant answer"):
        VisionDataCollator(model, processor)([_row(rows[1]), question_only])
