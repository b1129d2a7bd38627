"""A scripted vLLM server for measuring what the gateway costs per call without vLLM's compute
(bench_gateway_cpu.py starts it in a process of its own):

    python benchmarks/scripted_vllm_server.py PORT TOKEN_IDS_JSON [--token-ms 0.5]

It answers as vLLM 0.32 does, with canned tokens (TOKEN_IDS, cycled) and one logprob each: `/health`,
`/v1/models` (the base `base`), `/inference/v1/generate` and `/v1/completions` (streamed, the request's
`stream_interval` tokens a chunk, `max_tokens` in all: what artrl's gateway reads) and `/v1/chat/completions`
(not streamed: a chat answer of as many words, what vLLM direct's client reads). Each answer takes
`--token-ms` per token, so that both endpoints keep as many calls in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web

NAME = "base"


def chunk_sizes(total: int, interval: int) -> list[int]:
    """vLLM's chunking: the first token alone, then `interval` a chunk, the rest last."""
    sizes = [1]
    while sum(sizes) < total:
        sizes.append(min(interval, total - sum(sizes)))
    return sizes


def generate_choice(ids: list[int], last: bool) -> dict:
    content = [{"token_id": i, "logprob": -1.5, "top_logprobs": []} for i in ids]
    return {
        "index": 0,
        "token_ids": ids,
        "logprobs": {"content": content},
        "finish_reason": "length" if last else None,
    }


def completion_choice(ids: list[int], last: bool) -> dict:
    logprobs = {
        "text_offset": list(range(len(ids))),
        "token_logprobs": [-1.5] * len(ids),
        "tokens": [f"token_id:{i}" for i in ids],
        "top_logprobs": None,
    }
    return {
        "index": 0,
        "text": "x" * len(ids),
        "logprobs": logprobs,
        "finish_reason": "length" if last else None,
        "stop_reason": None,
        "token_ids": ids,
    }


def app(token_ids: list[int], token_s: float) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        entry = {"id": NAME, "object": "model", "root": NAME, "parent": None, "max_model_len": 4096}
        return web.json_response({"object": "list", "data": [entry]})

    async def streamed(request: web.Request, choice_of) -> web.StreamResponse:
        body = await request.json()
        settings = body.get("sampling_params", body)
        total, interval = settings["max_tokens"], settings.get("stream_interval", 1)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sent, sizes = 0, chunk_sizes(total, interval)
        for k, size in enumerate(sizes):
            await asyncio.sleep(size * token_s)
            ids = [token_ids[(sent + i) % len(token_ids)] for i in range(size)]
            sent += size
            chunk = {"id": "cmpl-1", "model": body["model"], "choices": [choice_of(ids, k == len(sizes) - 1)]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def generate(request: web.Request) -> web.StreamResponse:
        return await streamed(request, generate_choice)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await streamed(request, completion_choice)

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        total = body.get("max_tokens") or 16
        await asyncio.sleep(total * token_s)
        message = {"role": "assistant", "content": " ".join(["word"] * total), "tool_calls": []}
        return web.json_response(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 1,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "length", "logprobs": None}],
                "usage": {"prompt_tokens": 100, "completion_tokens": total, "total_tokens": 100 + total},
            }
        )

    served = web.Application()
    served.router.add_get("/health", health)
    served.router.add_get("/v1/models", models)
    served.router.add_post("/inference/v1/generate", generate)
    served.router.add_post("/v1/completions", completions)
    served.router.add_post("/v1/chat/completions", chat)
    return served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("port", type=int)
    parser.add_argument("token_ids", help="the canned token ids, a JSON list")
    parser.add_argument("--token-ms", type=float, default=0.5)
    args = parser.parse_args()
    served = app(json.loads(args.token_ids), args.token_ms / 1000)
    web.run_app(served, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
