"""Malformed requests to `POST /v1/chat/completions`: each gets a 4xx with an OpenAI-style error body, and
the gateway keeps answering valid requests afterwards.

Requests are sent as raw HTTP (httpx) so that bodies no SDK would produce can be tested too. The last cases
(out-of-range seeds, over-nested JSON, lone surrogates) were once answered with a 500 or a broken stream.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import threading
from typing import Any

import httpx
import openai
import pytest

USER_HI = {"role": "user", "content": "hi"}
VALID = {"model": "tiny", "messages": [USER_HI], "max_tokens": 2}
_DROP = object()
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
}


def chat(**fields: Any) -> dict[str, Any]:
    """The valid small request with some fields replaced (or removed, with `_DROP`)."""
    body: dict[str, Any] = dict(VALID)
    for key, value in fields.items():
        if value is _DROP:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def msgs(*messages: Any, **fields: Any) -> dict[str, Any]:
    return chat(messages=list(messages), **fields)


def tool(name: str = "get_weather", **extra: Any) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": {}}},
        **extra,
    }


def call(call_id: str = "call_1", name: str = "get_weather", arguments: Any = "{}") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def encode(body: Any) -> bytes:
    # json.dumps escapes lone surrogates (ensure_ascii) and writes NaN/Infinity as Python's json does.
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def assert_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, f"{response.status_code}: {response.text[:500]}"
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    if status in ERROR_TYPES:
        assert error["type"] == ERROR_TYPES[status], error
    assert "param" in error and "code" in error, error
    return error


async def assert_serving(client: httpx.AsyncClient, base_url: str) -> None:
    check_valid_response(await client.post(f"{base_url}/chat/completions", json=VALID))


def check_valid_response(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text[:500]
    body = response.json()
    assert len(body["choices"]) == 1
    assert body["choices"][0]["message"]["role"] == "assistant"


async def send_then_follow_up(base_url: str, body: Any) -> tuple[httpx.Response, httpx.Response]:
    """The malformed request, then the valid one; both are sent before anything is asserted.

    The follow-up reuses the connection after a 4xx. After anything else it uses a fresh connection (a 500
    makes the server close the connection it came on), and waiting for it before asserting also lets the
    gateway thread finish logging its traceback: CPython 3.11 can raise "AST constructor recursion depth
    mismatch" when two threads format tracebacks at once.
    """
    url = f"{base_url}/chat/completions"
    async with httpx.AsyncClient(timeout=30) as client:
        try:
            bad = await client.post(url, content=encode(body), headers={"content-type": "application/json"})
        except httpx.TransportError as exc:
            bad = httpx.Response(599, text=f"transport error: {exc!r}")
        if 400 <= bad.status_code < 500:
            return bad, await client.post(url, json=VALID)
    async with httpx.AsyncClient(timeout=30) as fresh:
        return bad, await fresh.post(url, json=VALID)


ASSISTANT_CALLS = {"role": "assistant", "content": None, "tool_calls": [call()]}

# (body, expected status). A body is a JSON-able value or raw bytes.
CASES = [
    # --- the body itself
    pytest.param(b"{not json", 400, id="body-not-json"),
    pytest.param(b"", 400, id="body-empty"),
    pytest.param(
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        400,
        id="body-invalid-utf8",
    ),
    pytest.param([VALID], 400, id="body-json-array"),
    pytest.param("hi", 400, id="body-json-string"),
    pytest.param(None, 400, id="body-json-null"),
    pytest.param(b"x" * (9 << 20), 413, id="body-over-8MiB"),
    # --- model
    pytest.param(chat(model=_DROP), 400, id="model-missing"),
    pytest.param(chat(model=5), 400, id="model-not-string"),
    pytest.param(chat(model="gpt-4o"), 404, id="model-unknown"),
    # --- messages: the list
    pytest.param(chat(messages=_DROP), 400, id="messages-missing"),
    pytest.param(chat(messages=None), 400, id="messages-null"),
    pytest.param(chat(messages="hi"), 400, id="messages-not-list"),
    pytest.param(chat(messages={"role": "user", "content": "hi"}), 400, id="messages-object"),
    pytest.param(chat(messages=[]), 400, id="messages-empty"),
    pytest.param(msgs("hi"), 400, id="message-not-object"),
    pytest.param(msgs(USER_HI, ["user", "hi"]), 400, id="message-is-list"),
    # --- messages: roles and content
    pytest.param(msgs({"role": "wizard", "content": "hi"}), 400, id="role-unknown"),
    pytest.param(msgs({"content": "hi"}), 400, id="role-missing"),
    pytest.param(msgs({"role": ["user"], "content": "hi"}), 400, id="role-not-string"),
    pytest.param(msgs({"role": "user"}), 400, id="user-without-content"),
    pytest.param(msgs({"role": "user", "content": None}), 400, id="user-content-null"),
    pytest.param(msgs({"role": "user", "content": 42}), 400, id="content-number"),
    pytest.param(msgs({"role": "user", "content": {"text": "hi"}}), 400, id="content-object"),
    pytest.param(
        msgs({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}),
        400,
        id="content-part-image_url",
    ),
    pytest.param(
        msgs({"role": "user", "content": [{"type": "text", "text": 7}]}), 400, id="content-part-text-number"
    ),
    pytest.param(msgs({"role": "user", "content": ["hi"]}), 400, id="content-part-not-object"),
    pytest.param(msgs({"role": "system"}, USER_HI), 400, id="system-without-content"),
    pytest.param(msgs(USER_HI, {"role": "system", "content": "be brief"}), 400, id="system-not-first"),
    pytest.param(msgs(USER_HI, {"role": "developer", "content": "be brief"}), 400, id="developer-not-first"),
    # --- messages: assistant turns and tool results
    pytest.param(msgs(USER_HI, {"role": "assistant"}, USER_HI), 400, id="assistant-no-content-no-tool_calls"),
    pytest.param(
        msgs(USER_HI, {"role": "assistant", "content": None, "tool_calls": None}, USER_HI),
        400,
        id="assistant-null-content-null-tool_calls",
    ),
    pytest.param(
        msgs(USER_HI, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {}}]}),
        400,
        id="assistant-tool_call-no-function-name",
    ),
    pytest.param(
        msgs(USER_HI, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}),
        400,
        id="assistant-tool_call-no-id",
    ),
    pytest.param(
        msgs(USER_HI, {"role": "assistant", "tool_calls": [{"id": "c", "name": "f"}]}),
        400,
        id="assistant-tool_call-no-function",
    ),
    pytest.param(
        msgs(USER_HI, {"role": "assistant", "tool_calls": "f()"}), 400, id="assistant-tool_calls-not-list"
    ),
    pytest.param(
        msgs(USER_HI, {"role": "assistant", "tool_calls": [call(arguments=5)]}),
        400,
        id="assistant-tool_call-arguments-number",
    ),
    pytest.param(
        msgs(USER_HI, {"role": "assistant", "tool_calls": [{**call(), "type": "code"}]}),
        400,
        id="assistant-tool_call-type-not-function",
    ),
    pytest.param(
        msgs(USER_HI, ASSISTANT_CALLS, {"role": "tool", "content": "sunny"}),
        400,
        id="tool-without-tool_call_id",
    ),
    pytest.param(
        msgs(USER_HI, ASSISTANT_CALLS, {"role": "tool", "tool_call_id": 1, "content": "sunny"}),
        400,
        id="tool-tool_call_id-number",
    ),
    pytest.param(
        msgs(USER_HI, ASSISTANT_CALLS, {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}),
        400,
        id="tool-tool_call_id-unmatched",
    ),
    pytest.param(
        msgs({"role": "tool", "tool_call_id": "call_1", "content": "sunny"}),
        400,
        id="tool-message-first",
    ),
    pytest.param(
        msgs(
            USER_HI,
            ASSISTANT_CALLS,
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ),
        400,
        id="tool-tool_call_id-answered-twice",
    ),
    pytest.param(
        msgs(USER_HI, ASSISTANT_CALLS, {"role": "tool", "tool_call_id": "call_1"}),
        400,
        id="tool-without-content",
    ),
    pytest.param(msgs({"role": "user", "content": "word " * 20_000}), 400, id="prompt-longer-than-context"),
    # --- sampling parameters
    pytest.param(chat(temperature=2.5), 400, id="temperature-above-2"),
    pytest.param(chat(temperature=-0.1), 400, id="temperature-negative"),
    pytest.param(chat(temperature="0.7"), 400, id="temperature-string"),
    pytest.param(chat(temperature=float("nan")), 400, id="temperature-nan"),
    pytest.param(chat(top_p=0), 400, id="top_p-zero"),
    pytest.param(chat(top_p=1.5), 400, id="top_p-above-1"),
    pytest.param(chat(n=0), 400, id="n-zero"),
    pytest.param(chat(n=33), 400, id="n-over-max_n"),
    pytest.param(chat(n=1.5), 400, id="n-float"),
    pytest.param(chat(max_tokens=0), 400, id="max_tokens-zero"),
    pytest.param(chat(max_tokens=-5), 400, id="max_tokens-negative"),
    pytest.param(chat(max_tokens=2.5), 400, id="max_tokens-float"),
    pytest.param(chat(max_tokens="2"), 400, id="max_tokens-string"),
    pytest.param(chat(max_tokens=2048), 400, id="max_tokens-over-context"),
    pytest.param(chat(max_tokens=10**30), 400, id="max_tokens-huge"),
    pytest.param(chat(max_tokens=_DROP, max_completion_tokens=0), 400, id="max_completion_tokens-zero"),
    pytest.param(
        chat(max_tokens=_DROP, max_completion_tokens=4096), 400, id="max_completion_tokens-over-context"
    ),
    pytest.param(chat(stop=5), 400, id="stop-number"),
    pytest.param(chat(stop=["\n", 5]), 400, id="stop-list-with-non-string"),
    pytest.param(chat(stop=""), 400, id="stop-empty-string"),
    pytest.param(chat(stop=[f"s{i}" for i in range(17)]), 400, id="stop-too-many"),
    pytest.param(chat(seed="42"), 400, id="seed-string"),
    pytest.param(
        chat(seed=2**64),
        400,
        id="seed-above-int64",
    ),
    pytest.param(
        chat(seed=-(2**63) - 1),
        400,
        id="seed-below-int64",
    ),
    pytest.param(chat(logprobs="yes"), 400, id="logprobs-string"),
    pytest.param(chat(top_logprobs=3), 400, id="top_logprobs-without-logprobs"),
    pytest.param(chat(logprobs=True, top_logprobs=21), 400, id="top_logprobs-over-20"),
    pytest.param(chat(logprobs=True, top_logprobs=-1), 400, id="top_logprobs-negative"),
    # --- streaming
    pytest.param(chat(stream="true"), 400, id="stream-string"),
    pytest.param(chat(stream_options="yes"), 400, id="stream_options-not-object"),
    pytest.param(
        msgs({"role": "wizard", "content": "hi"}, stream=True), 400, id="stream-true-with-unknown-role"
    ),
    pytest.param(chat(stream=True, max_tokens=0), 400, id="stream-true-with-max_tokens-zero"),
    # --- tools
    pytest.param(chat(tools=tool()), 400, id="tools-not-list"),
    pytest.param(chat(tools=[{**tool(), "type": "retrieval"}]), 400, id="tool-type-not-function"),
    pytest.param(chat(tools=[{"type": "function"}]), 400, id="tool-without-function"),
    pytest.param(
        chat(tools=[{"type": "function", "function": {"description": "d"}}]),
        400,
        id="tool-function-without-name",
    ),
    pytest.param(chat(tools=[tool("get weather")]), 400, id="tool-name-with-spaces"),
    pytest.param(chat(tools=[tool("")]), 400, id="tool-name-empty"),
    pytest.param(chat(tools=[tool("f" * 65)]), 400, id="tool-name-over-64-chars"),
    pytest.param(chat(tools=[tool(), tool()]), 400, id="tool-names-duplicate"),
    pytest.param(chat(tools=[tool(extra=1)]), 400, id="tool-unknown-field"),
    pytest.param(
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
        400,
        id="tool-parameters-not-object",
    ),
    pytest.param(chat(tool_choice="required"), 400, id="tool_choice-required-without-tools"),
    pytest.param(
        chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        400,
        id="tool_choice-named-without-tools",
    ),
    pytest.param(
        chat(tools=[tool()], tool_choice={"type": "function", "function": {"name": "get_time"}}),
        400,
        id="tool_choice-names-function-not-in-tools",
    ),
    pytest.param(chat(tools=[tool()], tool_choice="always"), 400, id="tool_choice-unknown-string"),
    # --- parameters the gateway cannot honour
    pytest.param(chat(presence_penalty=0.5), 400, id="presence_penalty-nonzero"),
    pytest.param(chat(frequency_penalty=-1), 400, id="frequency_penalty-nonzero"),
    pytest.param(chat(logit_bias={"50256": -100}), 400, id="logit_bias-nonempty"),
    pytest.param(chat(response_format={"type": "json_object"}), 400, id="response_format-json_object"),
    pytest.param(chat(chat_template_kwargs={"enable_thinking": False}), 400, id="template-kwarg-not-read"),
    pytest.param(
        chat(chat_template_kwargs={"add_generation_prompt": False}), 400, id="template-kwarg-reserved"
    ),
    pytest.param(chat(chat_template_kwargs=["x"]), 400, id="template-kwargs-not-object"),
    # --- inputs that once crashed the gateway (500)
    pytest.param(
        b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        400,
        id="body-deeply-nested-json",
    ),
    pytest.param(
        msgs({"role": "user", "content": "\ud800"}),
        400,
        id="content-lone-surrogate",
    ),
]


@pytest.mark.parametrize(("body", "status"), CASES)
async def test_malformed_request_is_a_4xx_and_the_gateway_keeps_serving(served, body: Any, status: int):
    bad, follow_up = await send_then_follow_up(served.inference_base_url, body)
    assert_error(bad, status)
    check_valid_response(follow_up)


async def test_streaming_request_with_an_unusable_seed_is_rejected_before_streaming(served):
    bad, follow_up = await send_then_follow_up(served.inference_base_url, chat(stream=True, seed=2**64))
    check_valid_response(follow_up)
    assert_error(bad, 400)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/chat/completions", 405), ("PUT", "/chat/completions", 405), ("POST", "/completion", 404)],
    ids=["GET-chat", "PUT-chat", "POST-unknown-path"],
)
async def test_wrong_method_or_path_gets_an_error_body(served, method: str, path: str, status: int):
    base_url = served.inference_base_url
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await client.request(method, f"{base_url}{path}", json=VALID)
        assert_error(answer, status)
        if status == 405:  # (what the route takes)
            assert answer.headers["allow"] == "POST"
        await assert_serving(client, base_url)


def test_an_answer_json_cannot_write_is_written_as_before():
    """The gateway writes its answers with orjson; what orjson refuses (an integer beyond 64 bits, echoed
    from a client's tool schema or metadata) is written by json, not a 500."""
    from artrl.local.gateway.calls import JSONAnswer

    assert json.loads(JSONAnswer({"n": 2**70, "ids": [1, 2]}).body) == {"n": 2**70, "ids": [1, 2]}
    assert JSONAnswer({"text": "é", "ids": [1]}).body == '{"text":"é","ids":[1]}'.encode()


async def test_concurrent_malformed_requests_all_get_4xx(served):
    base_url = served.inference_base_url
    bodies = [
        p.values[0]
        for p in CASES
        if p.id not in ("body-over-8MiB", "prompt-longer-than-context")  # big bodies: slow, not concurrent
    ][:20]
    assert len(bodies) == 20
    async with httpx.AsyncClient(timeout=30) as client:
        responses = await asyncio.gather(
            *(
                client.post(
                    f"{base_url}/chat/completions",
                    content=encode(body),
                    headers={"content-type": "application/json"},
                )
                for body in bodies
            )
        )
        for response in responses:
            assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
            assert response.json()["error"]["message"]
        await assert_serving(client, base_url)


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("text/plain", 415),  # what a web page may POST cross-site without a preflight
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        (None, 415),
        ("application/json; charset=utf-8", 200),
    ],
)
async def test_a_body_must_be_declared_json(served, content_type, status):
    body = json.dumps({"model": served.name, "messages": [USER_HI], "max_tokens": 2}).encode()
    headers = {"content-type": content_type} if content_type else {}
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(
            f"{served.inference_base_url}/chat/completions", content=body, headers=headers
        )
    assert response.status_code == status, response.text
    if status == 415:
        assert response.json()["error"]["code"] == "unsupported_media_type"


