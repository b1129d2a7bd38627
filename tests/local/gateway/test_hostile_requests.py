"""Requests written to hurt the gateway or to reach it from where they should not (issue 43, items 4, 6, 12):
JSON nested deep enough to exhaust the stack, a web page's cross-site POSTs and DNS-rebound names, and
server errors that would hand the client exception text or a vLLM log."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import artrl
from artrl.config import EngineConfig, GatewayConfig
from artrl.local.engine.contract import SequenceStream

LIMIT = 64  # GatewayConfig().max_json_depth, its default
USER = {"role": "user", "content": "hi"}
SLOT = "@DEEP@"  # where a body holds the deep value (as JSON, or as a JSON string of it)
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}
CALLED = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}

# (route, body with SLOT somewhere, whether SLOT goes in as a JSON string): every place a client's JSON nests
PLACES = {
    "chat tool parameters": (
        "/chat/completions",
        {"messages": [USER], "tools": [{**CHAT_TOOL, "function": {"name": "f", "parameters": SLOT}}]},
        False,
    ),
    "chat call arguments": (
        "/chat/completions",
        {
            "messages": [
                USER,
                {
                    **CALLED,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": SLOT}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ]
        },
        False,
    ),
    "chat call arguments as a string": (
        "/chat/completions",
        {
            "messages": [
                USER,
                {
                    **CALLED,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": SLOT}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ]
        },
        True,
    ),
    "chat metadata": ("/chat/completions", {"messages": [USER], "metadata": SLOT}, False),
    "chat message": ("/chat/completions", {"messages": [USER, SLOT]}, False),
    "responses tool parameters": (
        "/responses",
        {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": SLOT}]},
        False,
    ),
    "responses call arguments as a string": (
        "/responses",
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": SLOT},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            ]
        },
        True,
    ),
    "messages tool schema": (
        "/messages",
        {"messages": [USER], "tools": [{"name": "f", "input_schema": SLOT}]},
        False,
    ),
    "messages tool_use input": (
        "/messages",
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "c1", "name": "f", "input": SLOT}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "ok"}]},
            ],
        },
        False,
    ),
}
VALID = {"model": "guarded", "messages": [USER], "max_tokens": 2}


def deep_json(kinds: list[bool]) -> str:
    """A value nested len(kinds) deep (True: an array, False: an object), written without recursing."""
    opening = "".join("[" if is_list else '{"type": "object", "a": ' for is_list in kinds)
    return opening + '"x"' + "".join("]" if is_list else "}" for is_list in reversed(kinds))


def enclosing(value: Any) -> int | None:
    """How many arrays and objects of a (shallow) template enclose its SLOT."""
    if value == SLOT:
        return 0
    inside = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    found = [d for d in map(enclosing, inside) if d is not None]
    return 1 + found[0] if found else None


def body_with(place: str, deep: str) -> tuple[str, bytes]:
    route, template, as_string = PLACES[place]
    limit = {"/responses": "max_output_tokens"}.get(route, "max_tokens")
    text = json.dumps({"model": "guarded", limit: 2, **template})
    return route, text.replace(json.dumps(SLOT), json.dumps(deep) if as_string else deep).encode()


@pytest.fixture(scope="module")
def gateway(tokenizer):
    from fakes import InstantEngine

    from artrl.local.service.service import LocalService

    service = LocalService.serve("guarded", None, tokenizer, InstantEngine(), EngineConfig(), GatewayConfig())
    yield service
    service.server.stop()


def connection(response: httpx.Response) -> Any:
    """The client side of the TCP connection that carried `response` (the same after a 4xx: kept alive)."""
    return response.extensions["network_stream"].get_extra_info("client_addr")


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    place=st.sampled_from(sorted(PLACES)),
    kinds=st.integers(0, 600).flatmap(lambda n: st.lists(st.booleans(), min_size=n, max_size=n))
    | st.integers(LIMIT - 8, LIMIT + 4).flatmap(lambda n: st.lists(st.booleans(), min_size=n, max_size=n)),
)
@example(place="chat tool parameters", kinds=[False] * 400)  # the probe: ~3 KB, a 500 on the old code
@example(place="messages tool_use input", kinds=[True] * 400)
@example(place="chat call arguments as a string", kinds=[False] * 400)
@example(place="responses call arguments as a string", kinds=[True] * 200)
@example(place="chat metadata", kinds=[True] * 900)
def test_deep_json_is_a_400_and_the_connection_stays_open(gateway, place: str, kinds: list[bool]):
    """However deep a client's JSON nests, wherever it sits (tools, messages, tool-call arguments as objects
    or as JSON strings, extra fields; chat, Responses and Messages bodies): never a 5xx; deeper than
    GatewayConfig.max_json_depth a 400 that says so; and the next request on the same connection is answered."""
    route, body = body_with(place, deep_json(kinds))
    _, template, as_string = PLACES[place]
    # the body's depth, or the string's own (tool-call arguments are JSON in a string, parsed too)
    too_deep = len(kinds) + (0 if as_string else enclosing(template)) > LIMIT
    with httpx.Client(base_url=gateway.base_url, timeout=30) as client:
        response = client.post(route, content=body, headers={"content-type": "application/json"})
        assert response.status_code < 500, (place, len(kinds), response.text[:300])
        if too_deep:
            assert response.status_code == 400, (place, len(kinds), response.text[:300])
            assert f"nested deeper than {LIMIT} levels" in response.json()["error"]["message"]
        after = client.post("/chat/completions", json=VALID)
        assert after.status_code == 200, after.text
        assert connection(after) == connection(response)  # the connection stayed open


def test_the_depth_limit_is_a_setting(tokenizer):
    from fakes import InstantEngine

    from artrl.local.service.service import LocalService

    assert GatewayConfig().max_json_depth == LIMIT
    with pytest.raises(ValueError, match="greater than or equal to 8"):
        GatewayConfig(max_json_depth=2)
    service = LocalService.serve(
        "guarded", None, tokenizer, InstantEngine(), EngineConfig(), GatewayConfig(max_json_depth=10)
    )
    try:
        with httpx.Client(base_url=service.base_url, timeout=30) as client:
            for depth, status in ((5, 200), (12, 400)):
                route, body = body_with("chat metadata", deep_json([True] * depth))
                response = client.post(route, content=body, headers={"content-type": "application/json"})
                assert response.status_code == status, response.text
    finally:
        service.server.stop()


# ---------------------------------------------------------------- what a web page can send (item 6)


def test_a_web_page_cannot_open_captures_cross_site(gateway):
    """A page may POST to any site without asking first, with no body or a form or text body: none of those
    opens a capture (it used to: 429 for every real capture once a page had used up the slots). A POST
    with JSON, or with a header only sent after a preflight (Authorization, as artrl's capture client
    sends), does."""
    base = gateway.base_url
    with httpx.Client(timeout=30) as client:
        for headers, content in (
            ({}, None),  # fetch(url, {method: "POST", mode: "no-cors"})
            ({"content-type": "text/plain"}, b""),
            ({"content-type": "application/x-www-form-urlencoded"}, b"a=1"),
            ({"content-type": "multipart/form-data; boundary=x"}, b""),
        ):
            refused = client.post(f"{base}/captures", headers=headers, content=content)
            assert refused.status_code == 415, refused.text
            assert refused.json()["error"]["code"] == "unsupported_media_type"
        for headers in (
            {"content-type": "application/json"},
            {"authorization": "Bearer artrl"},
            {"x-api-key": "artrl"},
        ):
            opened = client.post(f"{base}/captures", headers=headers)
            assert opened.status_code == 200, opened.text
            assert client.delete(f"{base}/captures/{opened.json()['id']}").status_code == 200


async def test_artrl_capture_still_opens_and_closes_captures(gateway):
    class Served:  # what `artrl.capture` needs of a model
        inference_base_url = gateway.base_url
        inference_api_key = "artrl"

    async with artrl.capture(Served()) as cap, httpx.AsyncClient(timeout=30) as client:
        answer = await client.post(f"{cap.base_url}/chat/completions", json=VALID)
        assert answer.status_code == 200, answer.text
    assert len(cap.records) == 1


REBOUND = ["evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io"]


def test_a_rebound_name_reaches_nothing(gateway):
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 talks to the gateway as its
    own origin, but sends its name as Host: refused on every route (421). Loopback names and addresses (what
    every client of a local gateway sends), with or without a port, are answered."""
    port = gateway.server.port
    with httpx.Client(base_url=gateway.base_url.removesuffix("/v1"), timeout=30) as client:
        for host in REBOUND:
            for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
                refused = client.request(method, path, json=VALID, headers={"host": host})
                assert refused.status_code == 421, (host, path, refused.text)
                assert refused.json()["error"]["code"] == "untrusted_host"
        for host in (
            "127.0.0.1",
            f"127.0.0.1:{port}",
            "localhost",
            f"LocalHost.:{port}",
            "[::1]:9",
            "127.0.0.7",
        ):
            answered = client.post("/v1/chat/completions", json=VALID, headers={"host": host})
            assert answered.status_code == 200, (host, answered.text)


