"""`artrl.capture`: unchanged agent code is recorded by the gateway (the real tiny model, and scripted tools)."""

from __future__ import annotations

import asyncio
import itertools
import json
import types

import httpx
import openai
import pytest
from fakes import encode
from shop_tools import TOOLS  # the shop's one tool, as the golden transcripts render it

import artrl
from artrl.config import EngineConfig, GatewayConfig
from artrl.local.train.rows import trajectory_rows


async def agent(
    client, model: str, task: str, turns: int = 2, seed: int = 0, max_tokens: int = 8
) -> str | None:
    """Agent code that knows nothing of artrl: its own message list, tool results or a nudge each turn."""
    messages = [{"role": "system", "content": "You are a shop assistant."}, {"role": "user", "content": task}]
    for turn in range(turns):
        response = await client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens, seed=seed + turn
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # what many agents do
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "go on"})
    return message.content


def assert_chained(traj: artrl.Trajectory, turns: int) -> None:
    choices = traj.choices()
    assert len(choices) == turns
    assert traj.messages_and_choices[-1] is choices[-1]
    for before, after in itertools.pairwise(choices):
        prefix = before.prompt_token_ids + before.token_ids
        assert after.prompt_token_ids[: len(prefix)] == prefix
        assert after.prompt_source == "continuation"
    for c in choices:
        assert c.token_ids and len(c.token_logprobs) == len(c.token_ids)


async def test_unchanged_agent_through_model_client_is_captured(served, tokenizer):
    client = served.openai_client()  # made before the block: still recorded inside it
    async with artrl.capture(served) as cap:
        await agent(client, served.name, "How many apples?", turns=2)
    traj = cap.trajectory
    assert_chained(traj, 2)
    assert traj.tools == TOOLS and traj.additional_histories == []
    assert traj.messages()[1] == {"role": "user", "content": "How many apples?"}
    (row,) = trajectory_rows(traj, 0, tokenizer, allow_rendered=False)
    last = traj.choices()[-1]
    assert row.ids == last.prompt_token_ids + last.token_ids


async def test_captured_trajectories_train(fresh_model):
    model = fresh_model
    trajectories = []
    for reward in (1.0, 0.0):
        async with artrl.capture(model) as cap:
            await agent(model.openai_client(), model.name, "Apples?", turns=2, seed=int(reward))
        cap.trajectory.reward = reward
        trajectories.append(cap.trajectory)
    result = await model.train([artrl.TrajectoryGroup(trajectories)])
    assert result.step == 1 and result.metrics["rows"] == 2


async def test_per_capture_base_url_records_any_client(served):
    async with artrl.capture(served) as cap:
        assert cap.base_url.endswith(f"/capture/{cap.id}/v1")
        plain = openai.AsyncOpenAI(base_url=cap.base_url, api_key="x", max_retries=0)
        models = await plain.models.list()
        assert [m.id for m in models.data] == ["tiny", "tiny@0"]
        await plain.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "one"}], max_tokens=3
        )
        async with httpx.AsyncClient(timeout=30) as http:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "two"}], "max_tokens": 3}
            response = await http.post(f"{cap.base_url}/chat/completions", json=body)
            assert response.status_code == 200
        await cap.openai_client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "three"}], max_tokens=3
        )
    histories = [cap.trajectory, *cap.trajectory.additional_histories]
    assert sorted(h.messages()[0]["content"] for h in histories) == ["one", "three", "two"]
    assert all(h.choices()[0].token_ids for h in histories)


async def test_concurrent_captures_sharing_one_client_do_not_mix(served):
    client = served.openai_client()

    async def rollout(i: int) -> artrl.Capture:
        async with artrl.capture(served) as cap:
            await agent(client, "tiny", f"task {i}", turns=3, seed=10 * i)
        return cap

    caps = await asyncio.gather(*(rollout(i) for i in range(4)))
    for i, cap in enumerate(caps):
        # every call of task i, and only those, whatever the continuation matching made of the chain
        # (a sampled message that the agent's model_dump round trip does not reproduce is rendered afresh,
        # and then becomes an additional history: it failed once in a loaded full run)
        assert len(cap.records) == 3
        histories = [cap.trajectory, *cap.trajectory.additional_histories]
        assert {h.messages()[1]["content"] for h in histories} == {f"task {i}"}
        assert all(c.token_ids for h in histories for c in h.choices())


