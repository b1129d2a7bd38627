"""Supervised stages of the examples' recipes (a stand-in for pretraining, a warm start), cached as model folders."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import artrl


async def sft_stage(
    backend: artrl.LocalBackend,
    base_model: str,
    name: str,
    transcripts: Callable[[], list[artrl.Trajectory]],
    config: artrl.SFTConfig,
    key_parts: list,
    path: str,
    project: str,
) -> str:
    """Fully fine-tune `base_model` on `transcripts()`; the result is cached as a model folder keyed by
    everything that determines it. A base model from this cache counts by its folder's name, not its path:
    the cache holds wherever --path is (moved, copied, or given as another path)."""
    models = Path(path) / "models"
    base = Path(base_model).name if Path(base_model).parent == models else base_model
    parts = [base, config.model_dump(), *key_parts]
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]
    folder = models / f"{name}-{key}"
    if (folder / "config.json").exists():
        return str(folder)
    model = artrl.TrainableModel(name=f"{name}-{key}", project=project, base_model=base_model, lora=None)
    await model.register(backend)
    result = await model.train_sft(transcripts(), config)
    tmp = folder.with_name(folder.name + ".tmp")
    await model.export(str(tmp))
    tmp.rename(folder)
    print(f"{name}: {result.metrics['optimizer_steps']} SFT steps, loss {result.metrics['loss']:.3f}")
    return str(folder)
