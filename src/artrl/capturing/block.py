"""`artrl.capture(model)`: record every call agent code makes to the served model inside a block, unchanged.

    async with artrl.capture(model) as cap:
        await run_agent(model.openai_client())          # or any client given cap.base_url
    cap.trajectory.reward = score(...)

Calls are recorded by the gateway (exact token ids included), not by patching anything here:
- a client from `model.openai_client()` / `model.openai_sync_client()` carries an httpx request hook that
  adds `X-Artrl-Capture: <id>` while a capture of that gateway is active in the current context (a
  ContextVar: per asyncio task, copied into `asyncio.to_thread`), so concurrent captures never mix;
- any other client (any language) sends its requests to `cap.base_url` (`.../capture/<id>/v1`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from artrl.capturing.histories import trajectory_from_records
from artrl.trajectory import Trajectory

if TYPE_CHECKING:
    import openai

log = logging.getLogger(__name__)


class ServedModel(Protocol):
    """What a capture needs of a model (a `TrainableModel` is one): where its gateway is, and the key."""

    @property
    def inference_base_url(self) -> str: ...

    @property
    def inference_api_key(self) -> str: ...


CAPTURE_HEADER = "X-Artrl-Capture"

# the captures open in this context, innermost last
_active: contextvars.ContextVar[tuple[Capture, ...]] = contextvars.ContextVar("artrl_capture", default=())


class CaptureError(RuntimeError):
    """The gateway refused to open or close a capture, or could not be reached to do it."""


TRIES = 3  # of opening or closing a capture, when the request gets no answer (a timeout, a lost connection)
_NO_ANSWER = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


class Capture:
    """One open capture. `trajectory` is filled when the `artrl.capture` block exits; set its reward then."""

    def __init__(self, capture_id: str, gateway_url: str, api_key: str) -> None:
        self.id = capture_id
        self.gateway_url = gateway_url  # the model's inference base URL, ".../v1"
        self.api_key = api_key
        self.records: list[dict[str, Any]] = []
        self.trajectory = Trajectory()

    @property
    def base_url(self) -> str:
        """An OpenAI base URL that records into this capture, for code that only takes a base URL."""
        return f"{self.gateway_url.removesuffix('/v1')}/capture/{self.id}/v1"

    def openai_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        """A new `openai.AsyncOpenAI` on `base_url` (keyword arguments override the defaults)."""
        import openai

        return openai.AsyncOpenAI(**{"base_url": self.base_url, "api_key": self.api_key, **kwargs})

    def __repr__(self) -> str:
        return f"Capture(id={self.id!r}, records={len(self.records)})"


def active_capture(url: str) -> Capture | None:
    """The innermost capture open in this context on the gateway that serves `url`, if any."""
    for capture in reversed(_active.get()):
        if url.startswith(capture.gateway_url):
            return capture
    return None


def _tag(request: httpx.Request) -> None:
    capture = active_capture(str(request.url))
    if capture is not None and CAPTURE_HEADER not in request.headers:
        request.headers[CAPTURE_HEADER] = capture.id


async def tag_request_async(request: httpx.Request) -> None:
    """httpx request hook (AsyncClient): add the capture header inside an `artrl.capture` block."""
    _tag(request)


def tag_request(request: httpx.Request) -> None:
    """httpx request hook (Client): add the capture header inside an `artrl.capture` block."""
    _tag(request)


def needs_tls(url: str) -> bool:
    """httpx's `verify` for a gateway URL: a plain-http gateway (the local default) needs no TLS, and
    skipping the CA bundle saves ~65 ms per httpx client."""
    return not str(url).startswith("http://")


def _check(response: httpx.Response, action: str) -> dict[str, Any]:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:500]
        raise CaptureError(f"could not {action}: HTTP {response.status_code}: {message}")
    return response.json()


async def _ask(http: httpx.AsyncClient, method: str, url: str, action: str) -> dict[str, Any]:
    """The gateway's answer to one capture request, asked up to TRIES times while no answer comes back.

    Both requests are safe to repeat: opening again leaves at most an unused capture, which the gateway
    drops once it idles; closing again returns the same records (the gateway keeps a closed capture's
    records for a grace period for exactly this). An answer that refuses (HTTP 4xx/5xx) is not retried."""
    attempt = 1
    while True:
        try:
            return _check(await http.request(method, url), action)
        except _NO_ANSWER as exc:
            if attempt == TRIES:
                raise CaptureError(
                    f"could not {action}: no answer from the gateway at {url} after {TRIES} tries "
                    f"({type(exc).__name__}{': ' + str(exc) if str(exc) else ''}); is it running and "
                    "reachable? (`timeout` of artrl.capture bounds each try)"
                ) from exc
        log.warning("no answer from the gateway to %s (%s %s): asking again", action, method, url)
        await asyncio.sleep(0.2 * 2**attempt)
        attempt += 1


@asynccontextmanager
async def capture(model: ServedModel, *, timeout: float = 30.0) -> AsyncIterator[Capture]:
    """Record the calls made to `model`'s gateway inside the block (see this module's docstring).

    On exit, `Capture.trajectory` holds the main conversation (`messages_and_choices`, `tools`) and, as
    `additional_histories`, the calls that did not continue it (sub-agents, summaries), all with exact token
    ids; calls still running when the block exits are not recorded. `timeout` bounds each try of opening and
    of closing (tried up to TRIES times when no answer comes back).
    """
    gateway_url = model.inference_base_url.rstrip("/")
    api_key = model.inference_api_key
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(timeout=timeout, headers=headers, verify=needs_tls(gateway_url)) as http:
        opened = await _ask(http, "POST", f"{gateway_url}/captures", "open a capture")
        cap = Capture(opened["id"], gateway_url, api_key)
        token = _active.set((*_active.get(), cap))
        failed = True
        try:
            yield cap
            failed = False
        finally:
            _active.reset(token)
            try:
                closed = await _ask(http, "DELETE", f"{gateway_url}/captures/{cap.id}", f"close {cap.id}")
            except Exception:
                if not failed:
                    raise
                closed = {"records": []}  # the block's own exception is the one to report
            cap.records = closed["records"]
            cap.trajectory = trajectory_from_records(cap.records)
