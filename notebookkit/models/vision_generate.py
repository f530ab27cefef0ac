"""Answer image prompts with a vision-language model: greedy generation over a batch of rows.

``generate_vision_replies(model, processor, rows)`` takes rows of the collator's layout
(``messages`` + ``images``; the assistant's turn, if present, is dropped and becomes the reference),
renders each prompt with the chat template and its generation prompt, runs ``model.generate`` on
left-padded batches (so every row's answer starts at the same column) and returns the decoded
answers. For the call the model is in eval mode, and a model of ``FastVisionModel`` is switched
with ``for_inference`` (the fast decode path where it applies: :mod:`.vision.decode`); after it, it is
what it was (:mod:`.generation_mode`).
"""

from __future__ import annotations

from typing import Any, Sequence


def prompt_messages(messages: Sequence[dict]) -> list[dict]:
    """The conversation up to (not including) its last assistant turn."""
    out = list(messages)
    while out and out[-1].get("role") == "assistant":
        out.pop()
    return out


def generate_vision_replies(model: Any, processor: Any, rows: Sequence[dict], max_new_tokens: int = 24,
                            batch_size: int = 8) -> list[str]:
    """Greedy answers of ``model`` to the prompts of ``rows`` (``messages`` + ``images`` or ``image``)."""
    from notebookkit.data.vision_collator import decode_image, row_images

    from .fast_vision_model import FastVisionModel
    from .generation_mode import generation_mode

    tokenizer = processor.tokenizer
    device = next(model.parameters()).device
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    answers: list[str] = []
    try:
        with generation_mode(model, FastVisionModel):
            for start in range(0, len(rows), batch_size):
                chunk = rows[start:start + batch_size]
                texts = [processor.apply_chat_template(prompt_messages(r["messages"]), tokenize=False,
                                                       add_generation_prompt=True) for r in chunk]
                images = [[decode_image(v) for v in row_images(r)] for r in chunk]
                kwargs: dict[str, Any] = dict(text=texts, return_tensors="pt", padding=True, add_special_tokens=False)
                if any(images):
                    kwargs["images"] = images
                inputs = {k: v.to(device) for k, v in processor(**kwargs).items()}
                out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                                     top_p=None, top_k=None, pad_token_id=tokenizer.pad_token_id)
                answers += tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return [a.strip() for a in answers]


__all__ = ["generate_vision_replies", "prompt_messages"]
