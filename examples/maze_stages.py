"""The maze demo's supervised stages on the tiny model, cached under --path/models (sft_cache.py): the stand-in
for pretraining (tool_reading.py) and the warm start on it (a weak walker's transcripts).

`models/` beside this file holds both stages of the defaults, built by `train_agent.py --ship` (one thread: ~35 s
and ~10 s): a run with those settings copies them, as a hub model arrives pretrained (and a team starts RL from its
own SFT checkpoint), instead of building them; another setting, or a change to the code a key covers (tool_reading.py,
the weak walker, the tiny model's shape and code), builds its own. --no-shipped builds both. tests/test_examples.py
checks that the shipped folders are the defaults' keys."""

from __future__ import annotations

import argparse
import inspect
import random
from pathlib import Path

import maze_env as env
import tool_reading
from sft_cache import publish, sft_stage, stage_folder, tiny_model_parts

import artrl

SHIPPED = Path(__file__).parent / "models"  # the defaults' stand-in and warm start (built by --ship)
STAGE_NAMES = ("tiny-tool-reading", "maze-warm")  # (the stand-in's, the warm start's)


def pretrain_recipe(args: argparse.Namespace) -> tuple[artrl.SFTConfig, list]:
    """The stand-in's SFT settings and what else determines it (its cache key's parts)."""
    config = artrl.SFTConfig(learning_rate=args.pretrain_lr, epochs=1, batch_size=16, seed=0)
    return config, [args.pretrain_examples, inspect.getsource(tool_reading), *tiny_model_parts()]


def warm_recipe(args: argparse.Namespace) -> tuple[artrl.SFTConfig, list]:
    """The warm start's SFT settings and what else determines it (its cache key's parts, beside its base)."""
    config = artrl.SFTConfig(learning_rate=args.sft_lr, epochs=args.sft_epochs, batch_size=16, seed=0)
    return config, [args.sft_examples, args.warm_skill, inspect.getsource(env.weak_transcript)]


def stage_folders(args: argparse.Namespace) -> tuple[Path, Path]:
    """The cache folders of the stand-in and of the warm start on it, for these settings (their names: those of
    the shipped ones, where they are)."""
    tiny = str(Path(args.path) / "models" / "tiny")
    stand = stage_folder(tiny, STAGE_NAMES[0], *pretrain_recipe(args), args.path)
    return stand, stage_folder(str(stand), STAGE_NAMES[1], *warm_recipe(args), args.path)


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
    return await sft_stage(backend, None, STAGE_NAMES[0], corpus, config, parts, args.path, "maze", shipped)


async def warm_start(
    backend: artrl.LocalBackend, base_model: str, args: argparse.Namespace, shipped: Path | None = SHIPPED
) -> str:
    """SFT of `base_model` on a weak walker's transcripts: well-formed calls, a poor player. The defaults' (on
    the shipped stand-in) comes with the example too (~8 s to build); on another base it is built."""

    def transcripts() -> list[artrl.Trajectory]:
        rng = random.Random(0)
        return [
            env.weak_transcript(s, rng, i, args.warm_skill)
            for i, s in enumerate(env.scenarios("train", args.sft_examples, 0))
        ]

    return await sft_stage(
        backend, base_model, STAGE_NAMES[1], transcripts, *warm_recipe(args), args.path, "maze", shipped
    )


async def ship(backend: artrl.LocalBackend, args: argparse.Namespace, into: Path = SHIPPED) -> list[str]:
    """`train_agent.py --ship [DIR]`: build both stages for these settings (or take them from --path's cache:
    the same key) and make them the ones in `into`, in place of other stage folders there (nothing else is
    touched). A stand-in already in `into` under its key is kept, and the warm start trained on it: the pair
    that demo runs copy is the pair that was trained together."""
    stand = await pretrained_tiny_model(backend, args, shipped=into)
    built = [Path(stand), Path(await warm_start(backend, stand, args, shipped=None))]
    return publish(built, into, STAGE_NAMES)
