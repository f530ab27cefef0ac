"""Tiny, randomly initialised vision-language models (VLMs), saved as Hugging Face folders.

Each family with a vision row in :mod:`notebookkit.families` (``Family.vision``) gets one VLM whose
language model is the family's tiny text model (the body of :mod:`.generate_models`: hidden size
128, 4 query / 2 key-value heads of 32, MLP 384, the family's layers and RoPE) and whose vision
tower sees the bundled 64x64 images as 8x8 patches of 8x8 pixels:

=============  ===================================================================================
qwen2.5-vl     ``Qwen2_5_VLForConditionalGeneration``: a 2-block vision transformer of width 64
               (window attention in block 0, full attention in block 1, 2-D rotary positions),
               a merger of 2x2 patches into 16 image features, and the Qwen2 decoder with the
               multimodal rotary embedding (time / height / width sections 4 / 6 / 6 of the 16
               frequencies). Image placeholder ``<|image_pad|>`` between ``<|vision_start|>`` and
               ``<|vision_end|>``.
gemma3-vision  ``Gemma3ForConditionalGeneration``: a 2-layer SigLIP encoder of width 64, the
               projector (2x2 average pooling to 16 features, Gemma RMSNorm, a 64 -> 128 matrix)
               and the Gemma 3 decoder (sandwich and q/k norms, sliding + global layers). Images
               are ``<start_of_image>`` + 16 ``<image_soft_token>`` + ``<end_of_image>``.
=============  ===================================================================================

The tokenizer is the family's tiny tokenizer (:mod:`.generate_tokenizer`) with the wrapper's image
tokens appended after the shared 2048 ids, so the text models' ids are unchanged; the chat template
(the vision row's ``tokenizer_template``, :mod:`notebookkit.tokenizer_templates`) renders ``content`` given as a string or as a list of ``{"type": "image"}`` / ``{"type": "text"}``
items (the layout of TRL and of the most used vision notebooks). The processor (its image processor
set for 64x64 inputs, the tokenizer and the template) is saved beside the weights, so
``AutoProcessor.from_pretrained(folder)`` loads it as it loads a hub checkpoint's.

Weights are drawn with ``torch.manual_seed(seed)`` by the library's own initialiser (plus the
recipe's ``redraw`` parameters) and saved in float32, so a rebuild gives the same bytes. Needs
transformers 5 (its ``rope_parameters`` and processor classes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from notebookkit.families import Vision, family as family_record

def vision_row(family: str) -> Vision:
    """The vision row of ``family`` (a readable error for a family without one)."""
    row = family_record(family)
    if row.vision is None:
        from notebookkit.families import vision_families

        names = ", ".join(f.name for f in vision_families().values())
        raise ValueError(f"The {family} family has no vision-language model; the families with one are: {names}.")
    return row.vision


def write_vision_tokenizer(base_tokenizer, family: str, folder: Path) -> dict[str, int]:
    """The family's tiny tokenizer plus the wrapper's image tokens and the VLM chat template.

    Returns the ids of the added tokens. The family's own files are written first
    (:func:`~.generate_tokenizer.write_tokenizer_folder`), then extended.
    """
    from tokenizers import AddedToken, Tokenizer

    from .generate_tokenizer import write_tokenizer_folder

    vision = vision_row(family)
    write_tokenizer_folder(base_tokenizer, family, folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in vision.image_tokens])
    (folder / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    ids = {t: tok.token_to_id(t) for t in vision.image_tokens}
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    for token, tid in ids.items():
        config["added_tokens_decoder"][str(tid)] = {"content": token, "lstrip": False, "normalized": False,
                                                    "rstrip": False, "single_word": False, "special": True}
    config["chat_template"] = vision.tokenizer_template
    if vision.tiny.tokenizer_attributes:
        config["extra_special_tokens"] = dict(vision.tiny.tokenizer_attributes)
    _write_json(folder / "tokenizer_config.json", config)
    return ids


def vision_model_config(family: str, vocab_size: int, token_ids: dict[str, Any], image_token_ids: dict[str, int]):
    """The ``transformers`` config of the tiny VLM of ``family``: its text model is the family's tiny
    text config (:func:`~.generate_models.family_config`), plus the recipe's vision tower."""
    import transformers as tf

    from .generate_models import family_config

    vision = vision_row(family)
    recipe = vision.tiny
    text = family_config(family, vocab_size, token_ids).to_dict()
    for key in ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype"):
        text.pop(key, None)
    if recipe.rope:
        text["rope_parameters"] = {**text.get("rope_parameters", {}), **recipe.rope}
    ids = {key: image_token_ids[token] for key, token in recipe.token_ids.items()}
    vision_config = {**dict(recipe.vision_config), **{key: text["hidden_size"] for key in recipe.text_width_keys}}
    return getattr(tf, vision.config_class)(
        text_config=text, vision_config=vision_config, **ids, **dict(recipe.config),
        tie_word_embeddings=text["tie_word_embeddings"], bos_token_id=token_ids["bos_token_id"],
        eos_token_id=token_ids["config_eos_token_id"], pad_token_id=token_ids["pad_token_id"],
    )


