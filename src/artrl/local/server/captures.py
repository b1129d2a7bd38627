"""Capture blocks (`artrl.capture`) through the training server. The client opens a capture on the server
(`POST /v1/captures`); the first request of the block to one of the tenant's models opens a capture on that
model's own gateway, and the block's requests to that model go on recorded there (the gateway's capture id
in their header). Closing the server's capture closes the gateways' captures and returns their records,
model by model in the order the block first called them. A tenant sees only its own captures (another
tenant's id is not found); at most `ServerConfig.max_open_captures` a tenant (beyond: its oldest dropped,
and its gateways' captures expire there by themselves); a closed capture's records stay a while for a
client whose close reply was lost."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

CLOSED_GRACE_S = 120.0  # a closed capture's records, for a close asked again


class CaptureNotFound(LookupError):
    """No open capture of this id for this tenant."""


@dataclass
class _Open:
    tenant: str
    models: dict[str, asyncio.Future] = field(default_factory=dict)  # model name -> its gateway's capture id


class ServerCaptures:
    def __init__(self, max_open_per_tenant: int) -> None:
        self.max_open = max_open_per_tenant
        self._open: OrderedDict[str, _Open] = OrderedDict()  # oldest first
        self._closed: dict[str, tuple[str, list[dict[str, Any]], float]] = {}  # id -> tenant, records, when
        self._closing: dict[str, asyncio.Future] = {}  # id -> its records (a second close waits for them)

    def open(self, tenant: str) -> str:
        self._forget_old_closed()
        mine = [key for key, capture in self._open.items() if capture.tenant == tenant]
        for key in mine[: max(0, len(mine) + 1 - self.max_open)]:
            del self._open[key]
        key = f"srv-{secrets.token_urlsafe(16)}"
        self._open[key] = _Open(tenant)
        return key

    def check(self, tenant: str, key: str) -> None:
        capture = self._open.get(key)
        if capture is None or capture.tenant != tenant:
            raise CaptureNotFound(f"no open capture {key!r} (closed, expired, or never opened)")

    async def gateway_id(
        self, tenant: str, key: str, model: str, open_there: Callable[[], Awaitable[str]]
    ) -> str:
        """The id of the capture on `model`'s gateway for the server's capture `key` (opened there once)."""
        self.check(tenant, key)
        capture = self._open[key]
        pending = capture.models.get(model)
        if pending is None:
            pending = capture.models[model] = asyncio.ensure_future(open_there())
        try:
            return await asyncio.shield(pending)
        except Exception:
            if capture.models.get(model) is pending:  # (a later request of the block tries again)
                del capture.models[model]
            raise

    async def close(
        self,
        tenant: str,
        key: str,
        close_there: Callable[[str, str], Awaitable[list[dict[str, Any]]]],
    ) -> list[dict[str, Any]]:
        """Every record of the block, model by model; the same again for a close asked again (meanwhile, or a
        while after). A close that fails leaves the capture open: asked again, it closes it (a gateway asked
        again for a capture it closed answers its records again)."""
        self._forget_old_closed()
        closed = self._closed.get(key)
        if closed is not None and closed[0] == tenant:
            return closed[1]
        self.check(tenant, key)
        closing = self._closing.get(key)
        if closing is None:
            closing = self._closing[key] = asyncio.ensure_future(self._close(key, close_there))
        return await asyncio.shield(closing)

    async def _close(
        self, key: str, close_there: Callable[[str, str], Awaitable[list[dict[str, Any]]]]
    ) -> list[dict[str, Any]]:
        capture = self._open[key]
        try:
            records: list[dict[str, Any]] = []
            for model, pending in capture.models.items():
                try:
                    gateway_key = await pending
                except Exception:  # (never opened there: nothing recorded)
                    continue
                records += await close_there(model, gateway_key)
        finally:
            del self._closing[key]
        del self._open[key]
        self._closed[key] = (capture.tenant, records, time.monotonic())
        return records

    def _forget_old_closed(self) -> None:
        now = time.monotonic()
        for key in [k for k, (_, _, when) in self._closed.items() if now - when > CLOSED_GRACE_S]:
            del self._closed[key]
