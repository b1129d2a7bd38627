"""vLLM's token-in/token-out on the wire: the request body for exact prompt ids, and one streamed response
read into the gateway's sequence streams (sampled ids with their logprobs). Two wires (VLLMConfig.wire):

- `generate`: vLLM's `/inference/v1/generate` (a server started with `--enable-scale-out`, as artrl starts
  it): ids in, ids and logprobs out as integers, nothing detokenized on vLLM's side;
- `completions`: `/v1/completions` with a prompt of ids (any vLLM server, e.g. one at VLLMConfig.url): vLLM
  also writes each token's text, and its logprobs name tokens as `token_id:N` strings."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from artrl.local.engine.contract import EngineError, SamplingParams, SequenceStream, TokenChoice
from artrl.local.engine.vllm.replicas import Replica


class ReplicaFailure(EngineError):
    """A replica failed a request in a way another replica may not (it died, or answered 5xx)."""


class ModelNotFound(EngineError):
    """A replica answered 404: it does not serve the model asked for (for an adapter: it lost it)."""


def generate_request(model: str, prompt_ids: list[int], params: SamplingParams, n: int) -> dict[str, Any]:
    """The body of a streamed /inference/v1/generate request."""
    sampling: dict[str, Any] = {
        "n": n,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "logprobs": params.top_logprobs,  # the sampled token's logprob always; k alternatives besides
        "stop_token_ids": sorted(params.stop_token_ids),
        "ignore_eos": True,  # only the gateway's stop ids end a turn
        "skip_special_tokens": False,
        "detokenize": False,
    }
    if params.seed is not None:
        sampling["seed"] = params.seed
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


def completion_request(model: str, prompt_ids: list[int], params: SamplingParams, n: int) -> dict[str, Any]:
    """The body of a token-in /v1/completions request (streamed)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_ids),
        "n": n,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "logprobs": params.top_logprobs,  # the sampled token's logprob always; k alternatives besides
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "stop_token_ids": sorted(params.stop_token_ids),
        "ignore_eos": True,  # only the gateway's stop ids end a turn
        "skip_special_tokens": False,
        "detokenize": True,
        "stream": True,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    return body


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


async def read_completion_stream(
    client: httpx.AsyncClient,
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
    top_k = settings["logprobs"]
    fan_out = settings["n"] < len(streams)  # greedy: choice 0 feeds every stream
    url = f"{replica.base_url}{path}"
    async with asyncio.timeout(timeout_s):
        async with client.stream("POST", url, json=body, headers=replica.headers) as response:
            if response.status_code != 200:
                await response.aread()
                status = response.status_code
                failure = ReplicaFailure if status >= 500 else ModelNotFound if status == 404 else EngineError
                raise failure(f"vLLM answered {response.status_code}: {response.text[:2000]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                replica.tokens_seen += 1  # it is working (the supervisor does not take a busy server down)
                if "error" in chunk:
                    server = replica.server  # read once: a restart may replace it meanwhile
                    where = f" (its log: {server.log_path})" if server else ""
                    raise ReplicaFailure(f"{replica.name()} failed mid-stream{where}: {chunk['error']}")
                for choice in chunk.get("choices", []):
                    targets = range(len(streams)) if fan_out else [choice["index"]]
                    tokens = tokens_of(choice, top_k)
                    reason = choice.get("finish_reason")
                    if reason == "abort":  # not ours (ours close the connection): a shutdown or pause
                        raise ReplicaFailure(
                            f"{replica.name()} aborted the request (its server is stopping or paused)"
                        )
                    for i in targets:
                        if ended[i] or streams[i].aborted:
                            continue
                        for token in tokens:
                            streams[i].push(token)
                            sampled[i].append(token.token_id)
                        if reason is not None:
                            ended[i] = True
                            streams[i].end("length" if reason == "length" else "stop")
                if all(ended):
                    return
    if not all(ended[i] or streams[i].aborted for i in range(len(streams))):
        raise ReplicaFailure(f"{replica.name()}: vLLM's stream ended without a finish reason")
