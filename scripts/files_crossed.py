"""Which of artrl's source files one chat request and one training step run code in (the tiny model, an
in-process LocalBackend): a reader's walk through the code, measured rather than drawn.

    .venv/bin/python scripts/files_crossed.py            # counts and files, as JSON
    PYTHONPATH=OTHER_CHECKOUT/src .venv/bin/python scripts/files_crossed.py   # another commit's tree

Every thread's calls are recorded (a profile hook set before the backend starts its threads) while one chat
completion, then one `model.train` call, runs after a warm-up of each."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

import artrl

SOURCE = str(Path(artrl.__file__).parent)
_seen: set[str] | None = None


def _profile(frame, event, arg) -> None:
    if _seen is not None and event == "call" and frame.f_code.co_filename.startswith(SOURCE):
        _seen.add(os.path.relpath(frame.f_code.co_filename, SOURCE))


async def main() -> dict[str, list[str]]:
    global _seen
    threading.setprofile(_profile)
    sys.setprofile(_profile)
    folder = Path(tempfile.mkdtemp())
    backend = artrl.LocalBackend(path=folder / "run")
    model = artrl.TrainableModel(
        name="m", project="walk", base_model=str(artrl.build_tiny_model(folder / "m"))
    )
    await model.register(backend)
    client = model.openai_client()
    hello = [{"role": "user", "content": "hi"}]

    async def chat():
        return await client.chat.completions.create(model=model.name, messages=hello, max_tokens=4)

    async def groups() -> list[artrl.TrajectoryGroup]:
        return [
            artrl.TrajectoryGroup(
                [
                    artrl.Trajectory(messages_and_choices=[*hello, (await chat()).choices[0]], reward=r)
                    for r in (0, 1)
                ]
            )
            for _ in range(2)
        ]

    config = artrl.TrainConfig(learning_rate=1e-4)
    await chat()
    await model.train(await groups(), config=config)
    crossed = {}
    for walk in ("chat request", "training step"):
        ready = await groups() if walk == "training step" else None
        _seen = seen = set()
        await (chat() if ready is None else model.train(ready, config=config))
        _seen = None
        crossed[walk] = sorted(seen)
    await backend.close()
    return crossed


if __name__ == "__main__":
    crossed = asyncio.run(main())
    print(
        json.dumps({walk: {"files": len(files), "list": files} for walk, files in crossed.items()}, indent=1)
    )
