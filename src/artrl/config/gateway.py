"""The gateway, the clients of it, and the dashboard."""

from __future__ import annotations

from pydantic import Field, model_validator

from artrl.config.frozen import _Frozen


class GatewayConfig(_Frozen):
    """The OpenAI-compatible HTTP gateway.

    It listens on loopback by default. Bound anywhere else it needs an `api_key` (anyone who can reach the
    port could otherwise generate, read captures and change nothing less than the training data), unless
    `allow_unauthenticated=True` says that the network is trusted.
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
    startup_timeout_s: float = Field(default=60.0, gt=0)
    keep_alive_s: float = Field(
        default=75.0,
        gt=0,
        description="idle keep-alive connections are closed after this; it must exceed HTTP clients' own idle "
        "expiry (httpx: 5 s) or a request sent as the server closes the connection is lost",
    )
    max_request_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    in_process_clients: bool = Field(
        default=True,
        description="`model.openai_client()` reaches the gateway in its own process without a socket (the "
        "same routes, no TCP or HTTP parsing); False = over HTTP like any other client",
    )
    max_inflight_requests: int = Field(
        default=1024,
        ge=1,
        description="chat requests being prepared or generated at once; beyond, a 429 (clients retry later)",
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
    """`artrl dashboard PATH`: a local web page over the runs under PATH."""

    host: str = Field(default="127.0.0.1", description="loopback by default: the page shows trajectories")
    port: int = Field(default=8765, ge=0, le=65535)
    poll_interval_s: float = Field(default=3.0, gt=0, description="how often the page refreshes a live run")
    max_tokens_shown: int = Field(default=20_000, ge=1, description="tokens of one row sent to the page")
