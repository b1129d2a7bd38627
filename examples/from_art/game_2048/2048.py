# Ported to artrl from ART's examples/2048/2048.py (OpenPipe/ART, Apache-2.0): the changes are listed,
# as a diff, in docs/from-art.md. Sizes come from the environment so that CI can run it small.
# ruff: noqa: I001  (ART's import order, kept as it is to keep the diff short)
import asyncio
import os
from dotenv import load_dotenv
import random

import artrl as art
from artrl.local import LocalBackend
from rollout import rollout

load_dotenv()

random.seed(42)
GROUP, STEPS = (int(os.environ.get(k, d)) for k, d in (("GROUP", 48), ("STEPS", 100)))

# Declare the model
model = art.TrainableModel(
    name="003",
    project="2048",
    base_model="Qwen/Qwen2.5-7B-Instruct",
)
# To run on a T4, we need to override some config defaults.
engine = art.EngineConfig(
    max_context=8192,
    vllm=art.VLLMConfig(
        extra_args=("--enforce-eager",),
        gpu_memory_utilization=0.8,
    ),
)


async def main():
    # Initialize the server
    backend = LocalBackend(engine=engine)

    # Register the model with the local backend (sets up logging, inference, and training)
    await model.register(backend)

    for i in range(await model.get_step(), STEPS):
        train_groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(
                    rollout(model, i, is_validation=False) for _ in range(GROUP)
                )
                for _ in range(1)
            ),
            pbar_desc="gather",
            max_exceptions=10,
        )
        await model.delete_checkpoints()
        await model.train(
            train_groups,
            config=art.TrainConfig(learning_rate=3e-5),
            # Lowering the logprob_calculation_chunk_size is a memory saving measure
            # to allow longer sequences (up to 4096 tokens) to be processed on a T4.
            _config={"logprob_calculation_chunk_size": 8},
        )


if __name__ == "__main__":
    asyncio.run(main())
