"""Subprocess for the crash test: roll out and train in a loop, printing each completed step.

`python train_forever.py BASE_MODEL PATH` trains. `python train_forever.py --fork` imports what a trainer needs
once, then for each JSON line `[BASE_MODEL, PATH]` read from stdin forks a trainer (a process of its own, which
prints `pid N` first) and prints `ended N` once that process is gone: the crash test's rounds, each killing a
trainer, do not pay those imports (~5 s) again."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback

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


def fork_trainers() -> None:
    import peft  # noqa: F401  (what registering a model imports: the forked trainers find them loaded)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import artrl.local.backend.local_backend  # noqa: F401

    for line in sys.stdin:
        base_model, path = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the trainer: it runs until it is killed
            try:
                print(f"pid {os.getpid()}", flush=True)
                asyncio.run(main(base_model, path))
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        os.waitpid(pid, 0)
        print(f"ended {pid}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--fork"]:
        fork_trainers()
    else:
        asyncio.run(main(sys.argv[1], sys.argv[2]))
