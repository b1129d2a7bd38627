"""vLLM's token-in/token-out on the wire: the request body for exact prompt ids, and one streamed response
read into the gateway's sequence streams (sampled ids with their logprobs). Two wires (VLLMConfig.wire):

- `generate`: vLLM's `/inference/v1/generate` (a server started with `--enable-scale-out`, as artrl starts
  it): ids in, ids and logprobs out as integers, nothing detokenized on vLLM's side;
- `completions`: `/v1/completions` with a prompt of ids (any vLLM server, e.g. one at VLLMConfig.url): vLLM
  also writes each token's text, and its logprobs name tokens as `token_id:N` strings.

Either way vLLM sends `VLLMConfig.stream_interval` tokens a chunk, and each stream is read to its end (vLLM's
`[DONE]`), so that its kept-alive connection serves a next request instead of being closed."""

from __future__ import annotations

import asyncio
import functools
import json
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import yarl

from artrl.local.engine.contract import EngineError, SamplingParams, SequenceStream, TokenChoice
from artrl.local.engine.vllm.replicas import Replica

_STREAM_END_S = 1.0  # a stream whose every choice finished gets this long to end (else it is closed)
# a kept-alive connection unused this long is closed: below the 5 s after which vLLM's server (uvicorn) closes
# it, so that a request is rarely sent on a connection the server is closing (the one retry covers the rest)
_KEEP_ALIVE_S = 2.0
# aiohttp refuses a line over twice its read buffer: vLLM's API server merges the chunks it could not send yet,
# so one SSE line may hold a whole long completion with its top logprobs (~0.6 KB a token at 20)
_LINE_BYTES = 1 << 26


class ReplicaFailure(EngineError):
    """A replica failed a request in a way another replica may not (it died, or answered 5xx)."""


class ModelNotFound(EngineError):
    """A replica answered 404: it does not serve the model asked for (for an adapter: it lost it)."""


def _sampling(params: SamplingParams, n: int, stream_interval: int) -> dict[str, Any]:
    """The sampling settings both wires take, the same way."""
    sampling: dict[str, Any] = {
        "n": n,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "logprobs": params.top_logprobs,  # the sampled token's logprob always; k alternatives besides
        "stop_token_ids": sorted(params.stop_token_ids),
        "ignore_eos": True,  # only the gateway's stop ids end a turn
        "skip_special_tokens": False,
    }
    if stream_interval > 1:  # (vLLM >= 0.32; an older server ignores it)
        sampling["stream_interval"] = stream_interval
    if params.seed is not None:
        sampling["seed"] = params.seed
    return sampling


def generate_request(
    model: str, prompt_ids: list[int], params: SamplingParams, n: int, stream_interval: int = 1
) -> dict[str, Any]:
    """The body of a streamed /inference/v1/generate request (`stream_interval`: tokens per chunk)."""
    sampling = _sampling(params, n, stream_interval) | {"detokenize": False}
    return {
        "model": model,
        "token_ids": list(prompt_ids),
        "sampling_params": sampling,
        "output_mode": "tokens",
        "stream": True,
    }


def generate_tokens(choice: dict[str, Any], top_k: int) -> list[TokenChoice]:
    """The new tokens of one streamed generate choice: `token_ids` and `logprobs.content` (the sampled
    token's entry, its `top_logprobs` the sampled token first, then the k best: the k best are kept)."""
    ids = choice.get("token_ids") or []
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(ids):
        raise EngineError(f"vLLM returned {len(ids)} token ids but {len(content)} logprobs in one chunk")
    tokens = []
    for token_id, entry in zip(ids, content, strict=True):
        ranked: tuple[tuple[int, float], ...] = ()
        if top_k:
            best = {int(t["token_id"]): float(t["logprob"]) for t in entry.get("top_logprobs") or ()}
            ranked = tuple(sorted(best.items(), key=lambda kv: -kv[1])[:top_k])
        tokens.append(TokenChoice(int(token_id), float(entry["logprob"]), ranked))
    return tokens


