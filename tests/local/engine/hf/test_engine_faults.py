"""One bad request fails only itself: a prompt whose prefill fails, a sequence whose decode step fails, or a
temperature so small that 1/T overflows; every other sequence in the batch finishes as if alone."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys

import openai
import pytest
import torch

from artrl.config import EngineConfig
from artrl.local.engine.contract import EngineError
from artrl.local.engine.hf.engine import HFEngine
from artrl.local.engine.hf.sampling import SamplingParams

POISON = 1234  # a prompt holding this token fails at prefill
FAIL_AT = (
    57  # a decode step at this position fails (only the sequence whose prompt is 50 tokens long gets there)
)


def faults(input_ids, position_ids) -> None:
    """Fails the way an out-of-memory or a kernel error would, for one input only."""
    if input_ids.shape[1] > 1 and bool((input_ids == POISON).any()):
        raise RuntimeError("simulated out of memory in prefill")
    if input_ids.shape[1] == 1 and bool((position_ids == FAIL_AT).any()):
        raise RuntimeError("simulated kernel failure in decode")


async def tokens(stream) -> list[int]:
    return [c.token_id async for c in stream]


GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
PROMPTS = [[5, 17, 300, 42], list(range(100, 130))]


async def test_a_failing_prefill_or_decode_fails_only_its_sequence(hf_model):
    healthy = HFEngine(hf_model, max_context=2048, config=EngineConfig())
    from fakes import instrumented_model

    faulty = HFEngine(instrumented_model(hf_model, faults), max_context=2048, config=EngineConfig())
    try:
        alone = [await tokens(healthy.generate(p, GREEDY, 1)[0]) for p in PROMPTS]
        streams = [faulty.generate(p, GREEDY, 1)[0] for p in PROMPTS]
        bad_prefill = faulty.generate([7, POISON, 9], GREEDY, 1)[0]
        bad_decode = faulty.generate(list(range(300, 350)), GREEDY, 1)[0]  # reaches position 57
        results = await asyncio.gather(
            *map(tokens, [*streams, bad_prefill, bad_decode]), return_exceptions=True
        )
        assert results[:2] == alone  # the healthy requests in the same batches finish as if alone
        assert isinstance(results[2], EngineError) and "prefill" in str(results[2])
        assert isinstance(results[3], EngineError) and "decode" in str(results[3])
        assert await tokens(faulty.generate(PROMPTS[0], GREEDY, 1)[0]) == alone[0]  # and the engine goes on
    finally:
        await healthy.close()
        await faulty.close()


async def test_a_vanishing_temperature_samples_greedily(served):
    """temperature 1e-40 used to make 1/T overflow and fail every sequence of the batch."""
    client = served.openai_client()
    messages = [{"role": "user", "content": "What is the weather in paris?"}]
    others = [
        client.chat.completions.create(model=served.name, messages=messages, max_tokens=12, seed=s)
        for s in range(4)
    ]
    tiny = client.chat.completions.create(
        model=served.name, messages=messages, max_tokens=12, temperature=1e-40
    )
    greedy = await client.chat.completions.create(
        model=served.name, messages=messages, max_tokens=12, temperature=0
    )
    results = await asyncio.gather(tiny, *others)
    assert results[0].choices[0].token_ids == greedy.choices[0].token_ids
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)


async def test_a_request_failure_is_a_500_for_that_request_only(served):
    client = served.openai_client()
    with pytest.raises(openai.BadRequestError):  # a client mistake stays a 4xx
        await client.chat.completions.create(model=served.name, messages=[], max_tokens=4)


async def test_a_stream_that_gets_nothing_fails_instead_of_hanging():
    from artrl.local.engine.contract import SequenceStream

    stream = SequenceStream(asyncio.get_running_loop(), idle_timeout_s=0.2)
    started = asyncio.get_running_loop().time()
    with pytest.raises(EngineError, match=r"sent nothing for 0\.2 s"):
        async for _ in stream:
            pass
    # (a guard, not a speed test: a stream that hung would wait for the 1800 s default or forever)
    assert asyncio.get_running_loop().time() - started < 30 and stream.aborted


async def test_closing_the_engine_ends_everything_queued_behind_the_close(hf_model):
    """Work queued after the close's sentinel (a call racing the close) used to wait forever."""
    import threading
    from concurrent.futures import Future

    from artrl.local.engine.contract import SequenceStream
    from artrl.local.engine.hf.engine import _Job
    from artrl.local.engine.hf.sequences import Request, RunningSequence

    engine = HFEngine(hf_model, max_context=2048, config=EngineConfig())
    started, release = threading.Event(), threading.Event()

    def job() -> bool:
        started.set()
        return release.wait()

    busy = engine.call(job)  # the engine thread is inside a job (a training step, say)
    # (once it is: a job still queued when the close comes is ended with the rest, as a loaded CI machine showed)
    assert await asyncio.to_thread(started.wait, 30)
    closing = asyncio.create_task(engine.close())
    await asyncio.sleep(0.1)
    late_job = _Job(lambda: 1, Future())
    late_stream = SequenceStream(asyncio.get_running_loop())
    engine._incoming.put(late_job)  # behind the close's sentinel
    engine._incoming.put(Request([1, 2], [RunningSequence(late_stream, GREEDY, None)]))
    release.set()
    await asyncio.wait_for(closing, 10)
    assert busy.result() is True
    with pytest.raises(RuntimeError, match="engine closed"):
        late_job.future.result(timeout=5)
    assert [t async for t in late_stream] == [] and late_stream.finish_reason == "abort"


