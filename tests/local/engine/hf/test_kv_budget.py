"""The running batch's KV cache budget (issue 43 item 10): every row is padded to the longest, so a request
joins only while rows × the longest row's prompt + max_tokens × bytes per token stays within
EngineConfig.kv_cache_budget_bytes; a long request at the head waits for the batch to drain (the short ones
behind it wait too: no overtaking), one request alone always runs, and every one ends as if alone."""

from __future__ import annotations

import asyncio

from artrl.config import EngineConfig
from artrl.local.engine.hf.engine import HFEngine
from artrl.local.engine.hf.sampling import SamplingParams

LONG = list(range(200, 240))  # 40 tokens, + 60 to generate: a row of 100 columns
SHORTS = [[5, 17, 300, 42], [6, 18, 301], [7, 19, 302, 43, 8], [9, 20, 303, 44]]  # + 8: rows of <= 13
FIRST = [11, 12, 13, 14]  # + 30: a short row already running when the long one comes


async def tokens(stream) -> list[int]:
    return [c.token_id async for c in stream]


def params(max_tokens: int) -> SamplingParams:  # (no stop token: every row runs to its max_tokens)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=())


async def test_a_long_request_runs_without_short_ones_padded_to_it(hf_model):
    from fakes import instrumented_model

    config = hf_model.config  # keys and values of one token across layers, fp32:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    # 80 columns: the long row alone is over it (and runs), a short row beside it too; 6 short rows fit
    budget = 80 * token_bytes
    prefills: list[list[int]] = []  # each prefill's rows, as the requests' indices (their last prompt token)
    decodes: list[list[int]] = []  # each decode step's rows, as their position ids
    requests = [(FIRST, params(30)), (LONG, params(60)), *((p, params(8)) for p in SHORTS)]
    last_tokens = [p[-1] for p, _ in requests]

    def record(input_ids, position_ids) -> None:
        if input_ids.shape[1] == 1:
            decodes.append(position_ids[:, 0].tolist())
        else:
            prefills.append(sorted(last_tokens.index(t) for t in input_ids[:, -1].tolist()))

    settings = {"fused_decode": False, "prefix_cache_bytes": 0}
    alone_engine = HFEngine(hf_model, max_context=2048, config=EngineConfig(**settings))
    engine = HFEngine(
        instrumented_model(hf_model, record),
        max_context=2048,
        config=EngineConfig(kv_cache_budget_bytes=budget, **settings),
    )
    try:
        alone = [await tokens(alone_engine.generate(p, s, 1)[0]) for p, s in requests]
        streams = [engine.generate(p, s, 1)[0] for p, s in requests]
        together = await asyncio.wait_for(asyncio.gather(*map(tokens, streams)), timeout=120)
        assert together == alone  # every request ends, with its tokens as if alone
        assert [len(t) for t in together] == [30, 60, 8, 8, 8, 8]
    finally:
        await alone_engine.close()
        await engine.close()
    # in order: the first short one alone; then the long one, alone (over the budget itself; a short row
    # beside it too), the short ones behind it waiting (not passing it); then those together (4 × 13 columns)
    assert prefills == [[0], [1], [2, 3, 4, 5]]
    long_steps = [p for p in decodes if max(p) >= len(LONG)]  # (the long row's positions from 40 on)
    assert long_steps and all(len(p) == 1 for p in long_steps)  # never with a row padded to its 100 columns
    assert max(len(p) for p in decodes) == len(SHORTS)
    assert engine._steps.token_bytes == token_bytes  # (measured at a prefill: the config's estimate too)


def test_the_config_estimates_the_cached_token_bytes(hf_model):
    from fakes import instrumented_model

    from artrl.local.engine.hf.kv_cache import cached_token_bytes

    config = hf_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    assert cached_token_bytes(hf_model) == token_bytes
    assert cached_token_bytes(instrumented_model(hf_model, lambda *_: None)) == token_bytes  # (wrapped)
