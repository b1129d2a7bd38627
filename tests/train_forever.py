"""Subprocess for the crash test: roll out and train in a loop, printing each completed step."""

from __future__ import annotations

import asyncio
import sys

import artrl


async def main(base_model: str, path: str) -> None:
    async with artrl.LocalBackend(path=path) as backend:
        model = artrl.TrainableModel(name="crash", project="t", base_model=base_model)
        await model.register(backend)
        client = model.openai_client()
        messages = [{"role": "user", "content": "go"}]
        while True:
            responses = await asyncio.gather(
                *(
                    client.chat.completions.create(model=model.name, messages=messages, max_tokens=48, seed=i)
                    for i in range(16)
                )
            )
            group = artrl.TrajectoryGroup(
                artrl.Trajectory(messages_and_choices=[*messages, r.choices[0]], reward=float(i % 2))
                for i, r in enumerate(responses)
            )
            result = await model.train([group], config=artrl.TrainConfig(learning_rate=1e-3))
            print(f"step {result.step}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
