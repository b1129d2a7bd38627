"""`model.openai_client()` reaches the gateway in its own process without a socket (local/gateway/in_process.py):
the same answers as over HTTP, streaming, errors, timeouts that stop the generation, captures, and a clear
error once the gateway is gone."""

from __future__ import annotations

import asyncio
import contextlib

import openai
import pytest
from fakes import aborted

import artrl
from artrl.config import GatewayConfig
from artrl.sdk_http import openai_httpx

MESSAGES = [{"role": "user", "content": "hello there"}]


def _transport_name(client: openai.AsyncOpenAI) -> str:
    return type(client._client._transport).__name__


async def test_the_default_client_skips_the_network_and_answers_as_http_does(fresh_model):
    model = fresh_model
    direct = model.openai_client()
    assert _transport_name(direct) == "GatewayTransport"
    over_http = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    kwargs = dict(model=model.name, messages=MESSAGES, max_tokens=12, seed=7, logprobs=True)
    a = await direct.chat.completions.create(**kwargs)
    b = await over_http.chat.completions.create(**kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert [t.logprob for t in a.choices[0].logprobs.content] == pytest.approx(
        [t.logprob for t in b.choices[0].logprobs.content]
    )
    await over_http.close()


async def test_the_anthropic_client_skips_the_network_on_its_own_httpx(fresh_model):
    """anthropic may build on another httpx package than openai (anthropic 1.17+ on httpx2, openai 2 on
    httpx): its client gets a transport of its own package (tests/test_sdk_previous_majors.py runs this with
    those two), and is recorded by a capture like openai's."""
    import anthropic

    from artrl.sdk_http import httpx_package

    client = fresh_model.anthropic_client()
    transport = client._client._transport
    assert type(transport).__name__ == "GatewayTransport"
    assert isinstance(transport, httpx_package(anthropic.DefaultAsyncHttpxClient).AsyncBaseTransport)
    async with artrl.capture(fresh_model) as cap:
        message = await client.messages.create(
            model=fresh_model.name, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert message.content and cap.trajectory.choices()[0].token_ids


async def test_streaming_and_errors_through_the_in_process_transport(fresh_model):
    model = fresh_model
    client = model.openai_client()
    whole = await client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=10, seed=3)
    stream = await client.chat.completions.create(
        model=model.name, messages=MESSAGES, max_tokens=10, seed=3, stream=True
    )
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content
    with pytest.raises(openai.NotFoundError, match="not served here"):
        await client.chat.completions.create(model="nobody", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=model.name, messages=[{"role": "nobody"}], max_tokens=2)


async def test_the_sync_client_skips_the_network_too(fresh_model):
    model = fresh_model
    kwargs = dict(model=model.name, messages=MESSAGES, max_tokens=10, seed=5)

    def calls() -> tuple[str, str, str, str]:
        direct = model.openai_sync_client()
        assert _transport_name(direct) == "SyncGatewayTransport"
        over_http = openai.OpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
        a = direct.chat.completions.create(**kwargs).choices[0].message.content
        b = over_http.chat.completions.create(**kwargs).choices[0].message.content
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in direct.chat.completions.create(**kwargs, stream=True)
            if c.choices
        )
        try:
            direct.chat.completions.create(**{**kwargs, "model": "nobody"})
        except openai.NotFoundError as exc:
            error = str(exc)
        return a, b, streamed, error

    a, b, streamed, error = await asyncio.to_thread(calls)  # (a blocking caller in its own thread)
    assert a == b == streamed and "not served here" in error


async def test_calls_inside_a_capture_block_are_recorded(fresh_model):
    import artrl

    model = fresh_model
    async with artrl.capture(model) as cap:
        await model.openai_client().chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=3)
    assert len(cap.records) == 1


async def test_a_client_timeout_stops_the_generation(slow):
    """The client gives up (its read timeout): the gateway sees a disconnect, as over HTTP, and aborts."""
    httpx2 = openai_httpx()

    engine, service = slow()
    async with httpx2.AsyncClient(transport=service.server.transport(), timeout=0.5) as client:
        with pytest.raises(httpx2.ReadTimeout):
            await client.post(
                "http://gateway/v1/chat/completions",
                json={"model": "slow", "messages": MESSAGES, "max_tokens": 2000},
            )
    (stream,) = await engine.started()
    assert await aborted(stream)


async def test_a_caller_whose_loop_closed_costs_the_gateway_no_error(slow, caplog):
    """A call timed out inside its own `asyncio.run` (a synchronous wrapper, a script): its loop is closed by
    the time the gateway answers the disconnect; the gateway drops that answer quietly."""
    import threading

    httpx2 = openai_httpx()
    engine, service = slow()
    transport = service.server.transport()

    async def call() -> None:
        async with httpx2.AsyncClient(transport=transport, timeout=0.3) as client:
            with contextlib.suppress(httpx2.ReadTimeout):
                await client.post(
                    "http://gateway/v1/chat/completions",
                    json={"model": "slow", "messages": MESSAGES, "max_tokens": 2000},
                )

    thread = threading.Thread(target=lambda: asyncio.run(call()))
    thread.start()
    thread.join(10)
    (stream,) = await engine.started()
    await aborted(stream)
    await asyncio.sleep(0.5)  # the route's 499 goes to the closed loop
    assert stream.aborted
    assert not [r for r in caplog.records if "error id" in r.getMessage()]  # (no 500 logged)


async def test_a_stream_closed_early_stops_the_generation(slow):
    httpx2 = openai_httpx()

    engine, service = slow()
    body = {"model": "slow", "messages": MESSAGES, "max_tokens": 2000, "stream": True}
    client = httpx2.AsyncClient(transport=service.server.transport(), timeout=5)
    async with client, client.stream("POST", "http://gateway/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                break  # leaves the block: the body is closed unread
    (stream,) = await engine.started()
    assert await aborted(stream)


async def test_a_sync_client_timeout_stops_the_generation(slow):
    httpx2 = openai_httpx()
    engine, service = slow()

    def call() -> None:
        with httpx2.Client(transport=service.server.transport(sync=True), timeout=0.5) as client:
            client.post(
                "http://gateway/v1/chat/completions",
                json={"model": "slow", "messages": MESSAGES, "max_tokens": 2000},
            )

    with pytest.raises(httpx2.ReadTimeout):
        await asyncio.to_thread(call)
    (stream,) = await engine.started()
    assert await aborted(stream)


async def test_a_stopped_gateway_is_a_connection_error_not_a_hang(slow):
    httpx2 = openai_httpx()

    _, service = slow()
    transport = service.server.transport()
    service.server.stop()
    async with httpx2.AsyncClient(transport=transport, timeout=5) as client:
        with pytest.raises(httpx2.TransportError, match=r"not running|closed"):
            await asyncio.wait_for(client.get("http://gateway/health"), 10)


async def test_http_clients_when_in_process_clients_is_off(tiny_model_dir, tmp_path):
    import artrl

    backend = artrl.LocalBackend(path=tmp_path, gateway=GatewayConfig(in_process_clients=False))
    model = artrl.TrainableModel(name="m", project="p", base_model=str(tiny_model_dir))
    await model.register(backend)
    try:
        client = model.openai_client()
        assert _transport_name(client) != "GatewayTransport"
        out = await client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=3)
        assert out.choices[0].message is not None
        # a client aimed elsewhere (an override of base_url) never takes the in-process path
        assert _transport_name(model.openai_client(base_url="http://127.0.0.1:9/v1")) != "GatewayTransport"
    finally:
        await backend.close()
