"""A multi-turn tool environment: walk out of a dark maze by following the breeze.

The exit lies PATH_LENGTH steps away along a hidden path. The agent has one tool, `move(direction)`.
Every observation (the question, then each tool result) says where the breeze comes from: the direction of
the next step of the path. A move that way advances; any other move hits a wall and wastes a turn. The
agent has MAX_MOVES moves (one mistake is forgiven). So success needs several tool calls, each chosen by
reading the latest tool result — the core skill of a tool-using agent, small enough for a tiny model.

Reward: on success 1 minus 0.1 per wasted move (success in fewer turns scores higher); otherwise half the
fraction of the path walked (partial credit, below any success, and never less than giving up). A random
walker succeeds ~5% of the time, one that follows the breeze always.

Train and validation scenarios are disjoint: every path is a sequence of directions, and validation paths
are sequences that training never walks.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from dataclasses import dataclass

import artrl

DIRECTIONS = ("north", "south", "east", "west")
PATH_LENGTH = 4
MAX_MOVES = PATH_LENGTH + 1  # one wrong move is forgiven
WASTED_MOVE_PENALTY = 0.1
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "move",
            "description": "Take one step.",
            "parameters": {
                "type": "object",
                "properties": {"direction": {"type": "string", "enum": list(DIRECTIONS)}},
                "required": ["direction"],
            },
        },
    }
]
SYSTEM = "You are in a dark maze. Find the exit."


def _is_validation(path: tuple[str, ...]) -> bool:
    return hashlib.sha256(" ".join(path).encode()).digest()[0] % 4 == 0


ALL_PATHS = list(itertools.product(DIRECTIONS, repeat=PATH_LENGTH))  # 256 paths
VAL_PATHS = [p for p in ALL_PATHS if _is_validation(p)]
TRAIN_PATHS = [p for p in ALL_PATHS if not _is_validation(p)]


@dataclass(frozen=True)
class Scenario:
    path: tuple[str, ...]

    def question(self) -> str:
        return f"Get out of the maze. Where you stand: {json.dumps({'breeze': self.path[0]})}"


def scenarios(split: str, n: int, seed: int) -> list[Scenario]:
    """n scenarios of a split ("train" or "val"), drawn deterministically from the split's paths."""
    paths = TRAIN_PATHS if split == "train" else VAL_PATHS
    rng = random.Random(f"{split}-{seed}")
    return [Scenario(rng.choice(paths)) for _ in range(n)]


@dataclass
class Walk:
    """The state of one episode: how far along the path the agent is, and how many moves it has made."""

    scenario: Scenario
    position: int = 0
    moves: int = 0

    @property
    def out(self) -> bool:
        return self.position == PATH_LENGTH

    def move(self, arguments: str) -> str:
        """Execute a `move` call; return the tool result (JSON, the breeze last)."""
        self.moves += 1
        direction = direction_of(arguments)
        if direction is None:
            result = {"error": 'arguments must be JSON like {"direction": "north"}'}
        elif direction != self.scenario.path[self.position]:
            result = {"result": "wall"}
        else:
            self.position += 1
            result = {"result": "exit" if self.out else "moved"}
        if not self.out:
            result["breeze"] = self.scenario.path[self.position]
        return json.dumps(result)

    def reward(self) -> float:
        if self.out:
            return 1.0 - WASTED_MOVE_PENALTY * (self.moves - PATH_LENGTH)
        return 0.5 * self.position / PATH_LENGTH


def direction_of(arguments: str) -> str | None:
    try:
        direction = json.loads(arguments).get("direction")
    except (json.JSONDecodeError, AttributeError):
        return None
    return direction if direction in DIRECTIONS else None


def start(scenario: Scenario) -> artrl.Trajectory:
    return artrl.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": scenario.question()},
        ],
        tools=TOOLS,
        metadata={"path": " ".join(scenario.path)},
    )


async def rollout(
    model: artrl.TrainableModel, scenario: Scenario, seed: int, temperature: float = 1.0
) -> artrl.Trajectory:
    """The agent: ordinary OpenAI tool-calling code against the served model."""
    client = model.openai_client()
    traj = start(scenario)
    walk = Walk(scenario)
    for turn in range(MAX_MOVES):
        response = await client.chat.completions.create(
            model=model.name,
            messages=traj.messages(),
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "move"}},  # the agent only moves
            max_tokens=32,
            temperature=temperature,
            seed=seed * 100 + turn,
        )
        choice = response.choices[0]
        traj.messages_and_choices.append(choice)
        if not choice.message.tool_calls:
            break  # a malformed call (the arguments did not parse): the episode ends
        for call in choice.message.tool_calls:
            result = walk.move(call.function.arguments) if walk.moves < MAX_MOVES else "No moves left."
            traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if walk.out or walk.moves >= MAX_MOVES:
            break
    traj.reward = walk.reward()
    traj.metrics.update(success=walk.out, moves=walk.moves, wrong_moves=walk.moves - walk.position)
    return traj


def weak_transcript(scenario: Scenario, rng: random.Random, index: int, skill: float) -> artrl.Trajectory:
    """A transcript of a weak walker, for the warm start: well-formed `move` calls until it is out or out of
    moves. Each move goes toward the breeze with probability `skill` and in a random direction otherwise.
    The warm start learns the format and this habit; RL has to learn to trust the breeze."""
    traj = start(scenario)
    walk = Walk(scenario)
    while not walk.out and walk.moves < MAX_MOVES:
        call_id = f"call_{index}_{walk.moves}"
        wanted = scenario.path[walk.position]
        arguments = json.dumps({"direction": wanted if rng.random() < skill else rng.choice(DIRECTIONS)})
        traj.messages_and_choices.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "move", "arguments": arguments}}
                ],
            }
        )
        traj.messages_and_choices.append(
            {"role": "tool", "tool_call_id": call_id, "content": walk.move(arguments)}
        )
    return traj
