"""Small "who, where, with what" deduction puzzles in the shape of ART's temporal-clue data (num_clues, a
prompt, the solution as {key: value}), made deterministically here because ART's puzzles file is not
available offline. The answer format is the one the example's reward reads: lines `KEY. value`."""

from __future__ import annotations

import random

SUSPECTS = ["Mr. Green", "Mrs. Peacock", "Colonel Mustard", "Miss Scarlet", "Professor Plum"]
ROOMS = ["Kitchen", "Library", "Study", "Ballroom", "Conservatory"]
WEAPONS = ["Rope", "Candlestick", "Wrench", "Revolver", "Lead Pipe"]


def make_puzzles(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        who, where, what = rng.choice(SUSPECTS), rng.choice(ROOMS), rng.choice(WEAPONS)
        clues = [f"The culprit is not {s}." for s in rng.sample([s for s in SUSPECTS if s != who], 3)] + [
            f"The crime did not happen in the {r}." for r in rng.sample([r for r in ROOMS if r != where], 3)
        ]
        clues += [f"The weapon was the {what}."]
        rng.shuffle(clues)
        prompt = (
            "Solve the mystery from these clues.\n"
            + "\n".join(f"- {c}" for c in clues)
            + f"\nSuspects: {', '.join(SUSPECTS)}. Rooms: {', '.join(ROOMS)}. Weapons: {', '.join(WEAPONS)}.\n"
            "Answer with three lines:\nA. who\nB. where\nC. with what"
        )
        out.append({"num_clues": len(clues), "prompt": prompt, "solution": {"A": who, "B": where, "C": what}})
    return out
