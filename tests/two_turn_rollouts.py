"""Two-turn rollouts about the weather through a model's own client: the second call continues the first, or
(forked) starts over from an edited history. Used by the dashboard's tests."""

from __future__ import annotations

import artrl

SYSTEM = {"role": "system", "content": "You answer about the weather."}


async def two_turns(model, seed: int, reward: float, fork: bool = False) -> artrl.Trajectory:
    """Two sampled calls; the second continues the first (or, with fork, starts over from an edited history,
    so the trajectory trains as two rows that share the system prompt)."""
    client = model.openai_client()
    first = [SYSTEM, {"role": "user", "content": "weather in paris?"}]
    a = await client.chat.completions.create(model=model.name, messages=first, max_tokens=6, seed=seed)
    second_prompt = (
        [SYSTEM, {"role": "user", "content": "and in rome?"}]
        if fork
        else [
            *first,
            a.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "and in rome?"},
        ]
    )
    b = await client.chat.completions.create(
        model=model.name, messages=second_prompt, max_tokens=6, seed=seed + 100
    )
    items = [*first, a.choices[0], {"role": "user", "content": "and in rome?"}, b.choices[0]]
    return artrl.Trajectory(messages_and_choices=items, reward=reward, metrics={"turns": 2})
