"""Subprocess for the vLLM crash test: register (resuming), then roll out and train on a vLLM engine in a loop.

`python vllm_train_forever.py BASE_MODEL PATH` prints, in order: `resumed STEP TARGET` (the step the model resumed
at and the adapter vLLM serves), `group PGID` (the vLLM server's process group), then for every adapter load
`loading NAME` just before the HTTP call to vLLM and `loaded NAME SECONDS` once vLLM answered, and `step N` after
each training call. The test kills it (kill -9) between a `loading` and its `loaded`."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import artrl
from artrl.config import VLLMConfig
from artrl.local.engine.vllm.replicas import ReplicaSet

_admin = ReplicaSet.admin


def announced_admin(self, replica, path, body=None, method="POST"):
    """ReplicaSet.admin, announcing adapter loads (this process is killed right after the announcement)."""
    if path != "/v1/load_lora_adapter":
        return _admin(self, replica, path, body, method)
    print(f"loading {body['lora_name']}", flush=True)
    started = time.monotonic()
    _admin(self, replica, path, body, method)
    print(f"loaded {body['lora_name']} {time.monotonic() - started:.3f}", flush=True)


async def main(base_model: str, path: str) -> None:
    ReplicaSet.admin = announced_admin  # (this subprocess only)
    # (vLLM's token-in/token-out wire here: a real server on it, loads and resumes included)
    engine = artrl.EngineConfig(kind="vllm", vllm=VLLMConfig(lora_window=2, wire="generate"))
    async with artrl.LocalBackend(path=path, engine=engine) as backend:
        model = artrl.TrainableModel(name="crash", project="v", base_model=base_model)
        await model.register(backend)
        served = backend.service(model).engine
        print(f"resumed {await model.get_step()} {served.target}", flush=True)
        print(f"group {os.getpgid(served.server.process.pid)}", flush=True)
        client = model.openai_client()
        messages = [{"role": "user", "content": "go"}]
        while True:
            responses = await asyncio.gather(
                *(
                    client.chat.completions.create(model=model.name, messages=messages, max_tokens=8, seed=i)
                    for i in range(4)
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