def completion_request(
    model: str, prompt_ids: list[int], params: SamplingParams, n: int, stream_interval: int = 1
) -> dict[str, Any]:
    """The body of a token-in /v1/completions request (streamed; `stream_interval`: tokens per chunk)."""
    return {
        "model": model,
        "prompt": list(prompt_ids),
        **_sampling(params, n, stream_interval),
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "detokenize": True,
        "stream": True,
    }


def _token_id(text: str) -> int:
    return int(text.removeprefix("token_id:"))


def choice_tokens(choice: dict[str, Any], top_k: int) -> list[TokenChoice]:
    """The new tokens of one streamed completions choice (`token_ids` plus `logprobs`).

    vLLM's `top_logprobs` hold the k most likely tokens plus the sampled one: the k best are kept."""
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs") or []
    ids = choice.get("token_ids")
    if ids is None:
        ids = [_token_id(t) for t in logprobs.get("tokens") or []]
    if len(values) != len(ids):
        raise EngineError(f"vLLM returned {len(ids)} token ids but {len(values)} logprobs in one chunk")
    tops = logprobs.get("top_logprobs") or [None] * len(ids)
    tokens = []
    for token_id, value, top in zip(ids, values, tops, strict=True):
        ranked = sorted(((_token_id(k), float(v)) for k, v in (top or {}).items()), key=lambda kv: -kv[1])
        tokens.append(TokenChoice(int(token_id), float(value), tuple(ranked[:top_k])))
    return tokens


WIRES = {  # wire: (path, request body, a choice's new tokens)
    "generate": ("/inference/v1/generate", generate_request, generate_tokens),
    "completions": ("/v1/completions", completion_request, choice_tokens),
}


def open_session(connect_timeout_s: float) -> aiohttp.ClientSession:
    """The HTTP client of one event loop's vLLM requests (on that loop). aiohttp, not httpx: its pool hands
    out a kept-alive connection without looking at the others and it parses responses in C, where httpx's
    pool checks every connection at each request and response (with 64 streams in flight, more CPU than
    reading the streams)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEP_ALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
        read_bufsize=_LINE_BYTES,
        trust_env=False,  # (the environment's proxies: env_proxy, read once, not at every request)
    )


@functools.lru_cache(maxsize=256)
def env_proxy(base_url: str) -> tuple[str | None, aiohttp.BasicAuth | None]:
    """The proxy the environment names for a server (HTTP_PROXY / HTTPS_PROXY, NO_PROXY honoured), read once
    per server, as httpx reads it once per client. aiohttp's own `trust_env` reads the environment and
    ~/.netrc again at every request, each time on a worker thread: two thread hand-offs a call, ~15% of the
    gateway thread's time with 64 agent sessions on vLLM (and a netrc entry for the server's host would clash
    with the API key's Authorization header)."""
    url = yarl.URL(base_url)
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(url.scheme or "http")
    if not proxy or urllib.request.proxy_bypass_environment(f"{url.host}:{url.port}", proxies):
        return None, None
    found = yarl.URL(proxy)
    if found.user is None:
        return proxy, None
    return str(found.with_user(None)), aiohttp.BasicAuth.from_url(found)


def forget_session(session: aiohttp.ClientSession) -> None:
    """Drop the session of an event loop that ended (nothing can be awaited on it any more): its connector
    marked closed, so that it does not log "Unclosed connector" when collected; its kept-alive sockets close
    when they are collected."""
    connector = session.connector
    session.detach()
    if connector is None:
        return
    closing = connector.close()  # (a coroutine: on an ended loop it marks the connector closed and returns)
    if not asyncio.iscoroutine(closing):
        return
    try:
        closing.send(None)
    except StopIteration:
        return
    closing.close()  # (it waited for something: nothing can run it now)


