"""A stand-in for pretraining, for the email agent on the project's tiny model: multi-token copying in
unrelated tool tasks.

A hub model arrives able to copy an id, a date or a code from its context into its next call. The tiny model
starts from random weights, and the maze's stand-in (`examples/tool_reading.py`) teaches it to copy single
words only; the email task copies values of 2-7 tokens (`2024-03-15`, `m0412`, `$45,000`). So this stage
teaches that skill on tools, keys and records that are not the inbox's: look up a key named anywhere in a
question (sometimes beside a date), open the record whose name (or date) matches, report one of its fields. Every value is random (digits, dates, times, codes, amounts,
words), so nothing here can be memorised; only copying helps. The email task itself — which words to search,
which hit to read, which value answers the question — is left to the warm start and to RL.
"""

from __future__ import annotations

import json
import random

import artrl

THINGS = ("order", "ticket", "contact", "part", "book", "device", "shipment", "account")
FIELDS = ("status", "owner", "total", "serial", "due", "phone", "color", "size", "rank", "level")
WORDS = (
    "apple", "north", "secret", "paris", "london", "green", "seven", "door", "room", "game",
    "stock", "price", "today", "tokyo", "key", "item", "order", "banana", "cherry", "berlin",
)  # fmt: skip


SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ter",
    "an",
    "bri",
    "so",
    "vel",
    "dun",
    "ra",
    "po",
    "shi",
    "gle",
    "no",
    "um",
    "ex",
)


def random_word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randrange(1, 4)))


def random_value(rng: random.Random) -> str:
    """A value of one of the forms the email task copies, with random content."""
    form = rng.randrange(9)
    digits = lambda n: "".join(rng.choice("0123456789") for _ in range(n))  # noqa: E731
    if form == 0:
        return digits(rng.randrange(2, 6))
    if form == 1:
        return f"20{digits(2)}-{digits(2)}-{digits(2)}"
    if form == 2:
        return f"{digits(2)}:{digits(2)}"
    if form == 3:
        return f"{rng.choice('ABCDEFGHKMPQRSTXZ')}{rng.choice('ABCDEFGHKMPQRSTXZ')}-{digits(rng.randrange(2, 5))}"
    if form == 4:
        return f"${digits(rng.randrange(1, 3))},{digits(3)}"
    if form == 5:
        return f"{rng.choice('abcdefghkmnprstxz')}{digits(rng.randrange(2, 5))}"
    if form == 6:
        return f"{rng.choice(WORDS)}-{digits(rng.randrange(1, 3))}"
    if form == 7:
        return f"{random_word(rng).capitalize()}-{digits(3)}"
    return " ".join(random_word(rng) for _ in range(rng.randrange(1, 3)))


def _schema(name: str, description: str, args: tuple[str, ...]) -> dict:
    properties = {a: {"type": "string"} for a in args}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(args)},
        },
    }


# One set of tools for every conversation (the kind of thing is in the question and the query): every row of
# a step starts with the same prompt, computed once per micro-batch by the trainer
TOOLS = [
    _schema("find_record", "Find records.", ("query",)),
    _schema("open_record", "Open a record.", ("ref",)),
    _schema("report", "Report a value.", ("value", "ref")),
]


def _date(rng: random.Random) -> str:
    return f"20{rng.randrange(100):02d}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"


def conversation(rng: random.Random, index: int) -> artrl.Trajectory:
    """Look a key up, open the record that matches it, report one of its fields (all the teacher's).

    The question names the key anywhere in it, sometimes beside a date: then the lookup lists records of
    that key at different dates and the one to open is the record of the question's date; else the lookup
    lists records of different names and the one to open is the record of the key's name."""
    thing, field = rng.choice(THINGS), rng.choice(FIELDS)
    key, date = random_value(rng), _date(rng)
    form = rng.randrange(4)
    n = rng.randrange(2, 4) if form in (1, 2) else rng.randrange(1, 4)
    refs, right = [random_value(rng) for _ in range(n)], rng.randrange(n)
    if form in (1, 2):  # dated: the same key at different dates
        dates = [_date(rng) for _ in range(n)]
        dates[right] = date
        listed = [{"ref": r, "date": d, "name": f"{thing} {key}"} for r, d in zip(refs, dates, strict=True)]
    else:
        names = [random_value(rng) for _ in range(n)]
        names[right] = key
        listed = [{"ref": r, "name": nm} for r, nm in zip(refs, names, strict=True)]
    question = (
        f"What is the {field} of {thing} {key}?",
        f"On {date}, what was the {field} of {thing} {key}?",
        f"What was the {field} of {thing} {key} on {date}?",
        f"{thing.capitalize()} {key}, filed under {random_value(rng)}: what is its {field}?",
    )[form]
    ref = refs[right]
    values = {f: random_value(rng) for f in [field, *rng.sample([f for f in FIELDS if f != field], 2)]}
    text = ". ".join(f"The {f} is {v}" for f, v in rng.sample(list(values.items()), len(values))) + "."

    def call(turn: int, name: str, arguments: dict) -> dict:
        function = {"name": name, "arguments": json.dumps(arguments)}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": f"call_{index}_{turn}", "type": "function", "function": function}],
        }

    def result(turn: int, content: object) -> dict:
        return {"role": "tool", "tool_call_id": f"call_{index}_{turn}", "content": json.dumps(content)}

    messages: list = [
        {"role": "user", "content": question},
        call(0, "find_record", {"query": f"{thing} {key}"}),
        result(0, listed),
        call(1, "open_record", {"ref": ref}),
        result(1, {"ref": ref, "text": text}),
        call(2, "report", {"value": f"is {values[field]}", "ref": ref}),
    ]
    return artrl.Trajectory(messages_and_choices=messages, tools=TOOLS)


def corpus(n: int, seed: int = 0) -> list[artrl.Trajectory]:
    rng = random.Random(f"copying-{seed}")
    return [conversation(rng, i) for i in range(n)]
