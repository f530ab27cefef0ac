"""Load the processor of a vision-language model (image processor + tokenizer + chat template).

``AutoProcessor.from_pretrained`` is tried first, so a model gets the processor its checkpoint
names. One case is handled beside it: transformers 5 builds Qwen2.5-VL's processor with a video
processor, which needs torchvision, so without torchvision the stock class cannot be built at all
(not even for images). There :func:`load_processor` builds :func:`image_only_processor`: the same
processor class with the video part left out (a subclass whose ``__init__`` takes the image
processor and the tokenizer only). Everything an image-and-text batch runs (chat template,
placeholder expansion, image preprocessing, the ``mm_token_type_ids`` the multimodal positions are
computed from) is the stock class's own code; a call with ``videos=`` fails. The banner says so.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from notebookkit.families import Vision

from ..common.banner import Banner


def has_torchvision() -> bool:
    """Whether torchvision can be imported (transformers 5's video processors need it)."""
    return importlib.util.find_spec("torchvision") is not None


def load_processor(path: str, vision: Vision, banner: Banner, **kwargs: Any):
    """The processor of the model at ``path`` (a folder or a hub id); see the module docstring."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path, **kwargs)
    except Exception:  # noqa: BLE001 - re-raised unless it is the missing-torchvision case
        if has_torchvision() or not _has_video_part(vision):
            raise
    else:
        if hasattr(processor, "image_processor"):
            return processor
        # AutoProcessor hands back the bare tokenizer when it cannot build the processor class
        if has_torchvision() or not _has_video_part(vision):
            raise ValueError(
                f"{path} holds no processor for {vision.model_class} (AutoProcessor found only a "
                f"{type(processor).__name__}): save the processor beside the model with processor.save_pretrained(folder)."
            )
    banner.note(
        f"torchvision is not installed, and {vision.processor_class} needs it for videos: loaded its image-only "
        "part (images and text work; pip install torchvision for videos)"
    )
    return image_only_processor(path, vision, **kwargs)


def _has_video_part(vision: Vision) -> bool:
    return bool(vision.tiny.video_processor)


def image_only_processor(path: str, vision: Vision, **kwargs: Any):
    """``vision.processor_class`` without its video processor, loaded from ``path``."""
    import transformers as tf
    from transformers import AutoTokenizer

    # the PIL image processor the family record names (AutoImageProcessor wants torchvision on some versions)
    image_processor = getattr(tf, vision.image_processor_class).from_pretrained(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    cls = _image_only_class(getattr(tf, vision.processor_class))
    extra = _processor_arguments(path, cls)
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=_chat_template(path, tokenizer),
               **extra)


def _image_only_class(base: type) -> type:
    """A subclass of ``base`` whose only sub-processors are the image processor and the tokenizer.

    transformers reads a processor's parts off its ``__init__`` signature, so leaving
    ``video_processor`` out of it is what makes the class buildable without torchvision. The token
    attributes Qwen2.5-VL's ``__init__`` sets are set the same way (the tokenizer's own, else the
    defaults that class uses).
    """
    from transformers import ProcessorMixin

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        for kind, default in (("image", "<|image_pad|>"), ("video", "<|video_pad|>")):
            token = getattr(tokenizer, f"{kind}_token", None) or default
            setattr(self, f"{kind}_token", token)
            setattr(self, f"{kind}_token_id",
                    getattr(tokenizer, f"{kind}_token_id", None) or tokenizer.convert_tokens_to_ids(token))
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    def to_dict(self):  # saved as the stock class, so a machine with torchvision loads the stock processor
        out = ProcessorMixin.to_dict(self)
        out["processor_class"] = base.__name__
        return out

    return type(f"ImageOnly{base.__name__}", (base,), {"__init__": __init__, "to_dict": to_dict,
                                                        "__module__": __name__})


def _chat_template(path: str, tokenizer: Any) -> Any:
    folder = Path(path)
    for name in ("chat_template.jinja",):
        if (folder / name).is_file():
            return (folder / name).read_text(encoding="utf-8")
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    return getattr(tokenizer, "chat_template", None)


def _processor_arguments(path: str, cls: type) -> dict[str, Any]:
    """The processor's own saved arguments (``processor_config.json``) that its ``__init__`` takes."""
    file = Path(path) / "processor_config.json"
    if not os.path.isfile(file):
        return {}
    saved = json.loads(file.read_text(encoding="utf-8"))
    import inspect

    accepted = set(inspect.signature(cls.__mro__[1].__init__).parameters) - {"self", "image_processor", "tokenizer",
                                                                              "video_processor", "chat_template"}
    return {k: v for k, v in saved.items() if k in accepted}


__all__ = ["has_torchvision", "image_only_processor", "load_processor"]
