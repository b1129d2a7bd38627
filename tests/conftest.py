from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from artrl.local.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
async def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny model served by a real LocalBackend (embedded engine + gateway), shared by the session."""
    import artrl

    backend = artrl.LocalBackend(path=tmp_path_factory.mktemp("artrl"))
    model = artrl.TrainableModel(name="tiny", project="tests", base_model=str(tiny_model_dir))
    await model.register(backend)
    yield model
    await backend.close()


@pytest.fixture
def scripted(tokenizer):
    """A real gateway over a ScriptedEngine: returns (engine, base_url); the engine's scripts are set by tests."""
    from fakes import ScriptedEngine

    from artrl.config import EngineConfig, GatewayConfig
    from artrl.local.service import LocalService

    engine = ScriptedEngine()
    service = LocalService.serve("scripted", None, tokenizer, engine, EngineConfig(), GatewayConfig())
    yield engine, service.base_url
    service.server.stop()


@pytest.fixture
async def fresh_model(tiny_model_dir: Path, tmp_path: Path):
    """The tiny model registered on its own LocalBackend (tests that train: the shared `served` stays put)."""
    import artrl

    backend = artrl.LocalBackend(path=tmp_path / "artrl")
    model = artrl.TrainableModel(name="tiny", project="fresh", base_model=str(tiny_model_dir))
    await model.register(backend)
    yield model
    await backend.close()
