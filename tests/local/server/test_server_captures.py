"""The training server's capture blocks (server/captures.py) with stand-in gateways: a tenant's captures are
its own, each model's gateway capture is opened once, a close asked twice (at once, or again later) answers
the same records, and a close that fails leaves the capture open for a close asked again."""

from __future__ import annotations

import asyncio

import pytest

from artrl.local.server.captures import CaptureNotFound, ServerCaptures


class Gateways:
    """Stand-in gateways: captures opened and closed per model, a close that can be made to fail once."""

    def __init__(self) -> None:
        self.opened: list[str] = []
        self.closed: list[str] = []
        self.fail_next_close = False
        self.release = asyncio.Event()
        self.release.set()

    def opener(self, model: str):
        async def open_there() -> str:
            self.opened.append(model)
            return f"gw-{model}"

        return open_there

    async def close_there(self, model: str, key: str) -> list[dict]:
        await self.release.wait()
        if self.fail_next_close:
            self.fail_next_close = False
            raise RuntimeError("the gateway did not answer")
        self.closed.append(model)
        return [{"model": model, "key": key}]


async def test_a_block_opens_each_models_capture_once_and_closes_them_in_order():
    captures, gateways = ServerCaptures(max_open_per_tenant=4), Gateways()
    key = captures.open("alice")
    for model in ("b", "a", "b"):
        assert await captures.gateway_id("alice", key, model, gateways.opener(model)) == f"gw-{model}"
    assert gateways.opened == ["b", "a"]
    records = await captures.close("alice", key, gateways.close_there)
    assert [r["model"] for r in records] == ["b", "a"]
    assert await captures.close("alice", key, gateways.close_there) == records  # asked again: the same
    assert gateways.closed == ["b", "a"]


async def test_another_tenant_reaches_no_capture():
    captures, gateways = ServerCaptures(max_open_per_tenant=4), Gateways()
    key = captures.open("alice")
    with pytest.raises(CaptureNotFound):
        await captures.gateway_id("bob", key, "m", gateways.opener("m"))
    with pytest.raises(CaptureNotFound):
        await captures.close("bob", key, gateways.close_there)


async def test_two_closes_at_once_get_the_same_records():
    captures, gateways = ServerCaptures(max_open_per_tenant=4), Gateways()
    key = captures.open("alice")
    await captures.gateway_id("alice", key, "m", gateways.opener("m"))
    gateways.release.clear()
    first = asyncio.ensure_future(captures.close("alice", key, gateways.close_there))
    second = asyncio.ensure_future(captures.close("alice", key, gateways.close_there))
    await asyncio.sleep(0)
    gateways.release.set()
    assert await first == await second == [{"model": "m", "key": "gw-m"}]
    assert gateways.closed == ["m"]


async def test_a_failed_close_leaves_the_capture_open_for_another_close():
    captures, gateways = ServerCaptures(max_open_per_tenant=4), Gateways()
    key = captures.open("alice")
    await captures.gateway_id("alice", key, "m", gateways.opener("m"))
    gateways.fail_next_close = True
    with pytest.raises(RuntimeError, match="did not answer"):
        await captures.close("alice", key, gateways.close_there)
    captures.check("alice", key)  # still open
    assert await captures.close("alice", key, gateways.close_there) == [{"model": "m", "key": "gw-m"}]


def test_a_tenants_oldest_capture_makes_room():
    captures = ServerCaptures(max_open_per_tenant=2)
    first, second = captures.open("alice"), captures.open("alice")
    bobs = captures.open("bob")
    captures.open("alice")
    with pytest.raises(CaptureNotFound):
        captures.check("alice", first)
    captures.check("alice", second)
    captures.check("bob", bobs)
