"""Load and fault figures on the real embedded engine (the tiny model): many concurrent multi-turn agent
sessions with zero errors and memory that does not grow, and storms of clients that give up, whose work is
cancelled and whose memory comes back. The figures are printed (docs/reliability.md quotes them)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import statistics
import time

import httpx
import pytest

pytestmark = pytest.mark.slow
SESSIONS, TURNS, TOKENS = 256, 3, 16


def rss_mib() -> float:
    """This process's resident memory once freed memory is handed back: what is still held, not glibc's
    high-water mark of earlier tests in the same worker (which depends on what ran before, and how)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def session(model, i: int, latencies: list[float]) -> int:
    client = model.openai_client()
    messages = [{"role": "user", "content": f"session {i}: what is the weather in paris?"}]
    for turn in range(TURNS):
        started = time.perf_counter()
        response = await client.chat.completions.create(
            model=model.name, messages=messages, max_tokens=TOKENS, seed=i * 10 + turn
        )
        latencies.append(time.perf_counter() - started)
        messages += [
            {"role": "assistant", "content": response.choices[0].message.content or ""},
            {"role": "user", "content": "and tomorrow?"},
        ]
    return TURNS


async def test_concurrent_sessions_with_zero_errors_and_flat_memory(fresh_model):
    figures = {"sessions": SESSIONS, "turns": TURNS, "max_tokens": TOKENS, "rss_start_mib": round(rss_mib())}
    for round_ in (1, 2):
        latencies: list[float] = []
        started = time.perf_counter()
        results = await asyncio.gather(
            *(session(fresh_model, i, latencies) for i in range(SESSIONS)), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        figures[f"round{round_}"] = {
            "calls": len(latencies),
            "seconds": round(time.perf_counter() - started, 1),
            "p50_ms": round(statistics.median(latencies) * 1000),
            "p95_ms": round(sorted(latencies)[int(0.95 * len(latencies))] * 1000),
            "errors": len(errors),
            "rss_mib": round(rss_mib()),
        }
    growth = figures["round2"]["rss_mib"] - figures["round1"]["rss_mib"]
    print(f"\nLOAD FIGURES: {json.dumps(figures)}")
    # the second round runs in the memory of the first: round 1 already paid the first-use costs and raised
    # the allocator's high-water mark (which glibc keeps), so the bound does not depend on the test order
    # (seen: +2 MiB in docs/reliability.md's run, +12 to +22 MiB on a loaded 2-core machine and pinned to one
    # core); it still catches a leak of 85 KiB or more per call (64 MiB / 768 calls)
    assert growth < 64, figures


async def test_storms_of_clients_that_give_up_are_cancelled(fresh_model):
    service = fresh_model._backend.service(fresh_model)
    url = f"{fresh_model.inference_base_url}/chat/completions"
    body = {"model": fresh_model.name, "messages": [{"role": "user", "content": "go"}], "max_tokens": 1500}

    async def leaves_a_stream(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", url, json={**body, "stream": True}) as response:
            async for _ in response.aiter_lines():
                return  # the first chunk, then away

    async def times_out() -> None:
        async with httpx.AsyncClient(timeout=0.3) as impatient:
            with contextlib.suppress(httpx.TimeoutException):
                await impatient.post(url, json=body)

    async def storm() -> float:
        """Seconds from the storm's start until every abandoned generation has left the batch."""
        started = time.perf_counter()
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(
                *(leaves_a_stream(client) for _ in range(64)), *(times_out() for _ in range(64))
            )
        engine = service.engine
        # (well within seconds on an idle machine; the deadline only guards against a hang, however loaded)
        deadline = time.monotonic() + 120
        while (engine._steps.batch.sequences or engine._steps.pending) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not engine._steps.batch.sequences and not engine._steps.pending
        return time.perf_counter() - started

    async def still_serving() -> None:
        reply = await fresh_model.openai_client().chat.completions.create(
            model=fresh_model.name, messages=[{"role": "user", "content": "still there?"}], max_tokens=4
        )
        assert reply.choices[0].finish_reason in ("stop", "length")

    # The first storm and call in a process pay first-use costs (imports, torch's kernels and threads); from
    # after them, a second storm shows what a storm leaves behind. Both readings are taken once freed memory
    # is handed back (rss_mib), so what ran before in this pytest worker does not count.
    await storm()
    await still_serving()
    before = rss_mib()
    drained = await storm()
    await still_serving()
    figures = {"clients": 128, "drained_seconds": round(drained, 2), "rss_before_mib": round(before)}
    figures["rss_after_mib"] = round(rss_mib())
    print(f"\nSTORM FIGURES: {json.dumps(figures)}")
    assert figures["rss_after_mib"] - before < 128, figures
