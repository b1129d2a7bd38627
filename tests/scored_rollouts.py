"""A group of one-call rollouts through the served model, with given rewards (the tests that train a step)."""

from __future__ import annotations

import asyncio

import artrl

PROMPT = [{"role": "user", "content": "What is the weather in paris?"}]


async def rollouts(
    model: artrl.TrainableModel, rewards: list[float], max_tokens: int = 8
) -> artrl.TrajectoryGroup:
    """One trajectory per reward: the prompt and one sampled reply (seed = its index)."""
    client = model.openai_client()

    async def one(i: int, reward: float) -> artrl.Trajectory:
        response = await client.chat.completions.create(
            model=model.name, messages=PROMPT, max_tokens=max_tokens, seed=i
        )
        return artrl.Trajectory(messages_and_choices=[*PROMPT, response.choices[0]], reward=reward)

    return artrl.TrajectoryGroup(await asyncio.gather(*(one(i, r) for i, r in enumerate(rewards))))
