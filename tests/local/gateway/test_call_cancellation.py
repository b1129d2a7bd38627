"""A call whose client gave up waits for its generation to stop, but not past its own cancellation (the
server shutting down): before, that wait swallowed every exception, the handler's cancellation too, and the
handler answered its 499 as if nothing had happened."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from artrl.config import GatewayConfig
from artrl.local.gateway.calls import Calls
from artrl.local.gateway.dialects.chat import ChatDialect

BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8}).encode()


class GoneRequest:
    """The request of a client that has already disconnected."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}  # (no content-length: the body is read)

    async def stream(self):
        yield BODY

    async def receive(self) -> dict[str, str]:
        return {"type": "http.disconnect"}


class StubbornServing:
    """A serving layer whose generation, once cancelled, takes its time to stop (its first cancel is ignored:
    it waits for `release`, or for a second cancel)."""

    generating = 0

    def __init__(self) -> None:
        self.ignoring, self.release = asyncio.Event(), asyncio.Event()

    def prepare(self, request: Any) -> Any:
        return SimpleNamespace(request=request)

    async def events(self, prepared: Any, streaming: bool):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.ignoring.set()
        await self.release.wait()
        return
        yield


async def test_cancelling_a_call_that_waits_for_its_generation_to_stop_cancels_it():
    serving = StubbornServing()
    calls = Calls(serving, None, GatewayConfig())
    handler = asyncio.create_task(calls.answer(GoneRequest(), None, ChatDialect()))
    try:
        await asyncio.wait_for(serving.ignoring.wait(), timeout=10)  # the 499 path: waiting for it to stop
        await asyncio.sleep(0.05)
        handler.cancel()
        done, _ = await asyncio.wait({handler}, timeout=5)
        assert done, "the cancelled call is still waiting"
        with pytest.raises(asyncio.CancelledError):
            handler.result()
    finally:
        serving.release.set()
        await asyncio.wait({handler}, timeout=5)
        calls.preparation.close()
