"""Captures: named, bounded recordings of the chat completions served while a client's `artrl.capture` is open.

`POST /v1/captures` opens one; requests to `/capture/{id}/v1/...`, or with header `X-Artrl-Capture: {id}`,
are recorded into it; `DELETE /v1/captures/{id}` returns its records and forgets it. A record is the request's
messages and tools as received and the response's choices as the client got them (token ids included), in
completion order. All access happens on the gateway's event loop; a lock keeps the store safe regardless.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from artrl.config import GatewayConfig
from artrl.local.gateway.protocol import RequestError
from artrl.random_ids import random_hex


@dataclass
class _Capture:
    records: list[dict[str, Any]] = field(default_factory=list)
    touched: float = field(default_factory=time.monotonic)
    size: int = 0  # bytes of its records as JSON
    closed: bool = False


class CaptureStore:
    """Open captures by id. At most `max_open` at once (captures idle for `idle_expiry_s` are dropped to make
    room; checked whenever a capture opens); at most `max_records` records and `max_bytes` bytes (as JSON)
    each, `max_total_bytes` in all (a request beyond is refused with a 413 before generating). A closed
    capture's records stay `closed_grace_s` seconds for a client whose close reply was lost to ask again."""

    def __init__(self, config: GatewayConfig) -> None:
        self.max_open, self.max_records = config.max_open_captures, config.max_capture_records
        self.max_bytes, self.max_total_bytes = config.max_capture_bytes, config.max_captured_bytes
        self.idle_expiry_s, self.closed_grace_s = config.capture_idle_expiry_s, config.capture_close_grace_s
        self._captures: dict[str, _Capture] = {}
        self._total = 0
        self._lock = threading.Lock()

    def _expire(self) -> None:
        now = time.monotonic()
        for key, capture in list(self._captures.items()):
            limit = self.closed_grace_s if capture.closed else self.idle_expiry_s
            if now - capture.touched > limit:
                self._total -= capture.size
                del self._captures[key]

    def open(self) -> str:
        with self._lock:
            # captures a client never closed (a crashed process, a base_url user) expire after idling
            self._expire()
            if sum(not c.closed for c in self._captures.values()) >= self.max_open:
                raise RequestError(
                    f"{self.max_open} captures are open: close some (leave their `artrl.capture` blocks) first",
                    code="too_many_captures",
                    status=429,
                )
            capture_id = f"cap-{random_hex()}"
            self._captures[capture_id] = _Capture()
            return capture_id

    def _get(self, capture_id: str) -> _Capture:
        found = self._captures.get(capture_id)
        if found is None or found.closed:
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
            full = None
            if len(capture.records) >= self.max_records:
                full = f"already holds {self.max_records} records, its limit"
            elif capture.size >= self.max_bytes:
                full = f"already holds {capture.size} bytes of records, its limit is {self.max_bytes}"
            elif self._total >= self.max_total_bytes:
                full = f"cannot grow: open captures hold {self._total} bytes, the gateway's limit"
            if full is not None:
                raise RequestError(
                    f"capture {capture_id!r} {full}; close it (leave the `artrl.capture` block) and open another",
                    param="capture",
                    code="capture_full",
                    status=413,  # permanent: clients must not retry it as they retry a 429
                )

    def add(self, capture_id: str, record: dict[str, Any]) -> None:
        """Append a finished call's record; a capture closed while the call ran does not get it."""
        size = len(json.dumps(record, ensure_ascii=False))
        with self._lock:
            capture = self._captures.get(capture_id)
            if capture is not None and not capture.closed:
                capture.records.append(record)
                capture.size += size
                self._total += size
                capture.touched = time.monotonic()

    def close(self, capture_id: str) -> list[dict[str, Any]]:
        """The capture's records. It stops recording at once; its records stay `closed_grace_s` seconds, so
        a client whose reply was lost (a dropped connection) gets them again by closing it again."""
        with self._lock:
            capture = self._captures.get(capture_id)
            if capture is None:
                self._get(capture_id)  # raises the 404
            assert capture is not None
            capture.closed = True
            capture.touched = time.monotonic()
            return capture.records

    @property
    def total_bytes(self) -> int:
        return self._total

    def __len__(self) -> int:
        return sum(not c.closed for c in self._captures.values())
