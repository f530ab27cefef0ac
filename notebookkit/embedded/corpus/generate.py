"""Deterministic generator of the bundled pre-training corpus: simple English about a small world.

The corpus is a list of short documents built from the facts in
:mod:`notebookkit.embedded.corpus.world`, each fact written out in one of several phrasings, mixed with
question/answer blocks, little stories, dialogues between named people, step-by-step instructions,
counting and sums. It is regenerated from a seed, never downloaded: ``generate_corpus(seed)``
returns the same list of strings on every machine and Python version, because it draws only from
a private ``random.Random(seed)`` and iterates only over ordered tables.

It serves two purposes: training the byte-level BPE tokenizer, and pre-training ``tiny-llama`` so
that fine-tuning demos start from a model that already knows the world and only has to learn the
chat format and the answer style.
"""

from __future__ import annotations

import random
from typing import Callable

from . import world
from .world import (ACTIVITIES, ANIMALS, COLOURS, DAYS, FEELINGS, FOODS, MONTHS, NAMES, NUMBER_WORDS,
                    PLACES, SEASONS, TOYS, WEATHER, Fact, article, cap)

def _colour_sentence(rng: random.Random, np: str, colour: str, plural: str | None) -> str:
    choices = [
        f"{cap(np)} is {colour}.",
        f"The colour of {np} is {colour}.",
        f"Look at {np}. It is {colour}.",
        f"Everyone knows that {np} is {colour}.",
    ]
    if plural is not None:
        choices += [f"{cap(plural)} are {colour}.", f"I like {plural}. They are {colour}."]
    return rng.choice(choices)


def _n(count: str, noun: str) -> str:
    return f"{count} {noun}" if count == "1" else f"{count} {noun}s"


def _fact_sentence(rng: random.Random, fact: Fact) -> str:
    """One fact in one of several phrasings (the canonical answer is always one of them)."""
    kind, subject = fact.kind, fact.key.split(":", 1)[1]
    if rng.random() < 0.25:
        return fact.answer
    if kind == "colour":
        plural = next(p for np, _c, p in world.COLOUR_FACTS if np == subject)
        return _colour_sentence(rng, subject, fact.short, plural)
    if kind == "sound":
        a = f"{article(subject)} {subject}"
        return rng.choice([
            f"{cap(a)} says {fact.short}.",
            f"The {subject} goes {fact.short}.",
            f"When {a} is hungry, it says {fact.short}.",
            f"\"{cap(fact.short)}!\" said the {subject}.",
        ])
    if kind == "legs":
        a = f"{article(subject)} {subject}"
        n = int(fact.short)
        if n == 0:
            return rng.choice([f"{cap(a)} has no legs.", f"{cap(a)} does not have legs."])
        return rng.choice([f"{cap(a)} has {n} legs.", f"{cap(a)} walks on {n} legs.",
                           f"Count the legs of {a}: there are {n}."])
    if kind == "baby":
        return rng.choice([
            f"A baby {subject} is called {article(fact.short)} {fact.short}.",
            f"The {subject} looks after its {fact.short}.",
            f"{cap(article(fact.short))} {fact.short} is a young {subject}.",
        ])
    if kind == "sides":
        a = f"{article(subject)} {subject}"
        return rng.choice([f"{cap(a)} has {fact.short} sides.", f"{cap(a)} has {fact.short} corners.",
                           f"You can draw {a} with {fact.short} straight lines."])
    if kind == "opposite":
        return rng.choice([f"The opposite of {subject} is {fact.short}.",
                           f"{cap(fact.short)} is the opposite of {subject}."])
    if kind == "plural":
        return rng.choice([f"One {subject}, two {fact.short}.",
                           f"The plural of {subject} is {fact.short}."])
    if kind == "home":
        a = f"{article(subject)} {subject}"
        return rng.choice([f"{cap(a)} lives in {fact.short}.", f"The {subject} went back to {fact.short}.",
                           f"You can find {a} in {fact.short}."])
    if kind == "job":
        a = f"{article(subject)} {subject}"
        name = rng.choice(NAMES)
        return rng.choice([f"{cap(a)} {fact.short}.", f"{name} is {a}. Every day, {name} {fact.short}.",
                           f"When I grow up, I want to be {a}, because {a} {fact.short}."])
    if kind == "sense":
        return rng.choice([f"We {fact.short} with our {subject}.", f"Our {subject} help us {fact.short}."])
    if kind in ("day", "month", "season"):
        return rng.choice([f"After {subject} comes {fact.short}.",
                           f"The {kind} after {subject} is {fact.short}."])
    if kind == "next_number":
        n = int(subject)
        return rng.choice([f"After {n} comes {n + 1}.", f"{n}, {n + 1}, {n + 2}.",
                           f"{n} plus one is {n + 1}."])
    if kind == "add":
        a, b = subject.split("+")
        name = rng.choice(NAMES)
        return rng.choice([f"{a} + {b} = {fact.short}.", f"{a} plus {b} is {fact.short}.",
                           f"{name} has {_n(a, 'apple')} and gets {b} more, so {name} has {_n(fact.short, 'apple')}."])
    if kind == "sub":
        a, b = subject.split("-")
        name = rng.choice(NAMES)
        return rng.choice([f"{a} - {b} = {fact.short}.", f"{a} minus {b} is {fact.short}.",
                           f"{name} had {_n(a, 'sweet')} and ate {b}, so {name} has {_n(fact.short, 'sweet')} left."])
    if kind == "mul":
        a, b = subject.split("*")
        return rng.choice([f"{a} x {b} = {fact.short}.", f"{a} times {b} is {fact.short}.",
                           f"{_n(a, 'group')} of {b} make {fact.short}."])
    return fact.answer


