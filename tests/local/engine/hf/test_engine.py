"""The embedded engine: continuous batching gives the same tokens as serving alone, requests join a
running batch, aborts free their rows, and n/seed behave."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
import torch
from tolerances import assert_logprobs_close

from artrl.config import EngineConfig
from artrl.local.engine.hf.engine import HFEngine
from artrl.local.engine.hf.sampling import SamplingParams, top_p_filter
from artrl.local.kernels.cpu_attention import use_cpu_attention


@pytest.fixture
async def engine(hf_model):
    engine = HFEngine(hf_model, max_context=2048, config=EngineConfig(max_batch_size=16))
    yield engine
    await engine.close()


async def collect(engine, prompt, params, n=1):
    return [[c.token_id async for c in s] for s in engine.generate(prompt, params, n)]


def greedy_by_full_forwards(model, prompt: list[int], n: int) -> list[int]:
    """The n greedy tokens after `prompt`, each from a full forward pass over everything so far (no cache)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@contextlib.contextmanager
def requests_admitted_together(engine):
    """While the block runs, the engine thread is held inside a job that started *before* the block: every
    request sent in the block waits in the engine's queue, and the thread takes them all in one admission
    after the block (its queue is drained at once). Deterministic on any machine, however slow or busy: it
    waits for the job to start, rather than sleeping and hoping the requests arrive in time."""
    started, release = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(60)

    held = engine.call(hold, changes_weights=False)  # (a job that changes nothing: cached prefixes stay)
    assert started.wait(60), "the engine thread never ran the holding job"
    try:
        yield
    finally:
        release.set()
        held.result(timeout=60)


PROMPTS = [[5, 17, 300, 42], [7, 8, 9, 10, 11, 12, 13, 14, 99], [1500], list(range(100, 160))]


async def test_batched_equals_alone_and_matches_transformers_generate(engine, hf_model):
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    alone = [(await collect(engine, p, greedy))[0] for p in PROMPTS]
    together = await asyncio.gather(*(collect(engine, p, greedy) for p in PROMPTS))
    assert [t[0] for t in together] == alone
    for prompt, ids in zip(PROMPTS, alone, strict=True):
        reference = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert reference[0, len(prompt) :].tolist() == ids


async def test_requests_with_one_prompt_share_one_prefill_row_and_sample_as_if_alone(hf_model):
    """A group's rollouts sent one by one (same prompt, their own seeds): one prefill row for all of them."""
    from fakes import instrumented_model

    rows: list[int] = []
    model = instrumented_model(
        hf_model, lambda ids, _: rows.append(ids.shape[0]) if ids.shape[1] > 1 else None
    )
    engine = HFEngine(model, max_context=2048, config=EngineConfig(prefix_cache_bytes=0))
    try:
        seeded = [SamplingParams(max_tokens=10, temperature=1.0, seed=s) for s in (1, 2, 3)]
        alone = [(await collect(engine, PROMPTS[3], p))[0] for p in seeded]
        rows.clear()
        with requests_admitted_together(engine):  # all six in one admission
            streams = [
                engine.generate(p, params, 1)[0] for p in (PROMPTS[3], PROMPTS[0]) for params in seeded
            ]
        together = [[c.token_id async for c in s] for s in streams]
    finally:
        await engine.close()
    assert rows == [2]  # six requests, two prompts: one prefill of two rows
    assert together[:3] == alone and len(set(map(tuple, alone))) == 3


async def test_a_cache_that_grows_past_its_room_still_matches_transformers_generate(engine, hf_model):
    """The batch's KV buffers start with room for 64 more tokens and grow by at least 64: 150 greedy tokens
    cross two growths, with a second request joining (and the merged buffers re-made) half-way."""
    greedy = SamplingParams(max_tokens=150, temperature=0.0)
    first = asyncio.ensure_future(collect(engine, PROMPTS[0], greedy))
    await asyncio.sleep(0.05)
    second = await collect(engine, PROMPTS[3], SamplingParams(max_tokens=40, temperature=0.0))
    ids = (await first)[0]
    for prompt, got in ((PROMPTS[0], ids), (PROMPTS[3], second[0])):
        assert len(got) in (150, 40)
        assert greedy_by_full_forwards(hf_model, prompt, len(got)) == got


async def test_seeded_sampling_is_the_same_alone_or_batched(engine):
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=s) for s in range(len(PROMPTS))]
    alone = [await collect(engine, p, sp, n=2) for p, sp in zip(PROMPTS, params, strict=True)]
    together = await asyncio.gather(
        *(collect(engine, p, sp, n=2) for p, sp in zip(PROMPTS, params, strict=True))
    )
    assert together == alone
    assert all(a[0] != a[1] for a in alone)  # the n samples of one request differ


