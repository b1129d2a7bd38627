"""What every request to the gateway, and to the dashboard, passes before any route sees it: a pure ASGI
middleware (a Starlette `BaseHTTPMiddleware` would hide client disconnects from the routes), in this order:

- the `Host` header of a request from the network (not from an in-process client), while no key is set: a
  loopback name or address, the host the server was bound to, or one the config allows. A web page whose name its DNS turns into 127.0.0.1 (DNS rebinding) reaches a local
  server as a same-origin page, but it sends its own name as Host, and is refused (421). With a key the
  key decides: such a page cannot send it;
- the key, when one is set, on the routes it protects (as a bearer token or, as Anthropic's clients send it,
  `x-api-key`), checked before the body is read;
- (the gateway) what a web page can send to another site without asking first never changes anything: a
  POST must declare `Content-Type: application/json`, or, without a body (opening a capture), carry a header
  that a browser only sends cross-site after a preflight the gateway never grants (`Authorization`,
  `x-api-key`, `X-Artrl-Capture`; artrl's own capture client sends its key as `Authorization`). A form or a
  text/plain POST, or an empty one, gets a 415. (Other methods than GET, HEAD and POST always need a
  preflight, so a DELETE cannot come from another site.)
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import JSONResponse

from artrl.capturing.block import CAPTURE_HEADER
from artrl.local.gateway.in_process import IN_PROCESS

# headers a browser sends to another site only after a CORS preflight (which nothing here answers)
_PREFLIGHTED = ("authorization", "x-api-key", CAPTURE_HEADER.lower())
# body types a web page cannot send another site without a CORS preflight (the Tinker SDK's protobuf too)
_PREFLIGHTED_TYPES = ("application/json", "application/x-protobuf")
_WILDCARDS = ("0.0.0.0", "::", "")


class TrustedHosts:
    """Which `Host` headers a server bound to `bind_host` answers (see the module docstring): loopback names
    (`localhost`, `*.localhost`) and addresses, `bind_host`, the `allowed` names ('*': any); bound to every
    interface, any address and this machine's name too. An address is never a rebound name."""

    def __init__(self, bind_host: str, allowed: tuple[str, ...] = ()) -> None:
        self.any = "*" in allowed
        self.wildcard = bind_host.strip("[]") in _WILDCARDS
        names = {bind_host, "localhost", *allowed}
        if self.wildcard:
            names.add(socket.gethostname())
        self.names = {_normal(n) for n in names}

    def __call__(self, host: str | None) -> bool:
        if self.any or host is None:  # (no Host at all: HTTP/1.0 from a program; a browser always sends one)
            return True
        name = _normal(_without_port(host))
        if name in self.names or name.endswith(".localhost"):
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return False
        return address.is_loopback or self.wildcard


def _without_port(host: str) -> str:
    if host.startswith("["):  # [::1]:8000
        return host[1 : host.find("]")] if "]" in host else host
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() and ":" not in name else host


def _normal(name: str) -> str:
    return name.strip().strip("[]").rstrip(".").lower()


@dataclass(frozen=True)
class Rules:
    """What a Guard checks. `refuse(status, message, code)` writes a refusal in the server's error format."""

    hosts: TrustedHosts
    refuse: Callable[[int, str, str], JSONResponse]
    api_key: str | None = None
    keyed_paths: tuple[str, ...] = ()  # path prefixes the key protects
    json_posts: bool = False  # a POST must be JSON, or bodiless with a preflighted header


class Guard:
    def __init__(self, app, rules: Rules) -> None:
        self.app, self.rules = app, rules

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> JSONResponse | None:
        rules = self.rules
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        from_network = IN_PROCESS not in scope.get("extensions", {})  # (a client in this process: trusted)
        if rules.api_key is None and from_network and not rules.hosts(headers.get("host")):
            return rules.refuse(
                421,
                f"this server does not answer for Host {headers['host'][:100]!r} (a web page reaching a local "
                "server through its own DNS name is refused); add the name to the config's allowed_hosts",
                "untrusted_host",
            )
        if rules.api_key is not None and path.startswith(rules.keyed_paths):
            scheme, _, given = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
                given = headers.get("x-api-key", "")
            if not given or not hmac.compare_digest(given.encode(), rules.api_key.encode()):
                return rules.refuse(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                    "invalid_api_key",
                )
        if rules.json_posts and scope["method"] in ("POST", "PUT", "PATCH"):
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
            if kind not in _PREFLIGHTED_TYPES and (
                kind
                or has_body
                or path.endswith("/chat/completions")
                or not any(map(headers.get, _PREFLIGHTED))
            ):
                return rules.refuse(
                    415,
                    f"Content-Type must be application/json (got {kind or 'none'}); a request without a body "
                    "may instead send 'Authorization' (what a web page sends to another site without asking "
                    "first never reaches the gateway)",
                    "unsupported_media_type",
                )
        return None
