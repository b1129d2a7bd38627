"""`artrl.build_tiny_model`: the public entry to the offline model builder (imports torch only when called)."""

from __future__ import annotations

import os
from pathlib import Path

from artrl.config import TinyModelConfig


def build_tiny_model(directory: str | os.PathLike[str], config: TinyModelConfig | str = "tiny") -> Path:
    """Build a small Qwen3-architecture model + tokenizer + chat template at `directory`, deterministically.

    `config` is a preset name ("tiny", "small") or a `TinyModelConfig`. The folder is a standard Hugging Face
    model folder: pass it as `base_model=`.
    """
    from artrl.local.models.tiny_model import build_tiny_model as build

    return build(directory, config)


def ensure_tiny_model(directory: str | os.PathLike[str], config: TinyModelConfig | str = "tiny") -> Path:
    """Build the model at `directory` unless a complete build is already there."""
    path = Path(directory)
    if (
        (path / "config.json").exists()
        and (path / "tokenizer.json").exists()
        and (path / "model.safetensors").exists()
    ):
        return path
    return build_tiny_model(path, config)
