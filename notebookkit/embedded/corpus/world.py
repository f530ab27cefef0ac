"""The small, fixed world that the bundled corpus and datasets talk about.

Everything the tiny models learn is stated here once, as plain Python tables: the colour of
everyday things, what animals say, how many legs they have, what their young are called, how many
sides a shape has, opposites, plurals, the days of the week and the months. The corpus generator
(:mod:`notebookkit.embedded.corpus.generate`) writes these facts out in many phrasings for
pre-training; the dataset generators (:mod:`notebookkit.embedded.generate_datasets`) turn the very same
facts into question/answer pairs with one fixed answer template per question type, so a model that
read the corpus during pre-training can answer questions about facts that its fine-tuning set held
out.

A :class:`Fact` is one question with one canonical answer. ``key`` names the fact uniquely (for
example ``"colour:banana"``); :func:`is_held_out` splits facts into a training part and an
evaluation part by a fixed rule, so every split in the project is deterministic and the same on
every machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# (noun phrase, colour, plural form or None for mass nouns / unique things)
COLOUR_FACTS: tuple[tuple[str, str, str | None], ...] = (
    ("a banana", "yellow", "bananas"),
    ("a lemon", "yellow", "lemons"),
    ("the sun", "yellow", None),
    ("a duckling", "yellow", "ducklings"),
    ("corn", "yellow", None),
    ("the sky", "blue", None),
    ("the sea", "blue", None),
    ("a blueberry", "blue", "blueberries"),
    ("a sapphire", "blue", "sapphires"),
    ("grass", "green", None),
    ("a leaf", "green", "leaves"),
    ("a frog", "green", "frogs"),
    ("a cucumber", "green", "cucumbers"),
    ("a lime", "green", "limes"),
    ("a pea", "green", "peas"),
    ("a tomato", "red", "tomatoes"),
    ("a strawberry", "red", "strawberries"),
    ("a cherry", "red", "cherries"),
    ("blood", "red", None),
    ("a fire truck", "red", "fire trucks"),
    ("a ruby", "red", "rubies"),
    ("snow", "white", None),
    ("milk", "white", None),
    ("a cloud", "white", "clouds"),
    ("salt", "white", None),
    ("a swan", "white", "swans"),
    ("coal", "black", None),
    ("a crow", "black", "crows"),
    ("the night sky", "black", None),
    ("ink", "black", None),
    ("an orange", "orange", "oranges"),
    ("a carrot", "orange", "carrots"),
    ("a pumpkin", "orange", "pumpkins"),
    ("a tangerine", "orange", "tangerines"),
    ("a plum", "purple", "plums"),
    ("an aubergine", "purple", "aubergines"),
    ("a grape", "purple", "grapes"),
    ("a violet", "purple", "violets"),
    ("chocolate", "brown", None),
    ("a chestnut", "brown", "chestnuts"),
    ("soil", "brown", None),
    ("coffee", "brown", None),
    ("a flamingo", "pink", "flamingos"),
    ("a pig", "pink", "pigs"),
    ("candy floss", "pink", None),
    ("an elephant", "grey", "elephants"),
    ("a rain cloud", "grey", "rain clouds"),
    ("a pebble", "grey", "pebbles"),
)

COLOURS: tuple[str, ...] = (
    "red", "blue", "green", "yellow", "orange", "purple", "pink", "brown", "black", "white", "grey",
)

# animal -> (sound, legs, baby name or None, home)
ANIMALS: dict[str, tuple[str | None, int, str | None, str]] = {
    "dog": ("woof", 4, "puppy", "a kennel"),
    "cat": ("meow", 4, "kitten", "a house"),
    "cow": ("moo", 4, "calf", "a barn"),
    "sheep": ("baa", 4, "lamb", "a field"),
    "pig": ("oink", 4, "piglet", "a sty"),
    "horse": ("neigh", 4, "foal", "a stable"),
    "duck": ("quack", 2, "duckling", "a pond"),
    "hen": ("cluck", 2, "chick", "a coop"),
    "owl": ("hoot", 2, "owlet", "a tree"),
    "lion": ("roar", 4, "cub", "a den"),
    "bear": ("growl", 4, "cub", "a cave"),
    "frog": ("ribbit", 4, "tadpole", "a pond"),
    "bee": ("buzz", 6, None, "a hive"),
    "snake": ("hiss", 0, None, "a hole"),
    "mouse": ("squeak", 4, "pup", "a hole"),
    "donkey": ("bray", 4, "foal", "a field"),
    "goat": ("bleat", 4, "kid", "a farm"),
    "wolf": ("howl", 4, "pup", "a den"),
    "spider": (None, 8, None, "a web"),
    "ant": (None, 6, None, "a nest"),
    "fish": (None, 0, None, "the water"),
    "kangaroo": (None, 2, "joey", "the bush"),
    "swan": ("honk", 2, "cygnet", "a lake"),
    "deer": ("bellow", 4, "fawn", "a forest"),
}

SHAPES: dict[str, int] = {
    "triangle": 3,
    "square": 4,
    "rectangle": 4,
    "pentagon": 5,
    "hexagon": 6,
    "heptagon": 7,
    "octagon": 8,
    "nonagon": 9,
    "decagon": 10,
}

OPPOSITES: tuple[tuple[str, str], ...] = (
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("day", "night"),
    ("happy", "sad"), ("open", "closed"), ("light", "dark"), ("old", "new"), ("wet", "dry"),
    ("full", "empty"), ("hard", "soft"), ("high", "low"), ("long", "short"), ("early", "late"),
    ("in", "out"), ("left", "right"), ("loud", "quiet"), ("near", "far"), ("rich", "poor"),
    ("thick", "thin"), ("top", "bottom"), ("win", "lose"), ("push", "pull"), ("yes", "no"),
    ("clean", "dirty"), ("heavy", "light"), ("first", "last"), ("strong", "weak"), ("sweet", "sour"),
)

PLURALS: tuple[tuple[str, str], ...] = (
    ("cat", "cats"), ("dog", "dogs"), ("box", "boxes"), ("bus", "buses"), ("child", "children"),
    ("mouse", "mice"), ("foot", "feet"), ("tooth", "teeth"), ("man", "men"), ("woman", "women"),
    ("goose", "geese"), ("sheep", "sheep"), ("fish", "fish"), ("leaf", "leaves"), ("wolf", "wolves"),
    ("knife", "knives"), ("baby", "babies"), ("city", "cities"), ("party", "parties"),
    ("tomato", "tomatoes"), ("potato", "potatoes"), ("church", "churches"), ("dish", "dishes"),
    ("person", "people"), ("ox", "oxen"), ("cactus", "cacti"), ("book", "books"), ("tree", "trees"),
    ("apple", "apples"), ("glass", "glasses"), ("wish", "wishes"), ("key", "keys"), ("toy", "toys"),
    ("lady", "ladies"), ("half", "halves"), ("wife", "wives"),
)

DAYS: tuple[str, ...] = (
    "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday",
)

MONTHS: tuple[str, ...] = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)

NUMBER_WORDS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
)

NAMES: tuple[str, ...] = (
    "Anna", "Tom", "Mia", "Leo", "Sara", "Ben", "Lily", "Sam", "Nora", "Max", "Ella", "Omar",
    "Zoe", "Finn", "Ivy", "Raj", "Lucy", "Jack", "Amir", "Kate",
)

# things with no fixed colour, for stories ("Tom has a red ball.")
TOYS: tuple[str, ...] = (
    "ball", "cup", "hat", "car", "box", "kite", "bike", "shirt", "bag", "book", "pen", "chair",
    "door", "boat", "sock", "balloon",
)

FOODS: tuple[str, ...] = (
    "bread", "rice", "soup", "an apple", "a banana", "cheese", "an egg", "a pear", "pasta", "fish",
    "carrots", "cake",
)


# job -> what the person does
JOBS: tuple[tuple[str, str], ...] = (
    ("baker", "bakes bread"), ("teacher", "teaches children"), ("doctor", "helps sick people"),
    ("farmer", "grows food"), ("pilot", "flies planes"), ("driver", "drives a bus"),
    ("painter", "paints pictures"), ("singer", "sings songs"), ("builder", "builds houses"),
    ("cook", "cooks meals"), ("writer", "writes books"), ("gardener", "looks after plants"),
    ("firefighter", "puts out fires"), ("nurse", "cares for patients"), ("postman", "brings letters"),
    ("fisher", "catches fish"), ("dentist", "looks after teeth"), ("librarian", "looks after books"),
    ("vet", "helps sick animals"), ("tailor", "makes clothes"), ("plumber", "fixes pipes"),
    ("police officer", "keeps people safe"), ("scientist", "does experiments"), ("dancer", "dances on a stage"),
)

SENSES: tuple[tuple[str, str], ...] = (
    ("eyes", "see"), ("ears", "hear"), ("nose", "smell"), ("tongue", "taste"), ("hands", "touch"),
)

SEASONS: tuple[str, ...] = ("spring", "summer", "autumn", "winter")

PLACES: tuple[str, ...] = (
    "the park", "the beach", "school", "the market", "the library", "the zoo", "the farm",
    "the garden", "the forest", "the river", "the museum", "the station", "the bakery",
    "the playground", "the lake", "the hill", "the shop", "the kitchen",
)

ACTIVITIES: tuple[str, ...] = (
    "played football", "read a book", "drew a picture", "sang a song", "flew a kite",
    "built a sandcastle", "rode a bike", "baked a cake", "planted a tree", "wrote a letter",
    "watched the birds", "swam in the water", "picked some flowers", "counted the clouds",
    "fed the ducks", "painted a fence", "climbed a tree", "played the piano", "made a snowman",
    "looked at the stars", "cleaned the room", "visited grandma", "learned a new word",
    "caught a butterfly", "washed the dishes", "went for a walk", "jumped in a puddle",
)

FEELINGS: tuple[str, ...] = (
    "happy", "tired", "hungry", "excited", "sleepy", "proud", "surprised", "calm", "curious",
    "thirsty", "cheerful", "brave",
)

WEATHER: tuple[str, ...] = (
    "sunny", "rainy", "windy", "cloudy", "snowy", "foggy", "stormy", "warm", "cold", "bright",
)


@dataclass(frozen=True)
class Fact:
    """One question with its one canonical answer.

    ``key`` names the fact (``"colour:a banana"``), ``kind`` its question type (``"colour"``,
    ``"sound"``, ``"legs"``, ``"baby"``, ``"home"``, ``"sides"``, ``"job"``, ``"sense"``,
    ``"opposite"``, ``"plural"``, ``"day"``, ``"season"``, ``"month"``, ``"next_number"``,
    ``"add"``, ``"sub"``, ``"mul"``), ``question`` the user
    prompt, ``answer`` the full-sentence answer and ``short`` the bare answer word or number.
    """

    key: str
    kind: str
    question: str
    answer: str
    short: str


def cap(text: str) -> str:
    """Capitalise the first letter only (``"the sky" -> "The sky"``)."""
    return text[:1].upper() + text[1:]


def article(noun: str) -> str:
    """``"a"`` or ``"an"`` for a singular noun."""
    return "an" if noun[:1].lower() in "aeiou" else "a"


def colour_facts() -> list[Fact]:
    """"What colour is a banana?" -> "A banana is yellow."."""
    return [
        Fact(f"colour:{np}", "colour", f"What colour is {np}?", f"{cap(np)} is {c}.", c)
        for np, c, _ in COLOUR_FACTS
    ]


def animal_facts() -> list[Fact]:
    """Sounds, legs and baby names of :data:`ANIMALS`."""
    out: list[Fact] = []
    for name, (sound, legs, baby, _home) in ANIMALS.items():
        a = f"{article(name)} {name}"
        if sound is not None:
            out.append(Fact(f"sound:{name}", "sound", f"What sound does {a} make?",
                            f"{cap(a)} says {sound}.", sound))
        legs_text = "no legs" if legs == 0 else f"{legs} legs"
        out.append(Fact(f"legs:{name}", "legs", f"How many legs does {a} have?",
                        f"{cap(a)} has {legs_text}.", str(legs)))
        if baby is not None:
            out.append(Fact(f"baby:{name}", "baby", f"What is a baby {name} called?",
                            f"A baby {name} is called {article(baby)} {baby}.", baby))
    return out


def shape_facts() -> list[Fact]:
    """"How many sides does a hexagon have?" -> "A hexagon has 6 sides."."""
    return [
        Fact(f"sides:{s}", "sides", f"How many sides does {article(s)} {s} have?",
             f"{cap(article(s))} {s} has {n} sides.", str(n))
        for s, n in SHAPES.items()
    ]


def opposite_facts() -> list[Fact]:
    """Both directions of every pair in :data:`OPPOSITES` (first direction wins on clashes)."""
    out: list[Fact] = []
    seen: set[str] = set()
    for a, b in OPPOSITES:
        for x, y in ((a, b), (b, a)):
            if x in seen:
                continue
            seen.add(x)
            out.append(Fact(f"opposite:{x}", "opposite", f"What is the opposite of {x}?",
                            f"The opposite of {x} is {y}.", y))
    return out


def job_facts() -> list[Fact]:
    """"What does a baker do?" -> "A baker bakes bread."."""
    return [
        Fact(f"job:{j}", "job", f"What does {article(j)} {j} do?", f"{cap(article(j))} {j} {d}.", d)
        for j, d in JOBS
    ]


def home_facts() -> list[Fact]:
    """"Where does a bee live?" -> "A bee lives in a hive."."""
    return [
        Fact(f"home:{name}", "home", f"Where does {article(name)} {name} live?",
             f"{cap(article(name))} {name} lives in {home}.", home)
        for name, (_s, _l, _b, home) in ANIMALS.items()
    ]


def sense_facts() -> list[Fact]:
    """"What do we use our eyes for?" -> "We use our eyes to see."."""
    return [
        Fact(f"sense:{part}", "sense", f"What do we use our {part} for?", f"We use our {part} to {verb}.", verb)
        for part, verb in SENSES
    ]


def plural_facts() -> list[Fact]:
    """"What is the plural of mouse?" -> "The plural of mouse is mice."."""
    return [
        Fact(f"plural:{s}", "plural", f"What is the plural of {s}?",
             f"The plural of {s} is {p}.", p)
        for s, p in PLURALS
    ]


def calendar_facts() -> list[Fact]:
    """Which day follows which, and which month follows which."""
    out = [
        Fact(f"day:{d}", "day", f"What day comes after {d}?",
             f"The day after {d} is {DAYS[(i + 1) % 7]}.", DAYS[(i + 1) % 7])
        for i, d in enumerate(DAYS)
    ]
    out += [
        Fact(f"season:{s}", "season", f"What season comes after {s}?",
             f"The season after {s} is {SEASONS[(i + 1) % 4]}.", SEASONS[(i + 1) % 4])
        for i, s in enumerate(SEASONS)
    ]
    out += [
        Fact(f"month:{m}", "month", f"What month comes after {m}?",
             f"The month after {m} is {MONTHS[(i + 1) % 12]}.", MONTHS[(i + 1) % 12])
        for i, m in enumerate(MONTHS)
    ]
    return out


def number_facts(limit: int = 100) -> list[Fact]:
    """"What number comes after 41?" -> "The number after 41 is 42."."""
    return [
        Fact(f"next_number:{n}", "next_number", f"What number comes after {n}?",
             f"The number after {n} is {n + 1}.", str(n + 1))
        for n in range(limit)
    ]


def arithmetic_facts() -> list[Fact]:
    """Sums up to 20 + 20, differences with non-negative results, times tables up to 10 x 10."""
    out: list[Fact] = []
    for a in range(21):
        for b in range(21):
            out.append(Fact(f"add:{a}+{b}", "add", f"What is {a} + {b}?", f"{a} + {b} = {a + b}.",
                            str(a + b)))
            if a >= b:
                out.append(Fact(f"sub:{a}-{b}", "sub", f"What is {a} - {b}?",
                                f"{a} - {b} = {a - b}.", str(a - b)))
    for a in range(1, 11):
        for b in range(1, 11):
            out.append(Fact(f"mul:{a}*{b}", "mul", f"What is {a} x {b}?", f"{a} x {b} = {a * b}.",
                            str(a * b)))
    return out


def all_facts() -> list[Fact]:
    """Every fact of the world, in a fixed order."""
    return (colour_facts() + animal_facts() + home_facts() + shape_facts() + job_facts()
            + sense_facts() + opposite_facts() + plural_facts() + calendar_facts() + number_facts()
            + arithmetic_facts())


def is_held_out(fact: Fact) -> bool:
    """Whether ``fact`` belongs to the evaluation part of every bundled SFT set.

    Within each question type the facts are sorted by key and every fifth one (positions 2, 7,
    12, ...) is held out, so each type keeps about 20 % of its facts for evaluation. The rule
    depends only on the tables above, not on Python's hash seed.
    """
    return fact.key in _held_out_keys()


@lru_cache(maxsize=1)
def _held_out_keys() -> frozenset[str]:
    by_kind: dict[str, list[str]] = {}
    for f in all_facts():
        by_kind.setdefault(f.kind, []).append(f.key)
    return frozenset(k for keys in by_kind.values() for i, k in enumerate(sorted(keys)) if i % 5 == 2)
