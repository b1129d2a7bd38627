"""Tinker sessions: a key's `ServiceClient` opens one, its heartbeats (every 10 s) keep it, and it ends with
`close()` (`/sessions/{id}/finish`) or when nothing was heard of it for `timeout_s`; its training clients are
then unloaded (their run folders, checkpoints and history stay: a new client loads a saved state)."""

from __future__ import annotations

import secrets
import time

from artrl.local.server.tinker.futures import UserError


class Sessions:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._tenant: dict[str, str] = {}  # session id -> tenant
        self._heard: dict[str, float] = {}  # session id -> when it was last heard of (time.monotonic())

    def create(self, tenant: str) -> str:
        session = f"sess-{secrets.token_hex(6)}"
        self._tenant[session] = tenant
        self._heard[session] = time.monotonic()
        return session

    def check(self, tenant: str, session: str) -> None:
        """UserError unless `session` is the tenant's and open; it is heard of now."""
        if self._tenant.get(session) != tenant:
            raise UserError(f"no open session {session!r} of this key (create_session first)")
        self._heard[session] = time.monotonic()

    def end(self, session: str) -> None:
        self._tenant.pop(session, None)
        self._heard.pop(session, None)

    def silent(self) -> list[str]:
        """The open sessions not heard of for `timeout_s` (their clients stopped without closing)."""
        limit = time.monotonic() - self.timeout_s
        return [session for session, heard in self._heard.items() if heard < limit]