def build_random_vision_model(family: str, vocab_size: int, token_ids: dict[str, Any],
                              image_token_ids: dict[str, int], seed: int):
    """Instantiate the tiny VLM of ``family`` with weights drawn from ``torch.manual_seed(seed)`` (float32)."""
    import torch
    import transformers as tf

    vision = vision_row(family)
    config = vision_model_config(family, vocab_size, token_ids, image_token_ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(tf, vision.model_class)._from_config(config, dtype=torch.float32)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in vision.tiny.redraw:
                params[name].normal_(0.0, vision.tiny.redraw_std)
    model.eval()
    return model


def write_processor(folder: Path, family: str) -> None:
    """Write the processor files: ``processor_config.json`` (processor class, image processor set for
    64x64 inputs, video processor where the wrapper has one, the recipe's processor arguments) and
    ``chat_template.jinja``, in the layout transformers 5 saves a processor in.

    Written directly rather than by ``processor.save_pretrained``: Qwen2.5-VL's processor cannot be
    built without torchvision (its video part), and the files must not depend on whether the
    building machine has it. ``AutoProcessor.from_pretrained(folder)`` reads them back.
    """
    import transformers as tf

    vision = vision_row(family)
    recipe = vision.tiny
    image_processor = getattr(tf, vision.image_processor_class)(**dict(recipe.image_processor))
    config: dict[str, Any] = {"processor_class": vision.processor_class, "image_processor": image_processor.to_dict(),
                              **dict(recipe.processor)}
    if recipe.video_processor:
        config["video_processor"] = dict(recipe.video_processor)
    _write_json(folder / "processor_config.json", config)
    (folder / "chat_template.jinja").write_text(vision.tokenizer_template, encoding="utf-8")


#: Sentences in the bundled caption grammar the pre-trained decoders read (text only), and their seed.
CAPTION_SENTENCES, CAPTION_SENTENCES_SEED, SENTENCES_PER_DOCUMENT = 3000, 7, 10


def caption_documents(n: int = CAPTION_SENTENCES, seed: int = CAPTION_SENTENCES_SEED) -> list[str]:
    """Documents of sentences in the caption grammar (``A small red star on a white background.``),
    any colour with any shape: text only, no image.

    A pre-trained decoder reads them with the corpus, so it knows the words of a caption (their
    embeddings are trained, not left near their initial values, where the tied LM head could not
    give them a confident logit) but not what any image looks like: the notebook's fine-tuning
    teaches it to read the image and to answer in the chat format.
    """
    import random

    from .generate_datasets import BACKGROUNDS, CAPTION_COLOURS, CAPTION_POSITIONS, CAPTION_SHAPES

    rng = random.Random(seed)
    sentences = []
    for _ in range(n):
        size, colour, shape = rng.choice(("small", "large")), rng.choice(list(CAPTION_COLOURS)), rng.choice(CAPTION_SHAPES)
        background = rng.choice([b for b in BACKGROUNDS if b != colour])
        where = "" if size == "large" else " " + rng.choice(list(CAPTION_POSITIONS))
        sentences.append(f"A {size} {colour} {shape} on a {background} background{where}.")
    return [" ".join(sentences[i:i + SENTENCES_PER_DOCUMENT]) for i in range(0, n, SENTENCES_PER_DOCUMENT)]


def build_vision_model_folder(family: str, folder: Path, base_tokenizer, seed: int, pretrain_config=None,
                              heldout_docs: list[str] | None = None, train_docs: list[str] | None = None,
                              log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Build the tiny VLM of ``family`` into ``folder`` (no caching); returns its info dict.

    ``pretrain_config`` (a :class:`~notebookkit.embedded.generate_pretrain.PretrainConfig`) switches
    on the text pre-training of the decoder (:func:`~.generate_models.pretrain_on_corpus`, as for
    ``tiny-llama``) on ``train_docs`` plus :func:`caption_documents`, shuffled together (seeded);
    ``heldout_docs`` measure it. The vision tower keeps its random weights.
    """
    from .generate_models import INFO_FILE, count_parameters, pretrain_on_corpus, save_model_folder
    from .generate_tokenizer import special_token_ids

    vision = vision_row(family)
    folder.mkdir(parents=True, exist_ok=True)
    image_ids = write_vision_tokenizer(base_tokenizer, family, folder)
    ids = special_token_ids(base_tokenizer, family)
    vocab_size = base_tokenizer.get_vocab_size() + len(image_ids)
    model = build_random_vision_model(family, vocab_size, ids, image_ids, seed)
    info = {"family": family, "vision": vision.name, "model_type": vision.model_type,
            "params": count_parameters(model), "seed": seed, "pretrained": pretrain_config is not None}
    if pretrain_config is not None:
        import random

        docs = list(train_docs or []) + caption_documents()
        random.Random(CAPTION_SENTENCES_SEED).shuffle(docs)
        info["pretrain"] = pretrain_on_corpus(model, base_tokenizer, pretrain_config, docs, heldout_docs, log)
    save_model_folder(model, family, ids, folder)
    write_processor(folder, family)
    (folder / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return info


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


__all__ = ["build_vision_model_folder", "build_random_vision_model", "vision_model_config",
           "vision_row", "write_processor", "write_vision_tokenizer"]
