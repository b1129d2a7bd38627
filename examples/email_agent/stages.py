"""The email recipe's supervised stages on the tiny model: the stand-in for pretraining and the warm start,
cached under --path/models (examples/sft_cache.py), and the built ones this example ships.

`models/` beside this file holds the two stages of train.py's defaults, built by `train.py --ship` (on one
thread of a 2-core Intel Xeon: ~8 min for the stand-in, ~4 for the warm start). A run with those settings copies
them instead of building them, as a hub model arrives pretrained; any other setting, or a change to the code
their key covers (copying.py, email_env.py, inbox.py, warm_start below, the SFT settings, the tiny model's shape
and code), gets another key and builds its own. tests/test_email_agent.py checks that the shipped folders are
the defaults' keys."""

from __future__ import annotations

import argparse
import inspect
import itertools
import random
import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).parent.parent))
import copying
import email_env as env
import inbox as inboxes
from sft_cache import publish, sft_stage, stage_folder, tiny_model_parts

import artrl

SHIPPED = Path(__file__).parent / "models"
STAGE_NAMES = ("tiny-copying", "email-warm")  # (their cache folders: NAME-KEY)
WARM_INBOX_MESSAGES = 1000  # the warm start's inboxes (seeds 1, 2, ...; RL trains on seed 0's)


def stand_in_recipe(args: argparse.Namespace) -> tuple[artrl.SFTConfig, list]:
    """The stand-in's SFT settings and what else determines it (its cache key's parts): the corpus's code and
    the tiny model it trains (its shape, and the code that makes its weights, tokenizer and template)."""
    config = artrl.SFTConfig(learning_rate=args.copy_lr, batch_size=16, seed=0)
    return config, [args.copy_examples, inspect.getsource(copying), *tiny_model_parts()]


def warm_recipe(args: argparse.Namespace) -> tuple[artrl.SFTConfig, list]:
    """The warm start's SFT settings and what else determines it (its cache key's parts)."""
    config = artrl.SFTConfig(learning_rate=args.warm_lr, batch_size=16, seed=0)
    parts = [
        args.warm_examples,
        args.warm_skill,
        WARM_INBOX_MESSAGES,
        inspect.getsource(env),
        inspect.getsource(inboxes),
        inspect.getsource(warm_start),  # (its transcripts: the rng, the inboxes' seeds)
    ]
    return config, parts


def stage_folders(args: argparse.Namespace) -> tuple[Path, Path]:
    """The cache folders of the stand-in and of the warm start on it, for these settings."""
    tiny = str(Path(args.path) / "models" / "tiny")
    stand = stage_folder(tiny, STAGE_NAMES[0], *stand_in_recipe(args), args.path)
    return stand, stage_folder(str(stand), STAGE_NAMES[1], *warm_recipe(args), args.path)


async def stand_in(
    backend: artrl.LocalBackend, args: argparse.Namespace, shipped: Path | None = SHIPPED
) -> str:
    """The tiny model after SFT on the copying corpus (the tiny model itself with --copy-examples 0)."""
    if not args.copy_examples:
        return str(artrl.ensure_tiny_model(Path(args.path) / "models" / "tiny"))
    corpus = lambda: copying.corpus(args.copy_examples)  # noqa: E731
    config, parts = stand_in_recipe(args)
    return await sft_stage(backend, None, STAGE_NAMES[0], corpus, config, parts, args.path, "email", shipped)


async def warm_start(
    backend: artrl.LocalBackend, base: str, args: argparse.Namespace, shipped: Path | None = SHIPPED
) -> str:
    """SFT on a scripted agent's transcripts over inboxes of the training pool that RL never sees (one
    transcript per question: nothing to memorise, every value has to be read)."""
    folder = Path(args.path) / "email-data" / "warm"

    def transcripts() -> list[artrl.Trajectory]:
        rng, out = random.Random(0), []
        for seed in itertools.count(1):
            questions = inboxes.build(folder / f"{seed}.sqlite", "train", WARM_INBOX_MESSAGES, seed)
            inbox = inboxes.Inbox(folder / f"{seed}.sqlite")
            out += [
                env.scripted_transcript(inbox, q, rng, len(out) + i, env.Skill(*args.warm_skill))
                for i, q in enumerate(questions)
            ]
            inbox.close()
            if len(out) >= args.warm_examples:
                return out[: args.warm_examples]
        raise AssertionError("itertools.count does not end")

    return await sft_stage(
        backend, base, STAGE_NAMES[1], transcripts, *warm_recipe(args), args.path, "email", shipped
    )


async def ship(backend: artrl.LocalBackend, args: argparse.Namespace, into: Path = SHIPPED) -> list[str]:
    """`train.py --ship [DIR]`: build both stages for these settings (or take them from --path's cache: the same
    key) and make them the ones in `into`, in place of other stage folders there (nothing else is touched)."""
    stand = await stand_in(backend, args, shipped=None)
    built = [Path(stand), Path(await warm_start(backend, stand, args, shipped=None))]
    return publish(built, into, STAGE_NAMES)
