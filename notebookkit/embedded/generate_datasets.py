"""Deterministic generators of the bundled datasets (rows as plain dicts, images as PNG files).

All text comes from the facts of :mod:`notebookkit.embedded.corpus.world`, answered with one fixed
template per question type ("What colour is a banana?" -> "A banana is yellow."), so a tiny
model learns the style in tens of steps. The ``eval`` split of every set asks only about facts
that the ``train`` split never mentions (:func:`~notebookkit.embedded.corpus.world.is_held_out`):
a fine-tuned model can answer them only by combining the answer style it learned in fine-tuning
with the knowledge it picked up in pre-training. Each generator draws from its own
``random.Random(seed)``, so the rows are identical on every machine.

Kinds and their columns:

=============== ==============================================================================
chat_sharegpt   ``conversations``: ``[{"from": "system"|"human"|"gpt", "value": str}, ...]``
chat_messages   ``messages``: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``
                (the same conversations as ``chat_sharegpt``)
alpaca          ``instruction``, ``input`` (may be ``""``), ``output``
preference      ``prompt``, ``chosen``, ``rejected`` (strings; ``chosen`` is the true answer)
grpo_math       ``prompt`` (system + user messages), ``question``, ``answer`` (the number as a
                string), ``solution`` (a reference completion ending in ``<answer>N</answer>``)
captions        ``image`` (absolute PNG path), ``file_name`` (path relative to the set's folder),
                ``caption``, ``shape``, ``colour``, ``background``, ``size``, ``messages``
                (user: image + "Describe this image.", assistant: the caption)
=============== ==============================================================================
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from .corpus import world
from .corpus.world import Fact

Row = dict[str, Any]

SPLITS: tuple[str, ...] = ("train", "eval")

#: rows per split for each kind
SIZES: dict[str, dict[str, int]] = {
    "chat": {"train": 1200, "eval": 120},
    "alpaca": {"train": 1000, "eval": 100},
    "preference": {"train": 600, "eval": 60},
    "grpo_math": {"train": 500, "eval": 100},
    "captions": {"train": 300, "eval": 60},
}

SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant.",
    "You are a friendly teacher. Answer in one short sentence.",
    "You are a helpful assistant. Keep your answers short.",
    "You answer simple questions about the world.",
)

GRPO_SYSTEM_PROMPT = (
    "Solve the problem. Write the working in one line, then give the final number inside "
    "<answer></answer> tags, for example <answer>42</answer>."
)

_GREETINGS: tuple[tuple[str, str], ...] = (
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there!", "Hello! How can I help you today?"),
    ("Good morning!", "Good morning! How can I help you today?"),
)
_THANKS: tuple[tuple[str, str], ...] = (
    ("Thank you!", "You are welcome!"),
    ("Thanks a lot.", "You are welcome!"),
)
_UNHELPFUL: tuple[str, ...] = (
    "I don't know.",
    "Why do you want to know that?",
    "That is a strange question.",
    "Ask someone else.",
)

_ALPACA_FORMS: dict[str, tuple[str, str]] = {
    # kind -> (instruction, how to turn the fact's subject into the input)
    "colour": ("Say what colour the thing in the input is.", "subject"),
    "sound": ("Say what sound the animal in the input makes.", "subject"),
    "legs": ("Say how many legs the animal in the input has.", "subject"),
    "baby": ("Say what a baby of the animal in the input is called.", "subject"),
    "home": ("Say where the animal in the input lives.", "subject"),
    "sides": ("Say how many sides the shape in the input has.", "subject"),
    "job": ("Say what the person in the input does at work.", "subject"),
    "opposite": ("Give the opposite of the word in the input.", "subject"),
    "plural": ("Give the plural of the word in the input.", "subject"),
    "add": ("Work out the sum in the input.", "expr"),
    "sub": ("Work out the difference in the input.", "expr"),
    "mul": ("Work out the product in the input.", "expr"),
}


def split_facts(split: str) -> dict[str, list[Fact]]:
    """Facts of one split grouped by question type (``eval`` = the held-out facts)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    want_held_out = split == "eval"
    by_kind: dict[str, list[Fact]] = {}
    for f in world.all_facts():
        if world.is_held_out(f) == want_held_out:
            by_kind.setdefault(f.kind, []).append(f)
    return by_kind