async def test_logprobs_equal_a_full_forward_pass(engine, hf_model):
    prompt = PROMPTS[1]
    stream = engine.generate(prompt, SamplingParams(max_tokens=10, seed=0), 1)[0]
    choices = [c async for c in stream]
    ids = prompt + [c.token_id for c in choices]
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0]  # (T, V)
    logprobs = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]  # (n, V)
    expected = logprobs.gather(1, torch.tensor([c.token_id for c in choices])[:, None])[:, 0]
    assert_logprobs_close([c.logprob for c in choices], expected.tolist())  # (other kernels)


async def test_short_request_does_not_wait_for_a_long_one(engine):
    """Counted in the long request's tokens, not in seconds (a busy machine cannot make it flake)."""
    progress: list[int] = []

    async def long_request() -> None:
        stream = engine.generate(PROMPTS[0], SamplingParams(max_tokens=400, temperature=1.0, seed=1), 1)[0]
        async for choice in stream:
            progress.append(choice.token_id)

    long = asyncio.create_task(long_request())
    while len(progress) < 5:
        await asyncio.sleep(0.001)
    before = len(progress)
    short = await collect(engine, PROMPTS[1], SamplingParams(max_tokens=3, temperature=1.0, seed=2))
    during = len(progress) - before
    assert len(short[0]) == 3
    await long
    assert len(progress) == 400
    assert during < 100, during  # 3 token steps inside the long request's batch, not 395 after it


async def test_abort_frees_the_row_and_others_continue(engine):
    streams = engine.generate(PROMPTS[0], SamplingParams(max_tokens=500, temperature=1.0, seed=3), 2)
    first = streams[0]
    got = 0
    async for _ in first:
        got += 1
        if got == 5:
            first.abort()
            break
    other = [c async for c in streams[1]]
    assert len(other) == 500
    assert streams[1].finish_reason == "length"


async def test_stop_token_ends_with_stop(engine):
    probe = (await collect(engine, PROMPTS[2], SamplingParams(max_tokens=8, temperature=0.0)))[0]
    stop_id = probe[3]
    stream = engine.generate(
        PROMPTS[2], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=frozenset({stop_id})), 1
    )[0]
    ids = [c.token_id async for c in stream]
    assert ids == probe[: probe.index(stop_id) + 1]
    assert stream.finish_reason == "stop"