def test_serving_beyond_loopback_needs_a_key_or_an_explicit_opt_out():
    from artrl.config import GatewayConfig

    for host in ("0.0.0.0", "192.168.1.5", "::"):
        with pytest.raises(ValueError, match=r"api_key=.*allow_unauthenticated=True"):
            GatewayConfig(host=host)
        assert GatewayConfig(host=host, api_key="k").api_key == "k"
        assert GatewayConfig(host=host, allow_unauthenticated=True).host == host
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert GatewayConfig(host=host).api_key is None
    with pytest.raises(ValueError, match="at least 1 character"):
        GatewayConfig(api_key="")


async def test_api_key_is_required_on_v1_routes_only(tokenizer):
    from fakes import ScriptedEngine

    from artrl.config import EngineConfig, GatewayConfig
    from artrl.local.service.service import LocalService

    script = [*tokenizer("hello there", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    engine = ScriptedEngine(scripts=[list(script)])
    service = LocalService.serve(
        "keyed", None, tokenizer, engine, EngineConfig(), GatewayConfig(api_key="sekret")
    )
    try:
        base_url = service.base_url
        url = f"{base_url}/chat/completions"
        body = {"model": "keyed", "messages": [USER_HI], "max_tokens": 2}
        async with httpx.AsyncClient(timeout=30) as client:
            error = assert_error(await client.post(url, json=body), 401)
            assert error["code"] == "invalid_api_key"
            assert_error(await client.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
            assert_error(await client.post(url, json=body, headers={"Authorization": "Bearer sekre"}), 401)
            assert_error(await client.post(url, json=body, headers={"Authorization": "sekret"}), 401)
            assert_error(await client.post(url, json=body, headers={"Authorization": "Bearer sekret2"}), 401)
            # the key is checked before the body: a malformed body without a key is a 401, not a 400
            assert_error(await client.post(url, content=b"{not json"), 401)
            assert_error(await client.get(f"{base_url}/models"), 401)
            assert engine.prompts == []  # nothing reached the engine

            health = await client.get(base_url.removesuffix("/v1") + "/health")
            assert health.status_code == 200 and health.json() == {"status": "ok"}

            headers = {"Authorization": "Bearer sekret"}
            models = await client.get(f"{base_url}/models", headers=headers)
            assert models.status_code == 200
            assert [m["id"] for m in models.json()["data"]] == ["keyed", "keyed@0"]
            response = await client.post(url, json=body, headers=headers)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["token_ids"] == script[:2]
            # the scheme name is case-insensitive (RFC 9110)
            assert (
                await client.get(f"{base_url}/models", headers={"Authorization": "bearer sekret"})
            ).status_code == 200
            # with the key, malformed requests are still ordinary 400s
            json_type = {"content-type": "application/json"}
            assert_error(await client.post(url, content=b"{not json", headers={**headers, **json_type}), 400)

        wrong = openai.AsyncOpenAI(base_url=base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model="keyed", messages=[USER_HI], max_tokens=2)
        await wrong.close()
    finally:
        service.server.stop()


async def test_openai_sdk_raises_bad_request_for_an_unknown_role(served):
    client = served.openai_client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model="tiny", messages=[{"role": "wizard", "content": "hi"}], max_tokens=2
        )
    assert caught.value.status_code == 400
    assert "role" in caught.value.message
    await client.close()


async def test_openai_sdk_raises_not_found_for_an_unknown_model(served):
    client = served.openai_client(max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model="gpt-4o", messages=[USER_HI], max_tokens=2)
    assert caught.value.status_code == 404
    assert caught.value.code == "model_not_found"
    await client.close()


async def test_empty_tool_calls_list_means_no_tool_calls(served):
    messages = [USER_HI, {"role": "assistant", "content": "hello", "tool_calls": []}, USER_HI]
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(
            f"{served.inference_base_url}/chat/completions",
            json={"model": "tiny", "messages": messages, "max_tokens": 2},
        )
    assert response.status_code == 200, response.text


async def test_a_tool_name_with_a_trailing_newline_is_refused(served):
    """Before, the name's pattern ended in `$`, which also matches before a final newline: "get_weather\\n"
    was served, and a template rendered the newline into the prompt."""
    bad, follow_up = await send_then_follow_up(served.inference_base_url, chat(tools=[tool("get_weather\n")]))
    error = assert_error(bad, 400)
    assert error["code"] == "invalid_value" and error["param"] == "tools.0.function.name", error
    check_valid_response(follow_up)


def test_server_errors_have_the_server_error_type():
    from artrl.local.gateway.protocol import RequestError

    assert RequestError("boom", status=500).body()["error"]["type"] == "server_error"


async def test_an_oversized_body_is_refused_before_it_is_read(served):
    """A declared 1 TB body is refused at once, without waiting for (or holding) any of it; a chunked body
    is refused as soon as it passes the limit (before: the whole body was read into memory first). The
    chunked body never ends (no last chunk): a gateway that waited for all of it would not answer in time."""
    import asyncio
    from urllib.parse import urlsplit

    url = urlsplit(served.inference_base_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000000000\r\n\r\n{"
    )
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), timeout=10)
    writer.close()
    assert b" 413 " in status_line

    reader, writer = await asyncio.open_connection(url.hostname, url.port)

    async def send_chunks() -> None:  # past the 8 MiB limit, then nothing: no last chunk ends the body
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(9):
            writer.write(b"100000\r\n" + b" " * (1 << 20) + b"\r\n")  # (100000 hex: 1 MiB)
            await writer.drain()  # (may wait for ever, or fail, once the gateway stops reading)

    sending = asyncio.create_task(send_chunks())
    try:
        status_line = await asyncio.wait_for(reader.readline(), timeout=10)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        length = re.search(rb"(?im)^content-length: *(\d+)", head)
        body = length and await asyncio.wait_for(reader.readexactly(int(length[1])), timeout=10)
    finally:
        sending.cancel()
        await asyncio.wait({sending})
        if not sending.cancelled():
            sending.exception()  # (a reset connection: the gateway closed it after answering)
        writer.close()
    assert b" 413 " in status_line and body, (status_line, head)
    assert json.loads(body)["error"]["code"] == "request_too_large"


class _HeldTemplate:
    """A tokenizer that holds the preparation of a huge conversation (its rendering through
    apply_chat_template, or its encoding where ChatFormat renders without it) until `release` is set, and sets
    `held` when it starts: the test then knows the prompt is being prepared, however fast the machine."""

    def __init__(self, tokenizer: Any, held: threading.Event, release: threading.Event) -> None:
        self._tokenizer, self.held, self.release = tokenizer, held, release

    def hold_if_huge(self, size: int) -> None:
        if size > 1_000_000:
            self.held.set()
            self.release.wait(120)  # (a guard against a hang: the test releases it)

    @property
    def backend_tokenizer(self) -> Any:
        return _HeldBackend(self._tokenizer.backend_tokenizer, self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # (special methods bypass __getattr__)
        self.hold_if_huge(len(args[0]) if args and isinstance(args[0], str) else 0)
        return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __deepcopy__(self, memo: dict) -> _HeldTemplate:
        # ChatFormat.clone gives the preparation thread its own copy: it must hold on the test's events
        return _HeldTemplate(copy.deepcopy(self._tokenizer, memo), self.held, self.release)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        self.hold_if_huge(sum(len(str(m.get("content") or "")) for m in conversation))
        return self._tokenizer.apply_chat_template(conversation, **kwargs)


class _HeldBackend:
    """_HeldTemplate's fast tokenizer: its encode holds a huge text."""

    def __init__(self, backend: Any, template: _HeldTemplate) -> None:
        self._backend, self._template = backend, template

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def encode(self, text: str, **kwargs: Any) -> Any:
        self._template.hold_if_huge(len(text))
        return self._backend.encode(text, **kwargs)


async def test_a_huge_prompt_does_not_stall_the_gateway(tokenizer):
    """Rendering and tokenising a 2 MB prompt (about a second) happens off the event loop: while its rendering
    is held mid-preparation, /health and other clients are answered (before, every request waited for that
    prompt; a preparation on the event loop would leave them unanswered until it ends)."""
    from fakes import ScriptedEngine

    from artrl.config import EngineConfig, GatewayConfig
    from artrl.local.service.service import LocalService

    held, release = threading.Event(), threading.Event()
    service = LocalService.serve(
        "tiny",
        None,
        _HeldTemplate(tokenizer, held, release),
        ScriptedEngine(),
        EngineConfig(),
        GatewayConfig(),
    )
    huge = {"model": "tiny", "messages": [{"role": "user", "content": "apple pear " * 200_000}]}
    base = service.base_url
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.create_task(client.post(f"{base}/chat/completions", json=huge))
            try:
                assert await asyncio.to_thread(held.wait, 60), "the huge prompt was never rendered"
                # the rendering is held until release: these are answered while it is in progress
                health = await client.get(base.removesuffix("/v1") + "/health", timeout=30)
                assert health.status_code == 200 and health.json() == {"status": "ok"}
                assert (await client.get(f"{base}/models", timeout=30)).status_code == 200
                assert not task.done()
            finally:
                release.set()
            assert (await task).status_code == 400  # longer than the context: refused, after preparing it
    finally:
        service.server.stop()
