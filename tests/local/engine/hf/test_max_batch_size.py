"""EngineConfig.max_batch_size holds: a request with more sequences than the batch has free rows waits for
them (it joins no batch it would overfill); one alone larger than the whole batch still runs."""

from __future__ import annotations

import asyncio

from artrl.config import EngineConfig
from artrl.local.engine.hf.engine import HFEngine
from artrl.local.engine.hf.sampling import SamplingParams

LONG = [[5, 17, 300, 42], [6, 18, 301], [7, 19, 302, 43, 8]]
WIDE = [9, 20, 303, 44]


def params(max_tokens: int) -> SamplingParams:  # (no stop token: every row runs to its max_tokens)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=())


async def tokens(stream) -> list[int]:
    return [c.token_id async for c in stream]


async def test_a_request_wider_than_the_free_rows_waits_for_them(hf_model):
    from fakes import instrumented_model

    decode_rows: list[int] = []  # each decode step's rows (fused decode off: every step is a forward)

    def record(input_ids, position_ids) -> None:
        if input_ids.shape[1] == 1:
            decode_rows.append(input_ids.shape[0])

    config = EngineConfig(max_batch_size=4, fused_decode=False, prefix_cache_bytes=0)
    engine = HFEngine(instrumented_model(hf_model, record), max_context=2048, config=config)
    try:
        running = [engine.generate(p, params(40), 1)[0] for p in LONG]
        firsts = [await anext(aiter(s)) for s in running]  # all three run: one row of four is free
        wide = engine.generate(WIDE, params(8), 4)  # n=4: it waits for the three to end
        done = await asyncio.wait_for(asyncio.gather(*map(tokens, [*running, *wide])), timeout=120)
        assert [len(t) for t in done] == [39, 39, 39, 8, 8, 8, 8] and len(firsts) == 3
        alone = engine.generate(WIDE, params(3), 6)  # wider than the whole batch: it runs, alone
        assert [len(t) for t in await asyncio.gather(*map(tokens, alone))] == [3] * 6
    finally:
        await engine.close()
    assert max(decode_rows[:-2]) == 4, decode_rows  # never 3 running + 4 joining = 7 rows
    assert decode_rows[-2:] == [6, 6]
