"""Supervised stages of the examples' recipes (a stand-in for pretraining, a warm start), cached as model folders.

An example may ship built stages beside its code (examples/email_agent/models/): a folder there whose name is
the key of a stage's recipe is that stage, built from the same code and settings (the key covers them all), and
is copied into the cache instead of built again. A recipe that changes gets a new key, so a shipped stage never
stands in for another recipe; it is built as before."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import artrl

TINY_MODEL_CODE = ("artrl.local.models.tiny_model", "artrl.local.models.chat_template")


def tiny_model_parts() -> list:
    """What makes the project's tiny model (its shape, the code of its weights, tokenizer and template): key parts
    of a stage trained from it, which names it by its folder alone. The code is read, not imported (torch)."""
    from artrl.config import TINY_MODEL_PRESETS

    sources = [Path(importlib.util.find_spec(m).origin).read_text() for m in TINY_MODEL_CODE]
    return [TINY_MODEL_PRESETS["tiny"].model_dump(), *sources]


def stage_folder(base_model: str, name: str, config: artrl.SFTConfig, key_parts: list, path: str) -> Path:
    """The cache folder of a stage: --path/models/NAME-KEY, KEY a hash of everything that determines it. A base
    model from this cache counts by its folder's name, not its path: the cache holds wherever --path is
    (moved, copied, or given as another path)."""
    models = Path(path) / "models"
    base = Path(base_model).name if Path(base_model).parent == models else base_model
    parts = [base, config.model_dump(), *key_parts]
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]
    return models / f"{name}-{key}"


def add_shipping_args(parser, shipped: Path, what: str) -> None:
    """The examples' --shipped/--no-shipped and --ship [DIR] options, for the stages `what` names."""
    parser.add_argument(
        "--shipped",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"take the {what} shipped in {shipped.parent.name}/{shipped.name} where it is these settings' "
        "(the key: see the example's stages module); --no-shipped builds it",
    )
    parser.add_argument(
        "--ship",
        nargs="?",
        const=str(shipped),
        default=None,
        metavar="DIR",
        help=f"build the {what} of these settings, make it the one in DIR (default: the shipped one; run it "
        "with the defaults after changing what its key covers) and stop",
    )


async def sft_stage(
    backend: artrl.LocalBackend,
    base_model: str | None,
    name: str,
    transcripts: Callable[[], list[artrl.Trajectory]],
    config: artrl.SFTConfig,
    key_parts: list,
    path: str,
    project: str,
    shipped: Path | None = None,
) -> str:
    """Fully fine-tune `base_model` on `transcripts()`; the result is cached as a model folder (stage_folder).
    `shipped`: a folder of stages built before; the one of this key, if there, is copied instead of built.
    `base_model` None: the project's tiny model (--path/models/tiny), built only when the stage is built."""
    tiny = Path(path) / "models" / "tiny"
    folder = stage_folder(base_model or str(tiny), name, config, key_parts, path)
    if complete_stage(folder):
        return str(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # made aside (a folder of this process's own: two runs on one --path may reach here together), then renamed
    tmp = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        if shipped is not None and complete_stage(shipped / folder.name):
            shutil.copytree(shipped / folder.name, tmp, dirs_exist_ok=True)
            made = f"the copy shipped with the example ({shipped / folder.name})"
        else:
            if base_model is None:  # (its tokenizer and random weights: what the stage trains)
                base_model = str(artrl.ensure_tiny_model(tiny))
            model = artrl.TrainableModel(name=folder.name, project=project, base_model=base_model, lora=None)
            await model.register(backend)
            result = await model.train_sft(transcripts(), config)
            await model.export(str(tmp))
            made = f"{result.metrics['optimizer_steps']} SFT steps, loss {result.metrics['loss']:.3f}"
        try:
            tmp.rename(folder)
        except OSError:
            if not complete_stage(folder):  # (another run's rename got there first: theirs is the same stage)
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{name}: {made}")
    return str(folder)


def complete_stage(folder: Path) -> bool:
    """A stage's folder is there whole (config and weights)."""
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def publish(built: list[Path], into: Path, names: tuple[str, ...]) -> list[str]:
    """Make the stage folders `built` the ones in `into` (an example's shipped stages): other folders of those
    stage names (NAME-KEY) there are removed, nothing else is touched; each is copied aside, then renamed."""
    stage = re.compile(rf"({'|'.join(map(re.escape, names))})-[0-9a-f]{{12}}(\.tmp)?")
    into.mkdir(parents=True, exist_ok=True)
    for old in into.iterdir():
        if old.is_dir() and stage.fullmatch(old.name) and old.name not in {b.name for b in built}:
            shutil.rmtree(old)
    for folder in built:
        if not (into / folder.name).exists():
            tmp = into / f"{folder.name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(folder, tmp)
            tmp.rename(into / folder.name)
    return [str(into / b.name) for b in built]