class _FactPicker:
    """Pick a question type uniformly, then a fact of that type (sums would swamp the rest)."""

    def __init__(self, facts: list[Fact]) -> None:
        self.by_kind: dict[str, list[Fact]] = {}
        for f in facts:
            self.by_kind.setdefault(f.kind, []).append(f)
        self.kinds = list(self.by_kind)

    def pick(self, rng: random.Random, k: int) -> list[Fact]:
        return [rng.choice(self.by_kind[rng.choice(self.kinds)]) for _ in range(k)]


def _fact_paragraph(rng: random.Random, facts: _FactPicker) -> str:
    return " ".join(_fact_sentence(rng, f) for f in facts.pick(rng, rng.randint(3, 7)))


def _qa_block(rng: random.Random, facts: _FactPicker) -> str:
    return "\n".join(f"Q: {f.question}\nA: {f.answer}" for f in facts.pick(rng, rng.randint(2, 5)))


def _day_story(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    weather, feeling = rng.choice(WEATHER), rng.choice(FEELINGS)
    parts = [f"It was a {weather} {rng.choice(SEASONS)} day."]
    for _ in range(rng.randint(2, 4)):
        parts.append(f"{name} went to {rng.choice(PLACES)} and {rng.choice(ACTIVITIES)}.")
    parts.append(f"In the evening, {name} felt {feeling}.")
    return " ".join(parts)


def _story(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    toy1, toy2 = rng.sample(TOYS, 2)
    c1, c2 = rng.sample(COLOURS, 2)
    food = rng.choice(FOODS)
    animal = rng.choice(list(ANIMALS))
    sound, legs, _baby, home = ANIMALS[animal]
    day = rng.choice(DAYS)
    parts = [
        f"On {day}, {a} went to the park with {b}.",
        f"{a} had {article(c1)} {c1} {toy1} and {b} had {article(c2)} {c2} {toy2}.",
        f"They saw {article(animal)} {animal} near {home}.",
    ]
    if sound is not None:
        parts.append(f"The {animal} said {sound}.")
    parts += [
        f"{b} asked, \"What colour is your {toy1}?\" {a} said, \"My {toy1} is {c1}.\"",
        f"Then they ate {food} and went home.",
        f"{a} was happy.",
    ]
    return " ".join(parts)


def _dialogue(rng: random.Random, facts: _FactPicker) -> str:
    a, b = rng.sample(NAMES, 2)
    lines = [f"{a}: Hello, {b}! How are you?", f"{b}: I am fine, thank you. And you?",
             f"{a}: I am well. Can I ask you something?", f"{b}: Of course."]
    for f in facts.pick(rng, rng.randint(1, 3)):
        lines += [f"{a}: {f.question}", f"{b}: {f.answer}"]
    lines += [f"{a}: Thank you, {b}!", f"{b}: You are welcome. Goodbye!"]
    return "\n".join(lines)


_INSTRUCTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("make a cup of tea", ("Boil some water.", "Put a tea bag in a cup.", "Pour the hot water into the cup.",
                           "Wait for three minutes.", "Take out the tea bag.")),
    ("wash your hands", ("Turn on the tap.", "Wet your hands.", "Rub soap on your hands.",
                         "Rinse your hands with water.", "Dry your hands with a towel.")),
    ("plant a seed", ("Fill a pot with soil.", "Make a small hole.", "Put the seed in the hole.",
                      "Cover the seed with soil.", "Water the pot every day.")),
    ("draw a square", ("Draw a straight line.", "Turn a corner and draw a line of the same length.",
                       "Do it two more times.", "Now you have a square with 4 sides.")),
    ("make a sandwich", ("Take two slices of bread.", "Put cheese on one slice.",
                         "Add a leaf of lettuce.", "Put the other slice on top.")),
    ("brush your teeth", ("Put toothpaste on your brush.", "Brush your teeth for two minutes.",
                          "Spit out the toothpaste.", "Rinse your mouth with water.")),
)


def _instructions(rng: random.Random) -> str:
    task, steps = rng.choice(_INSTRUCTIONS)
    body = "\n".join(f"{i + 1}. {s}" for i, s in enumerate(steps))
    return f"How to {task}:\n{body}"


def _counting(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        start = rng.randint(0, 990)
        return "Let us count: " + ", ".join(str(n) for n in range(start, start + rng.randint(5, 12))) + "."
    if kind == 1:
        start = rng.randint(0, 10)
        return ("Count with words: "
                + ", ".join(NUMBER_WORDS[start:start + rng.randint(4, 10)]) + ".")
    if kind == 2:
        i = rng.randrange(7)
        return "The days of the week are " + ", ".join(DAYS[i:] + DAYS[:i]) + "."
    i = rng.randrange(12)
    return "The months of the year are " + ", ".join(MONTHS[i:] + MONTHS[:i]) + "."


def _sums(rng: random.Random) -> str:
    lines = []
    top = rng.choice((20, 20, 100, 500))
    for _ in range(rng.randint(3, 6)):
        a, b = rng.randint(0, top), rng.randint(0, top)
        op = rng.randrange(3)
        if op == 0:
            lines.append(f"{a} + {b} = {a + b}")
        elif op == 1:
            hi, lo = max(a, b), min(a, b)
            lines.append(f"{hi} - {lo} = {hi - lo}")
        else:
            a, b = a % 10 + 1, b % 10 + 1
            lines.append(f"{a} x {b} = {a * b}")
    return "\n".join(lines)


def generate_corpus(seed: int = 0, n_docs: int = 8000, cover_all_facts: bool = True) -> list[str]:
    """Return ``n_docs`` short English documents, identical for the same arguments.

    With ``cover_all_facts`` a first pass writes every fact of the world once (about 220
    documents of five facts each), so each fact is seen in pre-training; the rest is drawn at
    random from the document kinds above. Held-out text for evaluation uses another seed and
    ``cover_all_facts=False``, so it follows the same mix as the bulk of the corpus.
    """
    rng = random.Random(seed)
    facts = world.all_facts()
    docs: list[str] = []
    if cover_all_facts:
        order = list(range(len(facts)))
        rng.shuffle(order)
        for i in range(0, len(order), 5):
            docs.append(" ".join(_fact_sentence(rng, facts[j]) for j in order[i:i + 5]))
    picker = _FactPicker(facts)
    makers: tuple[tuple[float, Callable[[], str]], ...] = (
        (0.24, lambda: _fact_paragraph(rng, picker)),
        (0.36, lambda: _qa_block(rng, picker)),
        (0.06, lambda: _story(rng)),
        (0.06, lambda: _day_story(rng)),
        (0.12, lambda: _dialogue(rng, picker)),
        (0.04, lambda: _instructions(rng)),
        (0.06, lambda: _counting(rng)),
        (0.06, lambda: _sums(rng)),
    )
    while len(docs) < n_docs:
        r, acc = rng.random(), 0.0
        for weight, make in makers:
            acc += weight
            if r < acc:
                docs.append(make())
                break
        else:
            docs.append(makers[0][1]())
    return docs[:n_docs]
