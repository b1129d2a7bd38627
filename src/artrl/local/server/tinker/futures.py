"""Tinker calls answered through futures: a submit returns a request id at once, the call runs as a task, and
the client polls `retrieve_future`, which holds a poll up to `HOLD_S` (under the SDK's 45 s read timeout)
before it answers `try_again`, so no client spins. A resubmit of the same call (the SDK resends a submit
whose answer it lost, with the same `seq_id`) gets the same request id. Finished calls are kept for the
newest `KEEP` request ids a tenant made."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Hashable
from typing import Any

from fastapi.responses import JSONResponse, Response

log = logging.getLogger(__name__)

HOLD_S = 25.0
KEEP = 4096


class UserError(ValueError):
    """A call the client got wrong (reported as `category: user`: the SDK raises RequestFailedError)."""


class Futures:
    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s
        self._calls: OrderedDict[str, tuple[str, asyncio.Future]] = OrderedDict()  # id -> tenant, task
        self._by_key: dict[tuple[str, Hashable], str] = {}
        self._ids = itertools.count(1)

    def submit(self, tenant: str, call: Awaitable[Any], key: Hashable | None = None) -> str:
        """The request id of `call` (already running from now on); the same id again for the same key."""
        if key is not None:
            known = self._by_key.get((tenant, key))
            if known is not None and known in self._calls:
                if asyncio.iscoroutine(call):
                    call.close()  # (never started: the first submit's task is the call)
                return known
        task = asyncio.ensure_future(call)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (retrieved by the poll, or never)
        request_id = f"req-{next(self._ids)}"
        self._calls[request_id] = (tenant, task)
        if key is not None:
            self._by_key[(tenant, key)] = request_id
        self._forget_old()
        return request_id

    def known(self, tenant: str, key: Hashable) -> str | None:
        """The request id of the call submitted under `key`, if it is still kept."""
        request_id = self._by_key.get((tenant, key))
        return request_id if request_id in self._calls else None

    def task(self, request_id: str) -> asyncio.Future:
        return self._calls[request_id][1]

    async def retrieve(self, tenant: str, request_id: str) -> Response:
        found = self._calls.get(request_id)
        if found is None or found[0] != tenant:
            return JSONResponse(
                {"error": f"no call {request_id!r} (unknown, or forgotten)", "category": "user"},
                status_code=404,
            )
        task = found[1]
        await asyncio.wait([task], timeout=self.hold_s)
        if not task.done():
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        try:
            result = task.result()
        except UserError as exc:
            return JSONResponse({"error": str(exc), "category": "user"})
        except ValueError as exc:  # (bad input found while running: the client's)
            return JSONResponse({"error": str(exc), "category": "user"})
        except Exception as exc:
            log.exception("a Tinker call failed")
            return JSONResponse(
                {"error": f"{type(exc).__name__}: {exc} (see the server's log)", "category": "server"}
            )
        if isinstance(result, bytes):
            return Response(result, media_type="application/x-protobuf")
        return JSONResponse(result)

    def _forget_old(self) -> None:
        while len(self._calls) > KEEP:
            request_id, (_, task) = self._calls.popitem(last=False)
            if not task.done():  # (a running call stays: put it back at the end)
                self._calls[request_id] = (_, task)
                break
        alive = set(self._calls)
        for key in [k for k, v in self._by_key.items() if v not in alive]:
            del self._by_key[key]
