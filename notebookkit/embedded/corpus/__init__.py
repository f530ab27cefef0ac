"""The bundled corpus: a small, fixed world (:mod:`.world`) and a seeded text generator
(:mod:`.generate`). Nothing here is downloaded; ``generate_corpus(seed)`` rebuilds the same text on
every machine."""

from .generate import generate_corpus
from .world import Fact, all_facts, is_held_out

__all__ = ["generate_corpus", "Fact", "all_facts", "is_held_out"]
