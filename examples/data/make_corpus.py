"""Writes fables.txt, the corpus examples/train_llama.py trains on: short generated fables in plain
English, from a small grammar and a fixed seed, so the text is ours to ship and the same on every
machine. It has structure a tiny model learns in a few hundred steps (names that recur within a
fable, counting, agreement) and is too small to learn by heart quickly.

    python3 examples/data/make_corpus.py        # rewrites examples/data/fables.txt (about 120 KB)
"""
from __future__ import annotations

import random
from pathlib import Path

ANIMALS = ["fox", "crow", "hare", "tortoise", "owl", "wolf", "lamb", "mouse", "lion", "goat", "heron", "bee"]
PEOPLE = ["miller", "shepherd", "weaver", "baker", "fisherman", "king", "old woman", "farmer"]
ADJECTIVES = ["small", "clever", "hungry", "proud", "patient", "sleepy", "brave", "greedy", "kind", "quick"]
PLACES = ["by the river", "in the forest", "on the hill", "near the mill", "in the meadow", "at the well",
          "under the old oak", "beside the road"]
TIMES = ["One morning", "At dawn", "Late one evening", "In the spring", "On a cold day", "Once upon a time"]
FINDS = ["a piece of cheese", "a bag of grain", "a golden key", "a ripe apple", "a shiny stone", "a loaf of bread"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
MORALS = ["Slow and steady wins the race.", "Pride goes before a fall.", "A friend in need is a friend indeed.",
          "Look before you leap.", "Little by little does the trick.", "Do not count your chickens before they hatch.",
          "Kindness is never wasted.", "The greedy lose what they have."]


def a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def fable(rng: random.Random) -> str:
    hero, other = rng.sample(ANIMALS + PEOPLE, 2)
    trait, place, found = rng.choice(ADJECTIVES), rng.choice(PLACES), rng.choice(FINDS)
    count = rng.randrange(2, 10)
    lines = [f"{rng.choice(TIMES)}, {a(trait)} {hero} was walking {place}.",
             f"The {hero} found {found} and said, \"This is mine.\"",
             f"{a(other).capitalize()} saw the {hero} and asked for a share.",
             f"The {hero} counted: {', '.join(NUMBERS[:count])}.",
             rng.choice([f"Then the {hero} gave half to the {other}, and they ate together.",
                         f"But the {hero} would not share, and the {other} went away {place}.",
                         f"The {other} laughed, and the {hero} dropped {found} into the water."]),
             f"Moral: {rng.choice(MORALS)}"]
    return "\n".join(lines)


def main(size: int = 120_000) -> None:
    rng = random.Random(0)
    fables, total = [], 0
    while total < size:
        fables.append(fable(rng))
        total += len(fables[-1]) + 2
    Path(__file__).with_name("fables.txt").write_text("\n\n".join(fables) + "\n")


if __name__ == "__main__":
    main()
