"""The training server (`artrl server`) and its client (`artrl.RemoteBackend`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from artrl.config.frozen import _Frozen
from artrl.config.gateway import is_loopback


class ServerConfig(_Frozen):
    """`artrl server BASE_MODEL`: one base model, many tenants' trainable models on it, over HTTP.

    Without `keys` (a file of `TENANT KEY` lines) every caller is the tenant `default` and the server listens
    on loopback only; bound anywhere else it needs keys.
    """

    base_model: str
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    path: str = Field(default=".artrl-server", description="run folders: {path}/{tenant}/{project}/{model}")
    keys: str | None = Field(default=None, description="file of `TENANT KEY` lines; tenant `admin` sees all")
    max_models_per_tenant: int = Field(default=8, ge=1)
    max_request_bytes: int = Field(
        default=256 * 2**20, ge=1024, description="a training call's JSON body (trajectories) at most"
    )
    body_read_timeout_s: float = Field(
        default=300.0, gt=0, description="a request's body arrives whole within this (else a 408)"
    )
    remembered_results: int = Field(
        default=1024,
        ge=1,
        description="finished training calls' answers kept per tenant by request id (resends)",
    )
    max_concurrent_requests: int = Field(
        default=256,
        ge=1,
        description="a tenant's generation requests (chat, Responses, Messages) at once (more: 429)",
    )
    max_queued_calls: int = Field(
        default=16, ge=1, description="a tenant's training calls waiting or running at once (more: 429)"
    )
    sampler_adapters: int = Field(
        default=8,
        ge=1,
        description="saved weights that Tinker sampling clients sample, loaded at once (more: the one sampled "
        "longest ago is unloaded, and loaded again at its next use)",
    )
    tinker_session_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="a Tinker session not heard of for this long (no heartbeat: its client stopped) ends, and "
        "its training clients are unloaded (their run folders stay)",
    )
    max_open_captures: int = Field(
        default=256,
        ge=1,
        description="a tenant's `artrl.capture` blocks open at once (more: its oldest dropped)",
    )

    @model_validator(mode="after")
    def _keys_beyond_loopback(self) -> ServerConfig:
        if not is_loopback(self.host) and self.keys is None:
            raise ValueError(
                f"`artrl server --host {self.host}` would let anyone who reaches the port train and generate: "
                "give --keys FILE (one `TENANT KEY` line per tenant)"
            )
        return self


class RemoteConfig(_Frozen):
    """How `artrl.RemoteBackend` talks to a training server."""

    timeout_s: float = Field(default=30.0, gt=0, description="connect and ordinary calls")
    train_timeout_s: float = Field(
        default=3600.0, gt=0, description="one train / train_sft call, queue included"
    )
    retries: int = Field(
        default=3, ge=0, description="resends of a call whose connection broke (same request id: done once)"
    )
    progress: bool | None = Field(
        default=None,
        description="a live bar of each train / train_sft call on stderr; None: when stderr is a terminal "
        "(or $ARTRL_PROGRESS=1)",
    )