def test_a_row_that_cannot_be_sampled_fails_alone():
    from artrl.local.engine.hf.sampling import SamplingError, sample_rows

    logits = torch.tensor([[0.0, 1.0, 2.0], [float("nan")] * 3, [2.0, 1.0, 0.0]])  # (3, V)
    params = [SamplingParams(max_tokens=1, temperature=t) for t in (0.0, 1.0, 1.0)]
    first, bad, third = sample_rows(logits, params, [None, None, random.Random(0)])
    assert first.token_id == 2 and isinstance(bad, SamplingError) and third.token_id in (0, 1, 2)


SHARED_POISON = 2222  # in the shared start of two prompts: their common-prefix forward fails (and their own)


def shared_start_faults(input_ids, position_ids) -> None:
    if input_ids.shape[1] > 1 and bool((input_ids == SHARED_POISON).any()):
        raise RuntimeError("simulated out of memory in the shared start's prefill")


async def test_a_failing_shared_start_fails_only_the_requests_that_share_it(hf_model):
    """The forward of two new prompts' common start runs before each prompt's own, isolated prefill: when it
    fails, the sequence already decoding goes on as if alone, and the two new requests fail within seconds
    (before the fix: the running one failed too, and the two waited for the stream's 30-minute timeout)."""
    from fakes import instrumented_model

    running = list(range(400, 420))
    start = [SHARED_POISON, *range(500, 539)]  # 40 tokens shared, above the prefix cache's minimum
    new = [[*start, 600, 601], [*start, 700]]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    healthy = HFEngine(hf_model, max_context=2048, config=EngineConfig())
    faulty = HFEngine(
        instrumented_model(hf_model, shared_start_faults), max_context=2048, config=EngineConfig()
    )
    try:
        alone = await tokens(healthy.generate(running, params, 1)[0])
        chunks = aiter(faulty.generate(running, params, 1)[0])
        first = await asyncio.wait_for(anext(chunks), 30)  # it is in the running batch now
        later = [faulty.generate(p, params, 1)[0] for p in new]
        results = await asyncio.wait_for(
            asyncio.gather(tokens(chunks), *map(tokens, later), return_exceptions=True), 30
        )
        assert [first.token_id, *results[0]] == alone
        assert all(isinstance(r, EngineError) and "shared start" in str(r) for r in results[1:]), results[1:]
        assert await tokens(faulty.generate(running, params, 1)[0]) == alone  # and the engine goes on
    finally:
        await healthy.close()
        await faulty.close()


UNCLOSED = """
import asyncio, atexit, sys
from transformers import AutoModelForCausalLM
from artrl.config import EngineConfig
from artrl.local.engine.hf.engine import HFEngine
from artrl.local.engine.hf.sampling import SamplingParams

engines = []


def report():  # registered before the engine's own hook: runs after it (last in, first out)
    thread = engines[0]._worker.current
    print("stopped" if engines[0]._closed and (thread is None or not thread.is_alive()) else "running")


atexit.register(report)


async def main():
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
    engines.append(HFEngine(model, max_context=2048, config=EngineConfig()))
    (stream,) = engines[0].generate([5, 17, 300], SamplingParams(max_tokens=4), 1)
    assert len([c async for c in stream]) == 4


asyncio.run(main())  # and exit without closing the engine, as ART's scripts leave their backend
"""


def test_an_engine_nobody_closed_stops_its_thread_at_exit(tiny_model_dir):
    """At exit, its daemon thread must not be frozen inside a torch op (it keeps the prefix cache after the
    last answer): that aborts the process ("terminate called without an active exception", rc -6)."""
    done = subprocess.run(
        [sys.executable, "-c", UNCLOSED, str(tiny_model_dir)], capture_output=True, text=True, timeout=300
    )
    assert (done.returncode, done.stdout.strip()) == (0, "stopped"), done.stderr[-3000:]
