"""Fixtures of the gateway's tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def slow(tokenizer):
    """A real gateway over a SlowEngine (fakes.py: a token every 0.05 s until max_tokens, an abort or, held, a
    release): `slow(engine=None, **gateway)` serves one, with GatewayConfig(**gateway), and returns (engine,
    service). Every service it started stops after the test."""
    from fakes import SlowEngine

    from artrl.config import EngineConfig, GatewayConfig
    from artrl.local.service.service import LocalService

    def serve(engine: SlowEngine | None = None, **gateway):
        engine = engine or SlowEngine()
        service = LocalService.serve(
            "slow", None, tokenizer, engine, EngineConfig(), GatewayConfig(**gateway)
        )
        services.append(service)
        return engine, service

    services: list = []
    yield serve
    for service in services:
        service.server.stop()
