"""The agents of bench_concurrency and bench_engines: each makes `turns` chat-completion calls through an
OpenAI client (the assistant reply and a new user message appended every turn), with a seed per agent and
turn; a calibration pass picks seeds whose calls generate the full max_tokens (random-weight models can
sample end-of-sequence early), so every mode and engine generates the same tokens."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

SEED_STRIDE = 7919  # added to a seed when a calibration call ended before max_tokens
MAX_SEED_TRIES = 50


@dataclass
class RunStats:
    calls: int = 0
    tokens: int = 0
    seconds: float = 0.0
    reseeded: int = 0  # calibration only: calls repeated with another seed
    finish: Counter = field(default_factory=Counter)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Workload:
    client: Any  # openai.AsyncOpenAI
    model_name: str
    turns: int
    max_tokens: int
    seeds: dict[tuple[int, int], int]  # (agent, turn) -> seed

    def seed(self, agent: int, turn: int) -> int:
        return self.seeds.setdefault((agent, turn), 100_003 * agent + 101 * turn + 1)


def token_ids_of(choice: Any) -> list[int]:
    ids = getattr(choice, "token_ids", None)
    if ids is None and getattr(choice, "model_extra", None):
        ids = choice.model_extra.get("token_ids")
    if ids is None:
        raise RuntimeError("the gateway's choice carries no `token_ids`")
    return list(ids)


async def run_agent(work: Workload, agent: int, stats: RunStats, calibrate: bool = False) -> None:
    messages: list[dict[str, str]] = [
        {"role": "user", "content": f"Agent {agent}: let us play a guessing game. What is your first guess?"}
    ]
    for turn in range(work.turns):
        tries = 0
        while True:
            response = await work.client.chat.completions.create(
                model=work.model_name,
                messages=messages,
                temperature=1.0,
                max_tokens=work.max_tokens,
                seed=work.seed(agent, turn),
            )
            choice = response.choices[0]
            if not calibrate or choice.finish_reason == "length" or tries >= MAX_SEED_TRIES:
                break
            tries += 1
            stats.reseeded += 1
            work.seeds[(agent, turn)] += SEED_STRIDE
        stats.calls += 1
        stats.tokens += len(token_ids_of(choice))
        stats.finish[choice.finish_reason] += 1
        messages.append({"role": "assistant", "content": choice.message.content or ""})
        messages.append({"role": "user", "content": "continue"})


async def run_concurrent(work: Workload, agents: int, calibrate: bool = False) -> RunStats:
    stats = RunStats()
    started = time.perf_counter()
    await asyncio.gather(*(run_agent(work, a, stats, calibrate) for a in range(agents)))
    stats.seconds = time.perf_counter() - started
    return stats


async def run_sequential(work: Workload, agents: int) -> RunStats:
    stats = RunStats()
    started = time.perf_counter()
    for a in range(agents):
        await run_agent(work, a, stats)
    stats.seconds = time.perf_counter() - started
    return stats