def test_allowed_hosts_and_a_key_let_other_names_in(tokenizer):
    from fakes import InstantEngine

    from artrl.local.service.service import LocalService

    def status(config: GatewayConfig, host: str, key: str | None = None) -> int:
        service = LocalService.serve("guarded", None, tokenizer, InstantEngine(), EngineConfig(), config)
        try:
            headers = {"host": host, **({"authorization": f"Bearer {key}"} if key else {})}
            return httpx.get(f"{service.base_url}/models", headers=headers, timeout=30).status_code
        finally:
            service.server.stop()

    assert status(GatewayConfig(allowed_hosts=("gpu-box",)), "gpu-box:8000") == 200
    assert status(GatewayConfig(allowed_hosts=("gpu-box",)), "evil.example") == 421
    assert status(GatewayConfig(allowed_hosts=("*",)), "evil.example") == 200
    # with a key, the key decides (a rebound page cannot send it)
    assert status(GatewayConfig(api_key="k"), "gpu-box.example") == 401
    assert status(GatewayConfig(api_key="k"), "gpu-box.example", "k") == 200


def test_trusted_hosts_of_a_server_bound_everywhere():
    from artrl.local.gateway.guard import TrustedHosts

    everywhere = TrustedHosts("0.0.0.0")
    assert all(map(everywhere, ["10.1.2.3:8000", "[fe80::1]:80", "localhost", "0.0.0.0:1"]))
    assert not everywhere("evil.example")
    one = TrustedHosts("192.168.1.5")
    assert one("192.168.1.5:8000") and one("127.0.0.1") and not one("10.1.2.3") and not one("evil.example")