def _pick(rng: random.Random, by_kind: dict[str, list[Fact]], kinds: list[str] | None = None) -> Fact:
    kinds = kinds or list(by_kind)
    return rng.choice(by_kind[rng.choice(kinds)])


def _seed(kind: str, split: str) -> int:
    return {"chat": 11, "alpaca": 22, "preference": 33, "grpo_math": 44, "captions": 55}[kind] * 10 + (
        0 if split == "train" else 1)


# --------------------------------------------------------------------------------------- chat

def conversations(split: str) -> list[list[dict[str, str]]]:
    """Multi-turn conversations as OpenAI-style message lists (system prompt in 80 %)."""
    rng = random.Random(_seed("chat", split))
    by_kind = split_facts(split)
    out: list[list[dict[str, str]]] = []
    for _ in range(SIZES["chat"][split]):
        msgs: list[dict[str, str]] = []
        if rng.random() < 0.8:
            msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        if rng.random() < 0.15:
            q, a = rng.choice(_GREETINGS)
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        for _turn in range(rng.choice((1, 1, 2, 2, 3))):
            f = _pick(rng, by_kind)
            msgs += [{"role": "user", "content": f.question}, {"role": "assistant", "content": f.answer}]
        if rng.random() < 0.1:
            q, a = rng.choice(_THANKS)
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append(msgs)
    return out


_SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def chat_messages_rows(split: str) -> list[Row]:
    """``{"messages": [...]}`` rows."""
    return [{"messages": c} for c in conversations(split)]


