"""A stand-in for pretraining: generic conversations in which an agent reads a value from a tool result and
passes it to its next call.

A hub model arrives able to do that: copying a token from the context is among the first things a
language model learns. The project's tiny model starts from random weights, and it learns the copy only
after a long plateau (about 500 SFT steps even from a perfect teacher, longer from a weak one; see
benchmarks/TRIED.md). So when the demo runs on the tiny model it first
gives it this skill on unrelated tools, keys and values — never the maze's tool, its breeze or its walls —
and the maze task itself is left to the warm start and to RL. With `--base-model` this stage is skipped.

Each conversation: a user message names a starting value; the agent calls one tool 2-4 times, each time
with the value the latest result pointed to, then answers with the last value.
"""

from __future__ import annotations

import json
import random

import artrl

TOOL_NAMES = ("lookup", "search", "look", "check_stock", "get_weather", "guess", "send_email", "add")
KEYS = ("key", "item", "value", "name", "next", "city", "number", "query", "price", "count")
# single words the tiny tokenizer knows; directions are among them, as in any language model's vocabulary
VALUES = (
    "apple", "banana", "cherry", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    "ten", "north", "south", "east", "west", "left", "right", "up", "down", "yes", "no", "true", "false",
    "secret", "higher", "lower", "correct", "wrong", "stock", "price", "paris", "london", "tokyo", "rome",
    "berlin", "madrid", "today", "tomorrow", "door", "room", "key", "item", "email", "order", "game", "score",
)  # fmt: skip
RESULT_WORDS = ("found", "done", "empty", "error", "true", "false")


def conversation(rng: random.Random, index: int) -> artrl.Trajectory:
    """One generated conversation (all turns are the teacher's; SFT trains the assistant's)."""
    tool = rng.choice(TOOL_NAMES)
    arg_key, hint_key = rng.choice(KEYS), rng.choice(KEYS)
    schema = {
        "type": "function",
        "function": {
            "name": tool,
            "description": f"Look up a {arg_key}.",
            "parameters": {
                "type": "object",
                "properties": {arg_key: {"type": "string"}},
                "required": [arg_key],
            },
        },
    }
    value = rng.choice(VALUES)
    messages: list = [
        {"role": "user", "content": f"Follow the {hint_key}. Start: {json.dumps({hint_key: value})}"}
    ]
    for turn in range(rng.randrange(2, 5)):
        call_id = f"call_{index}_{turn}"
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": tool, "arguments": json.dumps({arg_key: value})},
                    }
                ],
            }
        )
        value = rng.choice(VALUES)
        result = {"result": rng.choice(RESULT_WORDS), hint_key: value}
        messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)})
    messages.append({"role": "assistant", "content": f"The {hint_key} is {value}."})
    return artrl.Trajectory(messages_and_choices=messages, tools=[schema])


def corpus(n: int, seed: int = 0) -> list[artrl.Trajectory]:
    rng = random.Random(f"tool-reading-{seed}")
    return [conversation(rng, i) for i in range(n)]