async def test_sub_agent_becomes_an_additional_history_and_is_trained(served, tokenizer):
    client = served.openai_client()
    async with artrl.capture(served) as cap:
        messages = [{"role": "user", "content": "Plan a trip"}]
        first = (await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)).choices[
            0
        ]
        sub = [{"role": "system", "content": "You summarise."}, {"role": "user", "content": "Summarise it"}]
        await client.chat.completions.create(model="tiny", messages=sub, max_tokens=4)
        messages += [
            {"role": "assistant", "content": first.message.content},
            {"role": "user", "content": "ok"},
        ]
        await asyncio.to_thread(  # synchronous agent code is recorded too
            served.openai_sync_client().chat.completions.create, model="tiny", messages=messages, max_tokens=6
        )
    traj = cap.trajectory
    assert_chained(traj, 2)
    (history,) = traj.additional_histories
    assert history.messages()[0]["content"] == "You summarise."
    rows = trajectory_rows(traj, 0, tokenizer, allow_rendered=False)
    (side,) = history.choices()
    assert [r.ids for r in rows][1] == side.prompt_token_ids + side.token_ids
    assert [r.weight for r in rows] == [0.5, 0.5]


async def test_streaming_call_is_recorded_with_token_ids(served):
    async with artrl.capture(served) as cap:
        stream = await served.openai_client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "stream"}], max_tokens=6, stream=True, seed=4
        )
        ids, text = None, ""
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                ids = getattr(c, "token_ids", None) or ids
    (choice,) = cap.trajectory.choices()
    assert choice.token_ids == ids and choice.message.content == text
    assert len(choice.token_logprobs) == len(ids) and choice.prompt_token_ids


async def test_unknown_message_keys_are_not_captured(served):
    """A capture keeps of a message only the keys the gateway reads: whatever else a client sends along
    (here 1 KB of it) is neither stored in the capture nor trained on."""
    hi = {"role": "user", "content": "hi", "junk": "x" * 1000}
    async with artrl.capture(served) as cap:
        body = {"model": "tiny", "messages": [hi], "max_tokens": 2}
        async with httpx.AsyncClient(timeout=30) as http:
            response = await http.post(f"{cap.base_url}/chat/completions", json=body)
            assert response.status_code == 200, response.text
    (record,) = cap.records
    assert record["messages"] == [{"role": "user", "content": "hi"}]
    assert cap.trajectory.messages()[0] == {"role": "user", "content": "hi"}


async def test_errors_are_clear(served):
    async with artrl.capture(served) as cap:
        pass
    base = served.inference_base_url
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    async with httpx.AsyncClient(timeout=30) as http:
        for response in (
            await http.post(f"{cap.base_url}/chat/completions", json=body),  # closed: unknown now
            await http.post(f"{base}/chat/completions", json=body, headers={"X-Artrl-Capture": "nope"}),
            await http.get(f"{base.removesuffix('/v1')}/capture/nope/v1/models"),
            await http.delete(f"{base}/captures/nope"),
        ):
            assert response.status_code == 404
            error = response.json()["error"]
            assert error["code"] == "capture_not_found" and "is not open on this gateway" in error["message"]
        # closing again (a client whose first reply was lost) gets the same records, for a grace period
        again = await http.delete(f"{base}/captures/{cap.id}")
        assert again.status_code == 200 and again.json()["records"] == []
    with pytest.raises(ValueError, match="boom"):  # the block's error wins, the capture is still closed
        async with artrl.capture(served) as cap:
            raise ValueError("boom")


async def test_calls_outside_the_block_are_not_recorded(served):
    client = served.openai_client()
    outside = [{"role": "user", "content": "outside"}]
    await client.chat.completions.create(model="tiny", messages=outside, max_tokens=2)
    async with artrl.capture(served) as cap:
        await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "in"}], max_tokens=2
        )
        await asyncio.sleep(0)
    await client.chat.completions.create(model="tiny", messages=outside, max_tokens=2)
    assert [h.messages()[0]["content"] for h in [cap.trajectory, *cap.trajectory.additional_histories]] == [
        "in"
    ]


