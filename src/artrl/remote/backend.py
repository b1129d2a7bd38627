"""`artrl.RemoteBackend`: the client API of `LocalBackend` against a training server (`artrl server`) on
another machine — `model.register(RemoteBackend(url, api_key=...))` and the rest of the script is unchanged.

The model is served by the server's one OpenAI-compatible gateway (`{url}/v1`, the tenant's key as the API
key); `train` sends the trajectories with the token ids the gateway recorded in their choices. Every call has
a timeout; a call whose connection broke is sent again with the same request id, which the server answers
from its first run: a retried `train` never trains twice. `train` and `train_sft` stream the call's progress
(queued behind other models' steps, rows trained, saving) as a live bar, a line at least every few seconds:
a dead server or connection is noticed within `RemoteConfig.timeout_s`, however long the call."""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
import uuid
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from artrl.art_names import train_config
from artrl.config import CheckpointRetention, RemoteConfig, SFTConfig, TrainConfig
from artrl.log_handler import ensure_log_handler
from artrl.model import TrainableModel, TrainResult, config_json
from artrl.progress_bar import CallBar, progress_shown
from artrl.trajectory import Trajectory, TrajectoryGroup

T = TypeVar("T")
STREAM_MIN_TIMEOUT_S = 15.0  # a streamed call's wait between two lines, at least (the server: one every 5 s)
SPEC_FIELDS = {"name", "project", "base_model", "lora", "chat_format"}


