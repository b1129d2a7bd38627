"""The gateway, the clients of it, and the dashboard."""

from __future__ import annotations

import os

from pydantic import Field, model_validator

from artrl.config.frozen import _Frozen


class GatewayConfig(_Frozen):
    """The OpenAI-compatible HTTP gateway.

    It listens on loopback by default. Bound anywhere else it needs an `api_key` (anyone who can reach the
    port could otherwise generate, read captures and change nothing less than the training data), unless
    `allow_unauthenticated=True` says that the network is trusted. Without a key it answers only requests
    whose `Host` is a loopback name or address, `host` itself or one of `allowed_hosts`: a web page whose own
    name its DNS turned into 127.0.0.1 (DNS rebinding) is refused.
    """

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="0 = a free port chosen at start")
    api_key: str | None = Field(
        default=None, min_length=1, description="if set, requests need `Authorization: Bearer <key>`"
    )
    allow_unauthenticated: bool = Field(
        default=False, description="serve on a non-loopback host without an api_key (a trusted network)"
    )
    completion_store_size: int = Field(
        default=20_000, ge=0, description="completions remembered for token-exact continuation (LRU)"
    )
    stored_responses: int = Field(
        default=1000, ge=0, description="Responses API: the last responses kept for `previous_response_id`"
    )
    stored_responses_bytes: int = Field(
        default=256 << 20,
        ge=1024,
        description="Responses API: bytes (as JSON) the kept responses hold at most; the oldest go first",
    )
    startup_timeout_s: float = Field(default=60.0, gt=0)
    keep_alive_s: float = Field(
        default=75.0,
        gt=0,
        description="idle keep-alive connections are closed after this; it must exceed HTTP clients' own idle "
        "expiry (httpx: 5 s) or a request sent as the server closes the connection is lost",
    )
    max_request_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    max_json_depth: int = Field(
        default=64,
        ge=8,
        le=128,
        description="arrays and objects nested in a request body (and in the JSON of a tool call's arguments); "
        "deeper is a 400 before anything parses it (a real request needs a dozen or two)",
    )
    allowed_hosts: tuple[str, ...] = Field(
        default=(),
        description="`Host` names accepted besides loopback names and addresses and `host` itself ('*': any), "
        "checked while no api_key is set (a page that rebinds its name cannot send the key)",
    )
    in_process_clients: bool = Field(
        default=True,
        description="`model.openai_client()` reaches the gateway in its own process without a socket (the "
        "same routes, no TCP or HTTP parsing); False = over HTTP like any other client",
    )
    freeze_startup_heap: bool = Field(
        default=True,
        description="while the gateway serves, the objects its process held when it started (modules, tokenizer, "
        "the model's Python objects) are left out of Python's full garbage collections (gc.freeze(), undone "
        "when the process's last gateway stops): ~0.6 ms of CPU a call less on the vLLM path. Those objects "
        "are still freed when nothing refers to them; only reference cycles among them wait for the stop",
    )
    max_inflight_requests: int = Field(
        default=1024,
        ge=1,
        description="chat requests being prepared or generated at once; beyond, a 429 (clients retry later)",
    )
    max_preparing_bytes: int = Field(
        default=128 << 20,
        ge=1024,
        description="bytes of request bodies read and waiting for, or in, preparation at once (more: a 429)",
    )
    body_read_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="a request's body arrives whole within this (else a 408), so stalled uploads do not "
        "hold the in-flight slots",
    )
    max_open_captures: int = Field(default=4096, ge=1, description="`artrl.capture` blocks open at once")
    max_capture_records: int = Field(default=10_000, ge=1, description="calls recorded by one capture")
    max_capture_bytes: int = Field(
        default=256 << 20, ge=1024, description="bytes (as JSON) one capture holds"
    )
    max_captured_bytes: int = Field(default=2 << 30, ge=1024, description="bytes all open captures hold")
    capture_idle_expiry_s: float = Field(
        default=3600.0,
        ge=0,
        description="a capture nobody used for this long is dropped (a client that died)",
    )
    capture_close_grace_s: float = Field(
        default=120.0,
        ge=0,
        description="a closed capture's records stay this long (a close reply that was lost)",
    )

    @model_validator(mode="after")
    def _key_beyond_loopback(self) -> GatewayConfig:
        if not is_loopback(self.host) and self.api_key is None and not self.allow_unauthenticated:
            raise ValueError(
                f"GatewayConfig(host={self.host!r}) would serve on the network without a key: set "
                "api_key='...' (clients send it as a Bearer token), or allow_unauthenticated=True on a "
                "trusted network"
            )
        return self


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ClientConfig(_Frozen):
    """How `TrainableModel.openai_client()` talks to the gateway."""

    timeout_s: float = Field(default=600.0, gt=0)
    max_retries: int = Field(default=2, ge=0)


class DashboardConfig(_Frozen):
    """`artrl dashboard PATH`: a local web page over the runs under PATH.

    Like the gateway, it listens on loopback by default, refuses to listen anywhere else without an `api_key`
    (the page then sends it: open it as `http://HOST:PORT/#curves?key=KEY`) unless `allow_unauthenticated=True`,
    and without a key answers only a loopback name or address, `host` or one of `allowed_hosts` as `Host`.
    """

    host: str = Field(default="127.0.0.1", description="loopback by default: the page shows trajectories")
    port: int = Field(default=8765, ge=0, le=65535)
    api_key: str | None = Field(
        default_factory=lambda: os.environ.get("ARTRL_DASHBOARD_KEY") or None,
        min_length=1,
        description="if set, the page's API needs it (`Authorization: Bearer <key>`); default: "
        "$ARTRL_DASHBOARD_KEY (an environment variable: a command line shows in `ps`)",
    )
    allow_unauthenticated: bool = Field(
        default=False, description="serve on a non-loopback host without an api_key (a trusted network)"
    )
    allowed_hosts: tuple[str, ...] = Field(
        default=(),
        description="`Host` names accepted besides loopback and `host` ('*': any), as the gateway's",
    )
    poll_interval_s: float = Field(default=3.0, gt=0, description="how often the page refreshes a live run")
    max_tokens_shown: int = Field(default=20_000, ge=1, description="tokens of one row sent to the page")

    @model_validator(mode="after")
    def _key_beyond_loopback(self) -> DashboardConfig:
        if not is_loopback(self.host) and self.api_key is None and not self.allow_unauthenticated:
            raise ValueError(
                f"DashboardConfig(host={self.host!r}) would show the runs' trajectories to the network without "
                "a key: set api_key='...' (or $ARTRL_DASHBOARD_KEY; open the page as "
                "http://HOST:PORT/#curves?key=KEY), or allow_unauthenticated=True on a trusted network"
            )
        return self