async def test_scripted_tool_calls_and_api_key(tokenizer):
    """Deterministic tool calls (scripted engine) on a keyed gateway: the key guards the capture routes."""
    from fakes import ScriptedEngine

    from artrl.local.service.service import LocalService

    engine = ScriptedEngine()
    service = LocalService.serve(
        "scripted", None, tokenizer, engine, EngineConfig(), GatewayConfig(api_key="k")
    )
    try:
        call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "apple"}}\n</tool_call><|im_end|>'
        engine.scripts = [encode(tokenizer, call), encode(tokenizer, "42 apples.<|im_end|>")]
        keyed = types.SimpleNamespace(inference_base_url=service.base_url, inference_api_key="k")
        async with artrl.capture(keyed) as cap:
            async with httpx.AsyncClient() as http:  # no key: refused
                denied = await http.post(f"{cap.base_url}/chat/completions", json={})
                assert denied.status_code == 401
            assert await agent(cap.openai_client(), "scripted", "Apples?", max_tokens=64) == "42 apples."
        traj = cap.trajectory
        first, second = traj.choices()
        assert json.loads(first.message.tool_calls[0].function.arguments) == {"key": "apple"}
        assert first.token_ids == encode(tokenizer, call)
        assert traj.messages_and_choices[3]["role"] == "tool"
        assert second.prompt_source == "continuation"
        (row,) = trajectory_rows(traj, 0, tokenizer, allow_rendered=False)
        assert row.ids == second.prompt_token_ids + second.token_ids
    finally:
        service.server.stop()


class LossyRelay:
    """A TCP relay to a gateway that loses the answer to the first capture open and the first close: the
    gateway acts on them, but the connection drops before the client reads the answer."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.to_lose = [b"POST /v1/captures ", b"DELETE /v1/captures/"]
        self.lost: list[bytes] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.relay, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"

    async def relay(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        gateway_in, gateway_out = await asyncio.open_connection("127.0.0.1", self.target_port)
        losing = asyncio.Event()

        async def requests() -> None:
            while chunk := await client_in.read(65536):
                for start in list(self.to_lose):
                    if chunk.startswith(start):
                        self.to_lose.remove(start)
                        self.lost.append(start)
                        losing.set()
                gateway_out.write(chunk)
                await gateway_out.drain()
            gateway_out.close()

        async def answers() -> None:
            while chunk := await gateway_in.read(65536):
                if losing.is_set():
                    break  # the gateway answered; the client never sees it
                client_out.write(chunk)
                await client_out.drain()
            client_out.close()

        pump = asyncio.ensure_future(requests())
        await answers()
        pump.cancel()
        gateway_out.close()


async def test_a_lost_answer_to_opening_or_closing_is_asked_again(tokenizer, caplog):
    """Opening and closing a capture are retried when no answer comes back: the block still opens, and the
    second close returns the records the first one took (the gateway keeps them for a grace period)."""
    from fakes import ScriptedEngine

    from artrl.local.service.service import LocalService

    engine = ScriptedEngine()
    service = LocalService.serve("scripted", None, tokenizer, engine, EngineConfig(), GatewayConfig())
    relay = LossyRelay(service.server.port)
    try:
        lossy = types.SimpleNamespace(inference_base_url=await relay.start(), inference_api_key="x")
        engine.scripts = [encode(tokenizer, "Hello.<|im_end|>")]
        async with artrl.capture(lossy) as cap:
            await cap.openai_client(max_retries=0).chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": "Hi"}], max_tokens=8
            )
        assert relay.lost == [b"POST /v1/captures ", b"DELETE /v1/captures/"]
        asked_again = [r.getMessage() for r in caplog.records if "asking again" in r.getMessage()]
        assert len(asked_again) == 2 and "open a capture (POST" in asked_again[0], asked_again
        assert [m["content"] for m in cap.trajectory.messages()] == ["Hi", "Hello."]
        assert cap.trajectory.choices()[0].token_ids == encode(tokenizer, "Hello.<|im_end|>")
    finally:
        relay.server.close()
        service.server.stop()


async def test_a_gateway_that_never_answers_is_a_clear_error():
    """Nothing listening (or nothing answering) at the model's URL: a CaptureError that says so, after the
    tries, not a bare transport error."""
    held = []  # its connections, kept open
    listener = await asyncio.start_server(lambda r, w: held.append(w), "127.0.0.1", 0)  # never answers
    port = listener.sockets[0].getsockname()[1]
    silent = types.SimpleNamespace(inference_base_url=f"http://127.0.0.1:{port}/v1", inference_api_key="x")
    try:
        with pytest.raises(
            artrl.CaptureError, match=r"no answer from the gateway .* after 3 tries \(ReadTimeout"
        ):
            async with artrl.capture(silent, timeout=0.2):
                pass
    finally:
        listener.close()