class RemoteError(RuntimeError):
    """The training server refused a call (its message says why) or could not be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RemoteBackend:
    def __init__(self, url: str, *, api_key: str | None = None, config: RemoteConfig | None = None) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key or os.environ.get("ARTRL_API_KEY")
        self.config = config or RemoteConfig()
        ensure_log_handler()

    async def __aenter__(self) -> RemoteBackend:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Nothing to stop here: the models stay served (and trained) by the server."""

    async def register(self, model: TrainableModel) -> tuple[str, str]:
        if model.report_to:
            raise ValueError(
                "report_to= sends history rows from where the model trains; with a RemoteBackend that is the "
                "server: read its run folders there (`artrl history`, `artrl dashboard`), or log rows here"
            )
        spec = model.model_dump(mode="json", include=SPEC_FIELDS)
        spec["config"] = config_json(model.config)  # (the user's own settings: the server's model.json)
        await self._call("POST", "/artrl/v1/models", spec)
        return f"{self.url}/v1", self.api_key or "artrl"

    def client_transport(self, model: TrainableModel, sync: bool = False, httpx: Any = None) -> None:
        return None  # (over the network: no in-process transport)

    async def get_step(self, model: TrainableModel) -> int:
        return int((await self._call("GET", f"/artrl/v1/models/{model.name}/step"))["step"])

    async def train(
        self,
        model: TrainableModel,
        groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None = None,
        **art_settings: Any,
    ) -> TrainResult:
        if art_settings or config is None:
            config = train_config(config, art_settings)
        body = {
            "groups": [g.model_dump(mode="json") for g in groups],
            "config": config.model_dump(mode="json"),
        }
        return TrainResult.model_validate(
            await self._model_call(model, "train", body, long=True, stream=True)
        )

    async def train_sft(
        self, model: TrainableModel, trajectories: list[Trajectory], config: SFTConfig
    ) -> TrainResult:
        if not trajectories:
            raise ValueError("train_sft() got no trajectories")
        body = {
            "trajectories": [t.model_dump(mode="json") for t in trajectories],
            "config": config.model_dump(),
        }
        return TrainResult.model_validate(
            await self._model_call(model, "train_sft", body, long=True, stream=True)
        )

    async def log(
        self,
        model: TrainableModel,
        groups: list[TrajectoryGroup],
        split: str,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        body = {"groups": [g.model_dump(mode="json") for g in groups], "split": split, "metrics": metrics}
        return await self._model_call(model, "log", {**body, "step": step})

    async def delete_checkpoints(self, model: TrainableModel, retention: CheckpointRetention) -> list[int]:
        return await self._model_call(model, "delete_checkpoints", {"retention": retention.model_dump()})

    async def export(self, model: TrainableModel, directory: str | os.PathLike[str]) -> None:
        """The current weights and tokenizer as a Hugging Face folder in `directory` (here, not on the server)."""
        data = await self._call("POST", f"/artrl/v1/models/{model.name}/export", {}, raw=True, long=True)
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(target, filter="data")  # (no absolute paths, links out, or devices)

    async def _model_call(
        self, model: TrainableModel, call: str, body: dict[str, Any], long: bool = False, stream: bool = False
    ) -> Any:
        body = {**body, "request_id": uuid.uuid4().hex}  # (one id for every resend of this call)
        path = f"/artrl/v1/models/{model.name}/{call}"
        if stream:
            try:
                async with asyncio.timeout(self.config.train_timeout_s):
                    return await self._streamed(path, {**body, "stream": True}, f"{model.name} {call}")
            except TimeoutError:
                raise RemoteError(
                    f"{call} of {model.name!r} did not finish within {self.config.train_timeout_s:g} s "
                    "(RemoteConfig.train_timeout_s); the server may still finish it: get_step() says"
                ) from None
        return (await self._call("POST", path, body, long=long))["result"]

    async def _streamed(self, path: str, body: dict[str, Any], label: str) -> Any:
        """A call whose answer is NDJSON lines (progress, then its result or its error), shown as a bar; sent
        again with the same request id when the connection breaks (the server streams the same call on)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # (between two lines: the server sends one every 5 s at least)
        timeout = httpx.Timeout(max(self.config.timeout_s, STREAM_MIN_TIMEOUT_S))
        bar = CallBar(label, progress_shown(self.config.progress))

        async def once() -> Any:
            async with (
                httpx.AsyncClient(timeout=timeout, headers=headers) as http,
                http.stream("POST", f"{self.url}{path}", json=body) as response,
            ):
                if response.status_code >= 400:
                    await response.aread()
                    _raise_refusal(path, response.status_code, _message(response))
                async for line in response.aiter_lines():
                    message = _parsed(line)
                    if "progress" in message:
                        bar.show(message["progress"])
                    elif "error" in message:
                        error = message["error"]
                        _raise_refusal(path, int(error.get("status", 500)), str(error.get("message")))
                    elif "result" in message:
                        return message["result"]
            raise httpx.RemoteProtocolError("the answer ended before the call's result")

        try:
            return await self._resent("POST", path, once)
        finally:
            bar.close()

    async def _resent(self, method: str, path: str, send: Callable[[], Awaitable[T]]) -> T:
        """`send()`, sent again (up to RemoteConfig.retries times, backing off) while no answer comes back:
        a timeout or a broken connection (the server may still be working: the same request id is answered
        from its first run)."""
        for attempt in range(self.config.retries + 1):
            try:
                return await send()
            except httpx.TransportError as exc:
                if attempt == self.config.retries:
                    raise RemoteError(
                        f"the training server at {self.url} did not answer {method} {path} "
                        f"({type(exc).__name__}: {exc}; tried {attempt + 1} times)"
                    ) from exc
                await asyncio.sleep(min(2.0**attempt, 10.0))
        raise AssertionError("unreachable")

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        raw: bool = False,
        long: bool = False,
    ) -> Any:
        read = self.config.train_timeout_s if long else self.config.timeout_s
        timeout = httpx.Timeout(read, connect=self.config.timeout_s)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

        async def once() -> httpx.Response:
            async with httpx.AsyncClient(timeout=timeout, headers=headers) as http:
                return await http.request(method, f"{self.url}{path}", json=body)

        response = await self._resent(method, path, once)
        if response.status_code >= 400:
            _raise_refusal(path, response.status_code, _message(response))
        return response.content if raw else response.json()


def _parsed(line: str) -> dict[str, Any]:
    """One line of a streamed answer ({} for a blank one); a garbled line is a broken connection (resent)."""
    if not line.strip():
        return {}
    try:
        message = json.loads(line)
    except ValueError:
        raise httpx.RemoteProtocolError(f"a garbled line in the answer: {line[:200]!r}") from None
    if not isinstance(message, dict):
        raise httpx.RemoteProtocolError(f"a garbled line in the answer: {line[:200]!r}")
    return message


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


def _raise_refusal(path: str, status: int, message: str) -> None:
    """Bad input as ValueError (as a LocalBackend raises it), anything else as RemoteError."""
    if status in (400, 422):
        raise ValueError(f"the training server refused {path}: {message}")
    raise RemoteError(f"the training server answered {status}: {message}", status)
