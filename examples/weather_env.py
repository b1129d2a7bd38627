"""A multi-call tool environment: look up the temperature of two cities, one tool call each.

The agent sees the cities it can query, is asked about two of them, calls `get_temperature(city)` as often
as it likes (up to MAX_CALLS), then answers. Success = both requested cities were looked up before the
answer. Reward: 1 on success minus 0.1 per call beyond the two needed (fewer turns is better), else 0.
(Restating the numbers in the answer is not scored: copying numbers is beyond the tiny demo model.)

Train and validation scenarios are disjoint: validation asks only about city pairs that training never
asks about, so a policy must learn to read the question, not memorise pairs.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass

import artrl

CITIES = ["paris", "london", "tokyo", "berlin", "rome", "madrid"]
PAIRS = list(itertools.permutations(CITIES, 2))  # 30 ordered pairs
VAL_PAIRS = PAIRS[::5]  # 6 pairs held out for validation
TRAIN_PAIRS = [p for p in PAIRS if p not in VAL_PAIRS]
MAX_CALLS = 4
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_temperature",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
SYSTEM = "Cities: " + ", ".join(CITIES) + "."


@dataclass(frozen=True)
class Scenario:
    first: str
    second: str
    temperatures: tuple[int, ...]  # one per city in CITIES

    def temperature(self, city: str) -> int:
        return self.temperatures[CITIES.index(city)]

    def question(self) -> str:
        return f"Temperature in {self.first} and {self.second}?"


def scenarios(split: str, n: int, seed: int, held_out_pairs: bool = True) -> list[Scenario]:
    """Scenarios of a split. Validation draws its own scenarios (never training's) from the held-out city
    pairs, or from the training pairs with `held_out_pairs=False` (learning vs generalising)."""
    pairs = TRAIN_PAIRS if split == "train" or not held_out_pairs else VAL_PAIRS
    rng = random.Random(f"{split}-{seed}")
    return [Scenario(*rng.choice(pairs), tuple(rng.randrange(0, 40) for _ in CITIES)) for _ in range(n)]


def run_tool(scenario: Scenario, arguments: str) -> str:
    city = city_of(arguments)
    if city is None:
        return 'error: arguments must be JSON like {"city": "paris"}'
    if city not in CITIES:
        return f"unknown city {city!r}"
    return f"{city} {scenario.temperature(city)}"


def reward(scenario: Scenario, looked_up: list[str], answered: bool) -> tuple[float, bool]:
    success = answered and scenario.first in looked_up and scenario.second in looked_up
    return (max(0.0, 1.0 - 0.1 * max(0, len(looked_up) - 2)) if success else 0.0), success


def city_of(arguments: str) -> str | None:
    try:
        city = json.loads(arguments).get("city")
    except (json.JSONDecodeError, AttributeError):
        return None
    return city if isinstance(city, str) else None


def start(scenario: Scenario) -> artrl.Trajectory:
    return artrl.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": scenario.question()},
        ],
        tools=TOOLS,
        metadata={"first": scenario.first, "second": scenario.second},
    )


async def rollout(
    model: artrl.TrainableModel, scenario: Scenario, seed: int, temperature: float = 1.0
) -> artrl.Trajectory:
    """The agent: ordinary OpenAI tool-calling code against the served model."""
    client = model.openai_client()
    traj = start(scenario)
    looked_up: list[str] = []
    answered = False
    for turn in range(MAX_CALLS + 1):
        response = await client.chat.completions.create(
            model=model.name,
            messages=traj.messages(),
            tools=TOOLS,
            max_tokens=32,
            temperature=temperature,
            seed=seed * 100 + turn,
        )
        choice = response.choices[0]
        traj.messages_and_choices.append(choice)
        if not choice.message.tool_calls:
            answered = True
            break
        for call in choice.message.tool_calls:
            looked_up.append(city_of(call.function.arguments) or "?")
            result = run_tool(scenario, call.function.arguments)
            traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if len(looked_up) >= MAX_CALLS:
            break
    traj.reward, success = reward(scenario, looked_up, answered)
    traj.metrics.update(success=success, calls=len(looked_up))
    return traj


def weak_transcript(
    scenario: Scenario, rng: random.Random, index: int, skill: float = 0.0
) -> artrl.Trajectory:
    """A scripted, weak policy for the warm start: well-formed calls to 2-3 cities, each the next requested
    city with probability `skill` and a uniformly random not-yet-seen city otherwise, then an answer restating what it
    looked up. With low skill it teaches the format, not the task."""
    traj = start(scenario)
    wanted = [scenario.first, scenario.second]
    looked: list[str] = []
    for _ in range(rng.choice([2, 3])):
        needed = [c for c in wanted if c not in looked]
        unseen = [c for c in CITIES if c not in looked]
        looked.append(needed[0] if needed and rng.random() < skill else rng.choice(unseen))
    for k, city in enumerate(looked):
        call_id = f"call_{index}_{k}"
        traj.messages_and_choices.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "get_temperature", "arguments": json.dumps({"city": city})},
                    }
                ],
            }
        )
        traj.messages_and_choices.append(
            {
                "role": "tool",
                "tool_call_id": call_id,
                "content": run_tool(scenario, json.dumps({"city": city})),
            }
        )
    answer = ", ".join(f"{city} {scenario.temperature(city)}" for city in looked) + "."
    traj.messages_and_choices.append({"role": "assistant", "content": answer})
    return traj