# ---------------------------------------------------------------- server errors (item 12)

SECRET = "/home/alice/.cache/secret-token-hf_abc123"


class FailingEngine:
    """Every sequence fails: with an EngineError quoting a (fake) vLLM log, or with an unexpected exception."""

    max_context = 2048

    def __init__(self, unexpected: bool) -> None:
        self.unexpected = unexpected

    def generate(self, prompt_ids, params, n):
        import asyncio

        if self.unexpected:
            raise RuntimeError(f"could not read {SECRET}")
        stream = SequenceStream(asyncio.get_running_loop())
        stream.end(
            "error",
            f"vLLM replica 0: the vLLM server exited with code -9. Last lines of /var/log/vllm.log:\n"
            f"loading {SECRET}\nCUDA error\n (after some of its tokens were streamed: not retried)",
        )
        return [stream]

    async def close(self) -> None:
        return None


@pytest.mark.parametrize("unexpected", [False, True], ids=["engine-error", "unexpected"])
def test_a_server_error_gives_an_id_not_the_text(tokenizer, caplog, unexpected: bool):
    """A 500 (and an error event in a stream, in each dialect) says what failed and gives an error id; the
    server's log has that id with the full text. An engine's own reason (which replica exited, not retried)
    stays; a vLLM log tail, paths and an unexpected exception's text do not reach the client."""
    from artrl.local.service.service import LocalService

    service = LocalService.serve(
        "guarded", None, tokenizer, FailingEngine(unexpected), EngineConfig(), GatewayConfig()
    )
    caplog.set_level(logging.ERROR)
    messages = []
    try:
        with httpx.Client(base_url=service.base_url, timeout=30) as client:
            plain = client.post("/chat/completions", json=VALID)
            assert plain.status_code == 500, plain.text
            messages.append(plain.json()["error"]["message"])
            bodies = {
                "/chat/completions": VALID,
                "/responses": {"model": "guarded", "input": "hi", "max_output_tokens": 2},
                "/messages": {"model": "guarded", "messages": [USER], "max_tokens": 2},
            }
            if not unexpected:  # (an engine that raises in generate fails before a stream starts)
                for route, body in bodies.items():
                    streamed = client.post(route, json={**body, "stream": True})
                    errors = [
                        json.loads(line.removeprefix("data: "))
                        for line in streamed.text.splitlines()
                        if line.startswith("data: {") and '"error"' in line
                    ]
                    assert errors, (route, streamed.text)
                    messages.append(errors[-1]["error"]["message"])
    finally:
        service.server.stop()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for message in messages:
        assert SECRET not in message and "CUDA" not in message and "vllm.log" not in message, message
        error_id = message.split("error id ")[1].split()[0].rstrip(":)")
        assert error_id.startswith("err_") and error_id in logged
        if unexpected:
            assert "RuntimeError" not in message and message.startswith("internal error"), message
        else:
            assert "vLLM server exited with code -9" in message and "not retried" in message, message
    assert SECRET in logged  # the full text, for whoever reads the server's log