def chat_sharegpt_rows(split: str) -> list[Row]:
    """``{"conversations": [{"from": ..., "value": ...}]}`` rows (same dialogues as messages)."""
    return [
        {"conversations": [{"from": _SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in c]}
        for c in conversations(split)
    ]


# ------------------------------------------------------------------------------------- alpaca

_HOW_TO: tuple[tuple[str, str], ...] = (
    ("Explain how to make a cup of tea.",
     "1. Boil some water.\n2. Put a tea bag in a cup.\n3. Pour the hot water into the cup.\n"
     "4. Wait for three minutes.\n5. Take out the tea bag."),
    ("Explain how to wash your hands.",
     "1. Turn on the tap.\n2. Wet your hands.\n3. Rub soap on your hands.\n"
     "4. Rinse your hands with water.\n5. Dry your hands with a towel."),
    ("Explain how to plant a seed.",
     "1. Fill a pot with soil.\n2. Make a small hole.\n3. Put the seed in the hole.\n"
     "4. Cover the seed with soil.\n5. Water the pot every day."),
)


def _alpaca_input(f: Fact) -> str:
    subject = f.key.split(":", 1)[1]
    if f.kind in ("add", "sub", "mul"):
        return f.question.removeprefix("What is ").removesuffix("?")
    return subject


def alpaca_rows(split: str) -> list[Row]:
    """Alpaca rows: about half ask the question directly, half put the subject in ``input``."""
    rng = random.Random(_seed("alpaca", split))
    by_kind = split_facts(split)
    rows: list[Row] = []
    while len(rows) < SIZES["alpaca"][split]:
        if split == "train" and rng.random() < 0.03:
            instruction, output = rng.choice(_HOW_TO)
            rows.append({"instruction": instruction, "input": "", "output": output})
            continue
        f = _pick(rng, by_kind)
        if f.kind in _ALPACA_FORMS and rng.random() < 0.5:
            rows.append({"instruction": _ALPACA_FORMS[f.kind][0], "input": _alpaca_input(f), "output": f.answer})
        else:
            rows.append({"instruction": f.question, "input": "", "output": f.answer})
    return rows


# --------------------------------------------------------------------------------- preference

def _wrong_answer(rng: random.Random, f: Fact) -> str | None:
    """The fact's answer sentence with its value swapped for a wrong one, or None if impossible."""
    if f.short not in f.answer:
        return None
    if f.short.isdigit():
        wrong = str(max(0, int(f.short) + rng.choice((-2, -1, 1, 2, 10))))
        if wrong == f.short:
            wrong = str(int(f.short) + 1)
    elif f.kind == "colour":
        wrong = rng.choice([c for c in world.COLOURS if c != f.short])
    else:
        pool = sorted({g.short for g in world.all_facts() if g.kind == f.kind and g.short != f.short})
        if not pool:
            return None
        wrong = rng.choice(pool)
    head, _, tail = f.answer.rpartition(f.short)
    return head + wrong + tail


def preference_rows(split: str) -> list[Row]:
    """``prompt``/``chosen``/``rejected``: the true templated answer against a wrong or unhelpful one."""
    rng = random.Random(_seed("preference", split))
    by_kind = split_facts(split)
    rows: list[Row] = []
    while len(rows) < SIZES["preference"][split]:
        f = _pick(rng, by_kind)
        rejected = _wrong_answer(rng, f) if rng.random() < 0.6 else None
        if rejected is None:
            rejected = rng.choice(_UNHELPFUL)
        rows.append({"prompt": f.question, "chosen": f.answer, "rejected": rejected})
    return rows


# ---------------------------------------------------------------------------------- grpo_math

def _word_problem(rng: random.Random, f: Fact) -> str:
    name = rng.choice(world.NAMES)
    if f.kind == "add":
        a, b = f.key.split(":")[1].split("+")
        thing = rng.choice(("apples", "marbles", "stickers", "books"))
        return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
    if f.kind == "sub":
        a, b = f.key.split(":")[1].split("-")
        thing = rng.choice(("sweets", "balloons", "cookies", "pencils"))
        return f"{name} has {a} {thing} and gives away {b}. How many {thing} does {name} have left?"
    a, b = f.key.split(":")[1].split("*")
    return f"There are {a} boxes with {b} toys in each box. How many toys are there in total?"


def _working(f: Fact) -> str:
    return f.answer.removesuffix(".")


def grpo_rows(split: str) -> list[Row]:
    """Arithmetic prompts with a verifiable ``answer``; half plain sums, half word problems."""
    rng = random.Random(_seed("grpo_math", split))
    by_kind = split_facts(split)
    kinds = ["add", "sub", "mul"]
    rows: list[Row] = []
    while len(rows) < SIZES["grpo_math"][split]:
        f = _pick(rng, by_kind, kinds)
        question = f.question if rng.random() < 0.5 else _word_problem(rng, f)
        rows.append({
            "prompt": [{"role": "system", "content": GRPO_SYSTEM_PROMPT}, {"role": "user", "content": question}],
            "question": question,
            "answer": f.short,
            "solution": f"{_working(f)}\n<answer>{f.short}</answer>",
        })
    return rows


_ANSWER_TAG = re.compile(r"<answer>\s*(-?[\d,]+(?:\.\d+)?)\s*</answer>", re.IGNORECASE)
_HASHES = re.compile(r"####\s*(-?[\d,]+(?:\.\d+)?)")


def extract_answer(text: str) -> str | None:
    """The final answer in ``text``: the last ``<answer>N</answer>`` or ``#### N``, else ``None``.

    Commas are dropped (``"1,000"`` -> ``"1000"``), so the result compares with the ``answer``
    column of ``grpo_math`` by string equality.
    """
    found = _ANSWER_TAG.findall(text) or _HASHES.findall(text)
    return found[-1].replace(",", "") if found else None


# ----------------------------------------------------------------------------------- captions

CAPTION_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "blue": (40, 80, 220), "green": (40, 170, 60), "yellow": (240, 210, 40),
    "orange": (245, 140, 30), "purple": (140, 60, 190), "pink": (245, 130, 190), "black": (20, 20, 20),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (255, 255, 255), "grey": (170, 170, 170), "black": (0, 0, 0),
}
CAPTION_SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "diamond", "hexagon")
CAPTION_POSITIONS: dict[str, tuple[int, int]] = {
    "in the top left": (18, 18), "in the top right": (46, 18), "in the bottom left": (18, 46),
    "in the bottom right": (46, 46), "in the middle": (32, 32),
}
IMAGE_SIZE = 64


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    import math

    if shape == "triangle":
        angles = [-90, 30, 150]
        return [(cx + r * math.cos(math.radians(a)), cy + r * math.sin(math.radians(a))) for a in angles]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    if shape == "hexagon":
        return [(cx + r * math.cos(math.radians(60 * k)), cy + r * math.sin(math.radians(60 * k)))
                for k in range(6)]
    if shape == "star":
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else r * 0.45
            a = math.radians(-90 + 36 * k)
            pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
        return pts
    raise ValueError(shape)


