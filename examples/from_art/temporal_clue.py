# Ported to artrl from ART's examples/temporal_clue/temporal-clue.py (OpenPipe/ART, Apache-2.0): the changes
# are listed, as a diff, in docs/from-art.md. Sizes come from the environment so that CI can run it small.
# ruff: noqa: I001, SIM115  (ART's import order and file reading, kept as they are to keep the diff short)
import artrl as art
import asyncio
from dotenv import load_dotenv
import json
import random
import re
from typing import TypedDict
import os

from artrl.local import LocalBackend
from clue_puzzles import make_puzzles

load_dotenv()


class TemporalCluePuzzle(TypedDict):
    num_clues: int
    prompt: str
    solution: dict[str, str]


# ART's puzzles.json if you have it (PUZZLES_JSON=path), else puzzles of the same shape made here
puzzles_path = os.environ.get("PUZZLES_JSON")

puzzles: list[TemporalCluePuzzle] = (
    json.loads(open(puzzles_path).read()) if puzzles_path else make_puzzles(400)
)
VAL, GROUP, STEPS = (int(os.environ.get(k, d)) for k, d in (("VAL", 64), ("GROUP", 50), ("STEPS", 1000)))
val_puzzles = puzzles[:VAL]
test_puzzles = puzzles[64:128]
train_puzzles = puzzles[128:]
random.seed(42)
random.shuffle(train_puzzles)


async def rollout(model: art.Model, puzzle: TemporalCluePuzzle) -> art.Trajectory:
    messages: art.Messages = [{"role": "user", "content": puzzle["prompt"]}]
    client = model.openai_client()
    chat_completion = await client.chat.completions.create(messages=messages, model=model.name)
    choice = chat_completion.choices[0]
    content = choice.message.content
    assert isinstance(content, str)
    num_correct = 0
    for key, value in puzzle["solution"].items():
        if matches := re.findall(rf"{key}\. ([A-Za-z \.:-]+)", content):
            match = matches[-1]
            if match.strip().lower() == value.lower():
                num_correct += 1
    reward = acc = num_correct / len(puzzle["solution"])
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=reward, metrics={"acc": acc})


async def main():
    model = art.TrainableModel(
        name="001",
        project="temporal-clue",
        base_model=os.environ.get("BASE_MODEL", "Qwen/Qwen2.5-7B-Instruct"),
    )
    backend = LocalBackend()
    await model.register(backend)

    stride = 4
    for i in range(await model.get_step(), STEPS):
        val_groups, train_groups = await asyncio.gather(
            art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, puzzle) for _ in range(2)) for puzzle in val_puzzles),
                pbar_desc="val",
            ),
            art.gather_trajectory_groups(
                (
                    art.TrajectoryGroup(rollout(model, puzzle) for _ in range(GROUP))
                    for puzzle in train_puzzles[i * stride : (i + 1) * stride]
                ),
                pbar_desc="train",
            ),
        )
        await model.log(val_groups)
        await model.delete_checkpoints()
        await model.train(
            train_groups,
            config=art.TrainConfig(learning_rate=5e-5),
        )


if __name__ == "__main__":
    asyncio.run(main())
