"""The maze demo's supervised stages on the tiny model, cached under --path/models (sft_cache.py): the stand-in
for pretraining (tool_reading.py) and the warm start (a weak walker's transcripts).

`models/` beside this file holds the defaults' stand-in, built by `train_agent.py --ship` (one thread, ~35 s): a
run with those settings copies it, as a hub model arrives pretrained, instead of building it; another setting, or a
change to the code its key covers (tool_reading.py, the tiny model's shape and code), builds its own.
tests/test_examples.py checks that the shipped folder is the defaults' key. The warm start is built every time
(~8 s): it is the recipe's own SFT, the maze's format."""

from __future__ import annotations

import argparse
import inspect
import random
from pathlib import Path

import maze_env as env
import tool_reading
from sft_cache import sft_stage, stage_folder, tiny_model_parts

import artrl

SHIPPED = Path(__file__).parent / "models"  # the defaults' pretraining stand-in (built by --ship)
STAND_IN = "tiny-tool-reading"


def pretrain_recipe(args: argparse.Namespace) -> tuple[artrl.SFTConfig, list]:
    """The stand-in's SFT settings and what else determines it (its cache key's parts)."""
    config = artrl.SFTConfig(learning_rate=args.pretrain_lr, epochs=1, batch_size=16, seed=0)
    return config, [args.pretrain_examples, inspect.getsource(tool_reading), *tiny_model_parts()]


def stand_in_folder(args: argparse.Namespace) -> Path:
    """The stand-in's cache folder for these settings (its name: that of the shipped one, where it is)."""
    return stage_folder(str(Path(args.path) / "models" / "tiny"), STAND_IN, *pretrain_recipe(args), args.path)


async def pretrained_tiny_model(
    backend: artrl.LocalBackend, args: argparse.Namespace, shipped: Path | None = SHIPPED
) -> str:
    """The project's tiny model after the stand-in for pretraining: generic tool-reading conversations
    (see tool_reading.py; a hub model needs no such stage). The defaults' comes with the example (models/): a run
    copies it, as a hub model arrives pretrained, rather than build it (~35 s on one core); --no-shipped builds."""
    if not args.pretrain_examples:
        return str(artrl.ensure_tiny_model(Path(args.path) / "models" / "tiny"))
    corpus = lambda: tool_reading.corpus(args.pretrain_examples)  # noqa: E731
    config, parts = pretrain_recipe(args)
    return await sft_stage(backend, None, STAND_IN, corpus, config, parts, args.path, "maze", shipped)


async def warm_start(backend: artrl.LocalBackend, base_model: str, args: argparse.Namespace) -> str:
    """SFT of `base_model` on a weak walker's transcripts: well-formed calls, a poor player."""

    def transcripts() -> list[artrl.Trajectory]:
        rng = random.Random(0)
        return [
            env.weak_transcript(s, rng, i, args.warm_skill)
            for i, s in enumerate(env.scenarios("train", args.sft_examples, 0))
        ]

    config = artrl.SFTConfig(learning_rate=args.sft_lr, epochs=args.sft_epochs, batch_size=16, seed=0)
    key = [args.sft_examples, args.warm_skill, inspect.getsource(env.weak_transcript)]
    return await sft_stage(
        backend, base_model, "maze-warm", transcripts, config, key, args.path, project="maze"
    )