def draw_shape(shape: str, colour: str, background: str, size: str, position: str):
    """A 64x64 RGB ``PIL.Image`` of one filled shape (no anti-aliasing, so bytes are stable)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUNDS[background])
    draw = ImageDraw.Draw(img)
    cx, cy = CAPTION_POSITIONS[position]
    r = 12 if size == "small" else 26
    fill = CAPTION_COLOURS[colour]
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        s = r * 0.85
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
    else:
        draw.polygon(_polygon(shape, cx, cy, r), fill=fill)
    return img


def caption_specs(split: str) -> list[dict[str, str]]:
    """The attributes of every image of a split (held-out colour/shape pairs go to ``eval``)."""
    rng = random.Random(_seed("captions", split))
    combos = [(s, c) for s in CAPTION_SHAPES for c in CAPTION_COLOURS]
    # every fifth (shape, colour) pair is kept for evaluation
    allowed = [sc for i, sc in enumerate(combos) if (i % 5 == 3) == (split == "eval")]
    specs = []
    for _ in range(SIZES["captions"][split]):
        shape, colour = rng.choice(allowed)
        background = rng.choice([b for b in BACKGROUNDS if b != colour])
        size = rng.choice(("small", "large"))
        position = rng.choice(list(CAPTION_POSITIONS)) if size == "small" else "in the middle"
        where = "" if size == "large" else f" {position}"
        caption = f"A {size} {colour} {shape} on a {background} background{where}."
        specs.append({"shape": shape, "colour": colour, "background": background, "size": size,
                      "position": position, "caption": caption})
    return specs


def caption_rows(split: str, folder: Path, final_folder: Path) -> list[Row]:
    """Draw the images of ``split`` into ``folder/images/<split>/`` and return the rows.

    ``image`` holds the absolute path the file will have once ``folder`` is renamed to
    ``final_folder`` (the cache builds in a temporary folder and renames it when complete).
    """
    out_dir = folder / "images" / split
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for i, spec in enumerate(caption_specs(split)):
        rel = f"images/{split}/{i:04d}.png"
        draw_shape(spec["shape"], spec["colour"], spec["background"], spec["size"], spec["position"]).save(
            folder / rel, format="PNG", optimize=False)
        rows.append({
            "image": str(final_folder / rel),
            "file_name": rel,
            "caption": spec["caption"],
            "shape": spec["shape"],
            "colour": spec["colour"],
            "background": spec["background"],
            "size": spec["size"],
            "messages": [
                {"role": "user", "content": [{"type": "image", "text": None},
                                             {"type": "text", "text": "Describe this image."}]},
                {"role": "assistant", "content": [{"type": "text", "text": spec["caption"]}]},
            ],
        })
    return rows


def describe_kinds() -> dict[str, str]:
    """One line per dataset kind, for listings."""
    return {
        "chat_sharegpt": "multi-turn chat, ShareGPT style (conversations: from/value)",
        "chat_messages": "multi-turn chat, OpenAI style (messages: role/content)",
        "alpaca": "instruction / input / output rows",
        "preference": "prompt / chosen / rejected pairs for DPO-style training",
        "grpo_math": "arithmetic prompts with a verifiable answer, format <answer>N</answer>",
        "captions": "64x64 PNG images of coloured shapes with captions",
    }


__all__ = [
    "SIZES", "SPLITS", "SYSTEM_PROMPTS", "GRPO_SYSTEM_PROMPT", "conversations", "chat_messages_rows",
    "chat_sharegpt_rows", "alpaca_rows", "preference_rows", "grpo_rows", "caption_rows", "caption_specs",
    "draw_shape", "extract_answer", "describe_kinds",
]
