"""Vision data collator: ``{"messages": [...], "images": [...]}`` rows -> model inputs with answer-only labels.

The row layout is TRL's (and the most used vision notebooks'): ``messages`` in the chat format with
``content`` a list of items, ``{"type": "image"}`` marking where an image goes and
``{"type": "text", "text": ...}`` the words; ``images`` the images, in the order of the image items
(a single ``image`` column is read as one image). For each batch the collator

1. checks every row: each image decodes (a ``PIL.Image``, a path, bytes, ``{"bytes", "path"}`` as
   ``datasets.Image(decode=False)`` stores it, or an array), and there are as many images as image
   items; a row that fails is named by its index with what to change;
2. renders each conversation with the processor's chat template and runs the processor on text
   and images together, which expands every image item into the model's image tokens (16 on the
   tiny models; hundreds or thousands on real ones) and preprocesses the pixels;
3. sets the labels: the token ids inside the assistant's answers, the end-of-turn token included
   (how the model learns to stop), and ``-100`` everywhere else: system and user turns, image
   tokens (which the model never predicts), padding.

The answer spans are found with the markers of the chat template (the text that opens an assistant
turn and a user turn, read off the template by :func:`notebookkit.data.responses_only.detect_markers`),
as ``train_on_responses_only`` finds them in text data. The loss is the usual

    loss = sum_t [y_t != -100] CE(logits_{t-1}, y_t) / sum_t [y_t != -100]

so only answer tokens move the weights. Use the collator with a trainer whose dataset rows reach it
untouched: ``SFTConfig(remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True})``.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

IGNORE_INDEX = -100

__all__ = ["VisionDataCollator", "VisionRowError", "decode_image", "image_placeholders", "row_images"]


class VisionRowError(ValueError):
    """A row the vision collator cannot use; the message names the row and what to change."""


def image_placeholders(messages: Sequence[dict]) -> int:
    """How many ``{"type": "image"}`` items the messages hold (each takes one image of the row)."""
    count = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, (list, tuple)):
            count += sum(1 for item in content if isinstance(item, dict) and item.get("type") == "image")
    return count


def decode_image(value: Any):
    """An RGB ``PIL.Image`` from what a dataset row may hold; raises on anything that does not decode."""
    from PIL import Image

    if isinstance(value, dict):  # datasets.Image(decode=False): {"bytes": ..., "path": ...}
        data, path = value.get("bytes"), value.get("path")
        value = data if data else path
    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, (bytes, bytearray)):
        image = Image.open(io.BytesIO(value))
    elif isinstance(value, (str, os.PathLike)):
        image = Image.open(os.fspath(value))
    elif hasattr(value, "__array__"):
        import numpy as np

        image = Image.fromarray(np.asarray(value))
    else:
        raise TypeError(f"a {type(value).__name__} is not an image (expected a PIL image, a path, bytes or an array)")
    image.load()  # PIL decodes lazily: a truncated or corrupt file fails here, not inside the processor
    return image.convert("RGB")


def row_images(row: dict) -> list:
    """The images of a data set row, as a list: its ``images`` column, or its one ``image`` (``[]`` when none)."""
    images = row.get("images")
    if images is None and "image" in row:
        images = [row["image"]] if row["image"] is not None else []
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def _snippet(messages: Any) -> str:
    for message in messages or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str) and content.strip():
            return content.strip()[:60]
        for item in content or []:
            if isinstance(item, dict) and item.get("type") == "text" and item.get("text"):
                return str(item["text"]).strip()[:60]
    return ""


class _ProcessorTemplate:
    """The processor's chat template seen as a tokenizer's (for the marker detection)."""

    def __init__(self, processor: Any) -> None:
        self._processor = processor
        tokenizer = processor.tokenizer
        self.chat_template = getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
        self.name_or_path = getattr(tokenizer, "name_or_path", "")

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = False, **kw):
        return self._processor.apply_chat_template(messages, tokenize=tokenize,
                                                   add_generation_prompt=add_generation_prompt, **kw)


@dataclass
class VisionDataCollator:
    """Collate vision chat rows into ``input_ids``, ``attention_mask``, ``labels`` and the pixel inputs.

    Args:
        model: the model from ``FastVisionModel`` (PEFT-wrapped or not): its family must have vision
            support (the error lists the families that do).
        processor: the processor ``FastVisionModel.from_pretrained`` returned (not its tokenizer).
        train_on_responses_only: labels on the assistant's answers only (default); ``False`` trains
            on every text token (image tokens and padding are still ``-100``).
        max_seq_length: refuse a row longer than this many tokens (image tokens included), naming it;
            default the model's ``max_seq_length``. Rows are never truncated: a cut image would not
            match its features.
        instruction_part / response_part: the turn markers, when the chat template's cannot be
            detected.

    ``collator(rows)`` returns the batch; ``collator.check(dataset)`` runs the row checks over a
    whole dataset first, naming rows by their index in it.
    """

    model: Any
    processor: Any
    train_on_responses_only: bool = True
    max_seq_length: Optional[int] = None
    instruction_part: Optional[str] = None
    response_part: Optional[str] = None
    _markers: tuple = field(default=(), init=False, repr=False)
    _ignored_ids: frozenset = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self) -> None:
        from notebookkit.families import for_vision_model_type, vision_support_error

        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        model_type = getattr(getattr(base, "config", None), "model_type", None)
        family = for_vision_model_type(model_type)
        if family is None:
            raise vision_support_error(model_type, f"VisionDataCollator: this {type(base).__name__}")
        tokenizer = getattr(self.processor, "tokenizer", None)
        if tokenizer is None or not hasattr(self.processor, "image_processor"):
            raise TypeError(
                f"VisionDataCollator: processor is a {type(self.processor).__name__}, not a vision processor. Pass "
                "the processor FastVisionModel.from_pretrained returned (model, processor = ...), not its tokenizer."
            )
        if self.max_seq_length is None:
            self.max_seq_length = base.__dict__.get("max_seq_length")
        ids = [tokenizer.convert_tokens_to_ids(t) for t in family.vision.image_tokens]
        self._ignored_ids = frozenset(i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id)
        if self.train_on_responses_only:
            self._markers = self._detect_markers()

    # ---------------------------------------------------------------------------------- markers

    def _detect_markers(self) -> tuple:
        from .responses_only import detect_markers, marker_token_candidates

        instruction, response = self.instruction_part, self.response_part
        if instruction is None or response is None:
            found_instruction, found_response = detect_markers(_ProcessorTemplate(self.processor))
            instruction = instruction if instruction is not None else found_instruction
            response = response if response is not None else found_response
        self.instruction_part, self.response_part = instruction, response
        tokenizer = self.processor.tokenizer
        return (marker_token_candidates(tokenizer, response), marker_token_candidates(tokenizer, instruction))

    # ------------------------------------------------------------------------------------ checks

    def check_row(self, row: Any, index: int, where: str = "row") -> tuple[list, list]:
        """``(messages, decoded images)`` of one row, or :class:`VisionRowError` naming ``index``."""
        if not isinstance(row, dict) or "messages" not in row:
            columns = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise VisionRowError(
                f"{where} {index} has no 'messages' column (it has {columns}). Each row needs 'messages' (the chat, "
                "with {'type': 'image'} items where the images go) and 'images' (the images, in that order)."
            )
        messages = row["messages"]
        images = row_images(row)
        wanted = image_placeholders(messages)
        if wanted != len(images):
            more = "more image placeholders than images" if wanted > len(images) else "more images than image placeholders"
            raise VisionRowError(
                f"{where} {index} ({_snippet(messages)!r}...) has {more}: its messages hold {wanted} "
                f"{{'type': 'image'}} item(s) and the row has {len(images)} image(s). Each image fills one image "
                "item, in order: add or remove image items in 'messages', or images in 'images', so the counts match."
            )
        decoded = []
        for j, value in enumerate(images):
            try:
                decoded.append(decode_image(value))
            except Exception as exc:  # noqa: BLE001 - every decoder error becomes the same readable one
                described = value if isinstance(value, (str, os.PathLike)) else type(value).__name__
                raise VisionRowError(
                    f"{where} {index}: image {j} ({described!r}) cannot be decoded ({type(exc).__name__}: {exc}). Fix "
                    "or drop that row (for example dataset.filter(...)), or give a PIL image, a path, PNG/JPEG bytes "
                    "or an array."
                ) from None
        return messages, decoded

    def check(self, dataset: Iterable[Any], limit: Optional[int] = None) -> int:
        """Run the row checks over ``dataset`` (its first ``limit`` rows); returns the rows checked."""
        n = 0
        for index, row in enumerate(dataset):
            if limit is not None and index >= limit:
                break
            self.check_row(row, index, where="dataset row")
            n += 1
        return n

    # ---------------------------------------------------------------------------------- collate

    def __call__(self, rows: Sequence[Any]) -> dict:
        import torch

        checked = [self.check_row(row, i, where="row") for i, row in enumerate(rows)]
        texts = [self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
                 for messages, _ in checked]
        images = [imgs for _, imgs in checked]
        kwargs: dict[str, Any] = dict(text=texts, return_tensors="pt", padding=True, add_special_tokens=False)
        if any(images):
            kwargs["images"] = images
        batch = dict(self.processor(**kwargs))
        input_ids, attention = batch["input_ids"], batch.get("attention_mask")
        lengths = attention.sum(-1).tolist() if attention is not None else [input_ids.shape[1]] * len(rows)
        if self.max_seq_length is not None:
            for i, n in enumerate(lengths):
                if n > self.max_seq_length:
                    raise VisionRowError(
                        f"row {i} ({_snippet(checked[i][0])!r}...) is {n} tokens long (image tokens included), longer "
                        f"than max_seq_length={self.max_seq_length}. Rows are not truncated (a cut image no longer "
                        "matches its features): load the model with a larger max_seq_length or shorten that row."
                    )
        batch["labels"] = self.labels(input_ids, attention, checked)
        return batch

    def labels(self, input_ids, attention_mask, checked: Sequence[tuple] = ()):
        """The labels of a processed batch (see the module docstring)."""
        import torch

        from .responses_only import response_only_labels

        labels = input_ids.clone()
        if attention_mask is not None:
            labels[attention_mask == 0] = IGNORE_INDEX
        for token_id in self._ignored_ids:
            labels[input_ids == token_id] = IGNORE_INDEX
        if not self.train_on_responses_only:
            return labels
        response, instruction = self._markers
        out = []
        for i in range(input_ids.shape[0]):
            row = response_only_labels(input_ids[i].tolist(), response, instruction, labels=labels[i].tolist())
            if all(v == IGNORE_INDEX for v in row):
                snippet = _snippet(checked[i][0]) if i < len(checked) else ""
                raise VisionRowError(
                    f"row {i} ({snippet!r}...) has no assistant answer to train on: no text follows the response "
                    f"marker {self.response_part!r}. Give every row an assistant message, or pass "
                    "train_on_responses_only=False."
                )
            out.append(row)
        return torch.tensor(out, dtype=labels.dtype)