async def read_completion_stream(
    client: aiohttp.ClientSession,
    timeout_s: float,
    replica: Replica,
    wire: str,
    body: dict[str, Any],
    streams: list[SequenceStream],
    ended: list[bool],
    sampled: list[list[int]],
) -> None:
    """Stream one request (`body`, made for `wire`) from `replica` into `streams` (and each one's ids into
    `sampled`); returns when every stream ended (or its consumers went away), raises ReplicaFailure where
    another replica may do better (a stream that ends with no finish reason among them)."""
    path, _, tokens_of = WIRES[wire]
    settings = body.get("sampling_params", body)
    # (greedy: choice 0 feeds every stream)
    into = _Choices(tokens_of, settings["logprobs"], settings["n"] < len(streams), streams, ended, sampled)
    try:
        await _read_stream(client, timeout_s, replica, f"{replica.base_url}{path}", body, into)
    except Exception:
        if not all(ended):
            raise
        # (every choice had finished: what failed is the stream's end, after the answer was whole)
    if not all(ended[i] or streams[i].aborted for i in range(len(streams))):
        raise ReplicaFailure(f"{replica.name()}: vLLM's stream ended without a finish reason")


async def _post(
    client: aiohttp.ClientSession, replica: Replica, url: str, body: dict[str, Any]
) -> aiohttp.ClientResponse:
    """The response to one request, sent again once where the server closed a kept-alive connection as it was
    sent (its keep-alive ended): vLLM got no request, so nothing is generated twice."""
    proxy, proxy_auth = env_proxy(replica.base_url)
    headers = {**replica.headers, "Content-Type": "application/json"}
    send = functools.partial(
        client.post, url, data=orjson.dumps(body), headers=headers, proxy=proxy, proxy_auth=proxy_auth
    )
    try:
        return await send()
    except aiohttp.ClientConnectorError:  # (no connection made: the replica is down, not a stale connection)
        raise
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        return await send()


def _chunk(data: bytes) -> dict[str, Any]:
    """One streamed chunk: orjson's parse, or json's where the server wrote what only json reads (NaN,
    Infinity: vLLM clamps the logprobs it sends, another server may not)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


@dataclass
class _Choices:
    """Where one response's choices go: each choice's new tokens into its stream (every stream, fanned out),
    and their ids into `sampled`; `ended[i]` once stream i has its finish reason."""

    tokens_of: Callable[[dict[str, Any], int], list[TokenChoice]]
    top_k: int
    fan_out: bool
    streams: list[SequenceStream]
    ended: list[bool]
    sampled: list[list[int]]

    def take(self, replica: Replica, choice: dict[str, Any]) -> None:
        targets = range(len(self.streams)) if self.fan_out else [choice["index"]]
        tokens = self.tokens_of(choice, self.top_k)
        reason = choice.get("finish_reason")
        if reason == "abort":  # not ours (ours close the connection): a shutdown or pause
            raise ReplicaFailure(f"{replica.name()} aborted the request (its server is stopping or paused)")
        for i in targets:
            if self.ended[i] or self.streams[i].aborted:
                continue
            for token in tokens:
                self.streams[i].push(token)
                self.sampled[i].append(token.token_id)
            if reason is not None:
                self.ended[i] = True
                self.streams[i].end("length" if reason == "length" else "stop")


async def _read_stream(
    client: aiohttp.ClientSession,
    timeout_s: float,
    replica: Replica,
    url: str,
    body: dict[str, Any],
    into: _Choices,
) -> None:
    async with asyncio.timeout(timeout_s) as deadline:
        async with await _post(client, replica, url, body) as response:
            finished = False
            if response.status != 200:
                text = await response.text()
                status = response.status
                failure = ReplicaFailure if status >= 500 else ModelNotFound if status == 404 else EngineError
                raise failure(f"vLLM answered {status}: {text[:2000]}")
            async for raw in response.content:  # (one line each)
                line = raw.rstrip(b"\r\n")
                if finished or not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = _chunk(line[6:])
                replica.tokens_seen += 1  # it is working (the supervisor does not take a busy server down)
                if "error" in chunk:
                    server = replica.server  # read once: a restart may replace it meanwhile
                    where = f" (its log: {server.log_path})" if server else ""
                    raise ReplicaFailure(f"{replica.name()} failed mid-stream{where}: {chunk['error']}")
                for choice in chunk.get("choices", []):
                    into.take(replica, choice)
                if all(into.ended) and not finished:
                    # what follows is `data: [DONE]`, at once: read to the end, so that the connection goes
                    # back to the pool (closed with the body unread, every request would open a new one)
                    finished = True
                    end_by = asyncio.get_running_loop().time() + _STREAM_END_S
                    deadline.reschedule(min(end_by, deadline.when() or end_by))