async def test_context_limit_ends_with_length(hf_model):
    engine = HFEngine(hf_model, max_context=20, config=EngineConfig())
    try:
        stream = engine.generate(list(range(10, 25)), SamplingParams(max_tokens=100, temperature=1.0), 1)[0]
        ids = [c.token_id async for c in stream]
        assert len(ids) == 5
        assert stream.finish_reason == "length"
    finally:
        await engine.close()


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert torch.allclose(top_p_filter(probs, 0.7), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.allclose(top_p_filter(probs, 0.5), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert torch.allclose(top_p_filter(probs, 1.0), probs)


def test_a_stream_whose_loop_closed_reports_aborted_instead_of_raising():
    from artrl.local.engine.contract import SequenceStream
    from artrl.local.engine.hf.sampling import TokenChoice

    loop = asyncio.new_event_loop()
    stream = SequenceStream(loop)
    loop.close()
    stream.push(TokenChoice(1, -0.1))  # would raise in the engine thread and take it down
    stream.end("stop")
    assert stream.aborted


async def test_a_continued_prompt_reuses_the_cached_prefix_and_samples_the_same(engine, hf_model):
    """An agent's next call (its prompt + what it sampled + a tool result) prefills only the new tokens on
    top of the finished sequence's keys and values: same greedy tokens as full forwards, same logprobs as an
    engine without the cache; a training job (any engine.call) empties the cache."""
    first = list(range(100, 160))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    sampled = (await collect(engine, first, greedy))[0]
    follow_up = first + sampled + [5, 6, 7]
    before = engine.prefix_cache.stats.tokens_reused
    stream = engine.generate(follow_up, greedy, 1)[0]
    choices = [c async for c in stream]
    assert engine.prefix_cache.stats.tokens_reused - before == len(first) + len(sampled) - 1
    assert [c.token_id for c in choices] == greedy_by_full_forwards(hf_model, follow_up, len(choices))
    uncached = HFEngine(hf_model, max_context=2048, config=EngineConfig(prefix_cache_bytes=0))
    try:
        plain = [c async for c in uncached.generate(follow_up, greedy, 1)[0]]
    finally:
        await uncached.close()
    assert uncached.prefix_cache.stats.hits == 0
    assert [c.token_id for c in plain] == [c.token_id for c in choices]
    assert_logprobs_close([c.logprob for c in choices], [c.logprob for c in plain])
    cached = len(engine.prefix_cache)
    assert cached > 0
    await asyncio.wrap_future(engine.call(lambda: None, changes_weights=False))  # (a checkpoint write)
    assert len(engine.prefix_cache) == cached
    await asyncio.wrap_future(engine.call(lambda: None))  # a training step: the cache is stale
    assert len(engine.prefix_cache) == 0


async def test_requests_admitted_together_share_their_common_start(engine, hf_model):
    """Rollouts of one scenario (one system prompt) arriving together: the common start is computed once and
    each row prefills only its own rest, the padding in between masked; tokens as with full forwards."""
    shared = list(range(200, 260))
    prompts = [shared + [7] * k + [11, 12] for k in (1, 3, 6)]
    before = engine.prefix_cache.stats.tokens_reused
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    with requests_admitted_together(engine):
        streams = [engine.generate(p, greedy, 1)[0] for p in prompts]
    results = [[c.token_id async for c in s] for s in streams]
    common = len(shared) + 1  # + the first 7
    rest = max(len(p) for p in prompts) - common  # every row computes its last `rest` tokens
    assert engine.prefix_cache.stats.tokens_reused - before == sum(len(p) - rest for p in prompts)
    for prompt, got in zip(prompts, results, strict=True):
        assert greedy_by_full_forwards(hf_model, prompt, len(got)) == got


async def test_requests_with_different_cached_prefixes_prefill_together(engine, hf_model):
    """Two agents' next calls (each continuing its own finished sequence) and a fresh prompt, sent at once:
    each row reuses its own prefix up to where the rows' common rest begins (no padding between a row's
    tokens); tokens as full forwards."""
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    firsts = [list(range(300, 340)), list(range(500, 560))]
    sampled = [(await collect(engine, p, greedy))[0] for p in firsts]
    prompts = [p + s + [9, 8, 7][: k + 1] for k, (p, s) in enumerate(zip(firsts, sampled, strict=True))]
    prompts.append(list(range(700, 720)))
    before = engine.prefix_cache.stats.tokens_reused
    with requests_admitted_together(engine):
        streams = [engine.generate(p, greedy, 1)[0] for p in prompts]
    results = [[c.token_id async for c in stream] for stream in streams]
    cached = [len(p) + len(s) - 1 for p, s in zip(firsts, sampled, strict=True)] + [0]
    rest = max(len(p) - c for p, c in zip(prompts, cached, strict=True))  # the fresh prompt: all of it
    assert engine.prefix_cache.stats.tokens_reused - before == sum(max(0, len(p) - rest) for p in prompts)
    for prompt, got in zip(prompts, results, strict=True):
        assert greedy_by_full_forwards(hf_model, prompt, len(got)) == got


async def test_reused_prefixes_leave_no_gap_a_sliding_window_would_count():
    """A sliding-window model (window 16): rows reusing different cached prefixes in one prefill must keep
    their tokens contiguous; padding between them would push real tokens out of the window (this gave other
    tokens than full forward passes before the rows were aligned)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=0,
        layer_types=["sliding_attention", "sliding_attention"],
    )
    model = Qwen3ForCausalLM(config).eval()
    assert use_cpu_attention(model)  # (what loading a model does; a directly built one asks itself)
    engine = HFEngine(model, max_context=1024, config=EngineConfig(prefix_cache_min_tokens=8))
    assert model.config._attn_implementation == "artrl_cpu"  # decode steps honour the window too
    try:
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        firsts = [list(range(10, 50)), list(range(100, 140))]
        sampled = [(await collect(engine, p, greedy))[0] for p in firsts]
        prompts = [firsts[0] + sampled[0] + [7], firsts[1] + sampled[1] + list(range(200, 230))]
        with requests_admitted_together(engine):
            streams = [engine.generate(p, greedy, 1)[0] for p in prompts]
        results = [[c.token_id async for c in stream] for stream in streams]
        assert engine.prefix_cache.stats.hits >= 2
    finally:
        await engine.close()
    for prompt, got in zip(prompts, results, strict=True):
        assert greedy_by_full_forwards(model, prompt, len(got)) == got


async def test_the_engine_thread_ends_when_idle_and_the_next_request_starts_another(hf_model):
    """An idle engine thread ends (its OpenMP team with it: idle teams slow busy ones on a CPU) and the next
    request or job starts a new one; sampling with a seed gives the same tokens across the restart."""
    engine = HFEngine(hf_model, max_context=2048, config=EngineConfig(engine_thread_idle_s=0.05))
    try:
        seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
        first = await collect(engine, PROMPTS[1], seeded, n=2)
        # the engine thread, named from inside it (read from outside, it may already have ended: 0.05 s idle)
        ended = await engine.run_exclusive(threading.current_thread, changes_weights=False)
        deadline = time.monotonic() + 60  # (a guard against a thread that never ends, not a speed test)
        while engine._thread is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert engine._thread is None and ended is not None
        await asyncio.to_thread(ended.join, 60)
        assert not ended.is_alive()
        assert await collect(engine, PROMPTS[1], seeded, n=2) == first  # a new thread
        assert await engine.run_exclusive(threading.current_thread, changes_weights=False) is not ended
        assert await engine.run_exclusive(lambda: 42) == 42
        # requests racing the thread's decision to end: none is left behind
        for _ in range(20):
            await asyncio.sleep(0.05)
            got = await asyncio.wait_for(collect(engine, PROMPTS[0], seeded), 10)
            assert len(got[0]) == 8
    finally:
        await engine.close()
    assert engine._thread is None or not engine._thread.is_alive()


async def test_generation_threads_for_token_steps_and_the_default_for_jobs(hf_model):
    """`generation_threads`: prefill and decode with that many torch threads, jobs (training) with torch's
    default, on the engine thread; the same greedy tokens as with the default."""
    default = torch.get_num_threads()
    expected = [[greedy_by_full_forwards(hf_model, p, 6)] for p in PROMPTS[:2]]
    seen: list[int] = []
    # (the embeddings: every token step starts there, through the forward or the fused steps)
    embeddings = hf_model.get_input_embeddings()
    hook = embeddings.register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    engine = HFEngine(hf_model, max_context=2048, config=EngineConfig(generation_threads=1))
    try:
        assert await collect(engine, PROMPTS[1], greedy) == expected[1]
        assert seen and set(seen) == {1}
        assert await engine.run_exclusive(torch.get_num_threads) == default
        seen.clear()
        assert await collect(engine, PROMPTS[0], greedy) == expected[0]
        assert seen and set(seen) == {1}  # (back to one thread after the job)
        # an engine made afterwards (its thread starts while the first one's count is 1) keeps the default
        other = HFEngine(hf_model, max_context=2048, config=EngineConfig())
        try:
            seen.clear()
            await collect(other, PROMPTS[0], greedy)
            assert seen and set(seen) == {default}
            assert await other.run_exclusive(torch.get_num_threads) == default
        finally:
            await other.close()
    finally:
        await engine.close()
        hook.remove()
    assert torch.get_num_threads() == default  # (this thread's setting untouched)


async def test_the_prefill_hands_the_head_a_contiguous_last_position(hf_model):
    """A batched prefill through the transformers forward (a model outside the fused steps' layouts)
    computes logits for each row's last position only, from a contiguous (B, 1, E) copy: torch's bf16 linear
    on the strided view that `logits_to_keep=1` slices took ~200 ms instead of ~0.3 ms for the 27M model's
    head at 31 rows. The tokens stay those of full forwards."""
    seen: list[tuple[int, bool]] = []  # (rows, contiguous) of every input the head gets
    head = hf_model.get_output_embeddings()
    hook = head.register_forward_pre_hook(
        lambda module, args: seen.append((args[0].shape[0], args[0].is_contiguous()))
    )
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    config = EngineConfig(max_batch_size=16, fused_decode=False)
    engine = HFEngine(hf_model, max_context=2048, config=config)
    try:
        prompts = [PROMPTS[1], PROMPTS[3]]  # one batched prefill of two rows, 9 and 60 tokens
        with requests_admitted_together(engine):
            streams = [engine.generate(p, greedy, 1)[0] for p in prompts]
        together = [[c.token_id async for c in s] for s in streams]
        assert together == [greedy_by_full_forwards(hf_model, p, 4) for p in prompts]
    finally:
        await engine.close()
        hook.remove()
    assert seen[0][0] == 2  # the prefill: both rows at once (a strided one-row slice would look contiguous)
    assert all(contiguous for _, contiguous in seen)
