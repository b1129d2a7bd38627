"""Backpressure: a client that gives up stops its generation; the gateway bounds the requests in flight;
the embedded engine bounds the tokens of one batched prefill."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fakes import SlowEngine, aborted

from artrl.config import EngineConfig
from artrl.local.engine.hf.engine import HFEngine
from artrl.local.engine.hf.sampling import SamplingParams

BODY = {"model": "slow", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2000}


async def test_a_client_that_gives_up_stops_its_generation(slow):
    """A non-streaming call whose client disconnected kept generating to max_tokens (and the SDK's retries
    tripled the work); now the gateway notices within a fraction of a second and aborts it."""
    engine, service = slow()
    base_url = service.base_url
    async with httpx.AsyncClient(timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{base_url}/chat/completions", json=BODY)
    (stream,) = await engine.started()
    assert await aborted(stream)  # after ~0.5 s of a 100 s generation


async def test_a_stream_whose_client_leaves_stops_too(slow):
    engine, service = slow()
    base_url = service.base_url
    url = f"{base_url}/chat/completions"
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream("POST", url, json={**BODY, "stream": True}) as r,
    ):
        async for _ in r.aiter_lines():
            break  # the first chunk, then leave
    (stream,) = await engine.started()
    assert await aborted(stream)


async def test_requests_beyond_the_in_flight_limit_get_a_429(slow):
    # (the two held requests stay in flight until released, however slowly the third one gets through)
    engine, service = slow(SlowEngine(held=True), max_inflight_requests=2)
    base_url = service.base_url
    async with httpx.AsyncClient(timeout=30) as client:
        try:
            held = [
                asyncio.create_task(
                    client.post(f"{base_url}/chat/completions", json={**BODY, "max_tokens": 2})
                )
                for _ in range(2)
            ]
            await engine.started(2)  # both generating
            refused = await client.post(f"{base_url}/chat/completions", json=BODY)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_requests"
        finally:
            engine.release()
        assert all(r.status_code == 200 for r in await asyncio.gather(*held))
        assert (
            await client.post(f"{base_url}/chat/completions", json={**BODY, "max_tokens": 2})
        ).status_code == 200


async def test_a_prefill_holds_at_most_its_token_budget(tiny_model_dir):
    from fakes import instrumented_model
    from transformers import AutoModelForCausalLM

    prefills: list[tuple[int, int]] = []  # (rows, columns) of each prefill

    def count(input_ids, position_ids) -> None:
        if input_ids.shape[1] > 1:
            prefills.append(tuple(input_ids.shape))

    model = instrumented_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), count)
    # (no prefix cache: identical prompts would share one prefill of their common start)
    engine = HFEngine(
        model, max_context=2048, config=EngineConfig(max_prefill_tokens=250, prefix_cache_bytes=0)
    )
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        # 6 x 100 tokens, one of 390, all different (identical prompts would share one prefill row)
        prompts = [list(range(10 + i, 110 + i)) for i in range(6)] + [list(range(10, 400))]
        streams = [engine.generate(p, params, 1)[0] for p in prompts]
        for stream in streams:
            assert len([c async for c in stream]) == 2
    finally:
        await engine.close()
    assert all(rows * width <= 250 or rows == 1 for rows, width in prefills), prefills
    assert sum(rows for rows, _ in prefills) == 7
