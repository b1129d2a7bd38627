"""Captures: named, bounded recordings of the chat completions served while a client's `artrl.capture` is open.

`POST /v1/captures` opens one; requests to `/capture/{id}/v1/...`, or with header `X-Artrl-Capture: {id}`,
are recorded into it; `DELETE /v1/captures/{id}` returns its records and forgets it. A record is the request's
messages and tools as received and the response's choices as the client got them (token ids included), in
completion order. All access happens on the gateway's event loop; a lock keeps the store safe regardless.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from artrl.local.gateway.protocol import RequestError

CAPTURE_HEADER = "x-artrl-capture"


@dataclass
class _Capture:
    records: list[dict[str, Any]] = field(default_factory=list)
    touched: float = field(default_factory=time.monotonic)


class CaptureStore:
    """Open captures by id. At most `max_open` at once (captures idle for `idle_expiry_s` are dropped to make
    room; checked whenever a capture opens); at most `max_records` records each (requests beyond are refused
    with a 413 before generating)."""

    def __init__(
        self, max_open: int = 4096, max_records: int = 10_000, idle_expiry_s: float = 3600.0
    ) -> None:
        self.max_open, self.max_records, self.idle_expiry_s = max_open, max_records, idle_expiry_s
        self._captures: dict[str, _Capture] = {}
        self._lock = threading.Lock()

    def open(self) -> str:
        with self._lock:
            # captures a client never closed (a crashed process, a base_url user) expire after idling
            now = time.monotonic()
            for key in [k for k, c in self._captures.items() if now - c.touched > self.idle_expiry_s]:
                del self._captures[key]
            if len(self._captures) >= self.max_open:
                raise RequestError(
                    f"{self.max_open} captures are open: close some (leave their `artrl.capture` blocks) first",
                    code="too_many_captures",
                    status=429,
                )
            capture_id = f"cap-{uuid.uuid4().hex}"
            self._captures[capture_id] = _Capture()
            return capture_id

    def _get(self, capture_id: str) -> _Capture:
        found = self._captures.get(capture_id)
        if found is None:
            raise RequestError(
                f"capture {capture_id!r} is not open on this gateway (never opened, already closed, or "
                "expired); open one with POST /v1/captures",
                param="capture",
                code="capture_not_found",
                status=404,
            )
        return found

    def check(self, capture_id: str) -> None:
        """Raise a 4xx now if a request for this capture could not be recorded."""
        with self._lock:
            capture = self._get(capture_id)
            capture.touched = time.monotonic()
            if len(capture.records) >= self.max_records:
                raise RequestError(
                    f"capture {capture_id!r} already holds {self.max_records} records, its limit",
                    param="capture",
                    code="capture_full",
                    status=413,  # permanent: clients must not retry it as they retry a 429
                )

    def add(self, capture_id: str, record: dict[str, Any]) -> None:
        """Append a finished call's record; a capture closed while the call ran does not get it."""
        with self._lock:
            capture = self._captures.get(capture_id)
            if capture is not None:
                capture.records.append(record)
                capture.touched = time.monotonic()

    def close(self, capture_id: str) -> list[dict[str, Any]]:
        with self._lock:
            records = self._get(capture_id).records
            del self._captures[capture_id]
            return records

    def __len__(self) -> int:
        return len(self._captures)
