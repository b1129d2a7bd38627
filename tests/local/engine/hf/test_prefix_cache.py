"""The prefix cache's bookkeeping: longest match, at least one token left to prefill, LRU within a budget."""

from __future__ import annotations

import torch

from artrl.local.engine.hf.prefix_cache import PrefixCache, SharedStates


def states(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.zeros(1, 1, n, 4)], [torch.zeros(1, 1, n, 4)]  # 2 x n x 16 bytes


def test_the_longest_shared_start_wins_and_one_token_is_left_to_prefill():
    cache = PrefixCache(max_bytes=10_000, min_tokens=2)
    cache.put([1, 2, 3], *states(3))
    cache.put([1, 2, 3, 4, 5], *states(5))
    cache.put([9, 9, 9], *states(3))
    match = cache.longest([1, 2, 3, 4, 5, 6])
    assert (match.entry.ids, match.length) == ((1, 2, 3, 4, 5), 5)
    match = cache.longest([1, 2, 3, 4, 5])  # all of it cached: the last token still prefills
    assert (match.entry.ids, match.length) == ((1, 2, 3, 4, 5), 4)
    match = cache.longest([1, 2, 3, 7, 7, 7])  # an entry that goes on differently serves its shared start
    assert match.length == 3
    assert cache.longest([1, 5, 5, 5]) is None  # one shared token: under min_tokens
    assert cache.longest([1]) is None


def test_short_prefixes_are_not_kept_and_the_budget_evicts_the_least_recently_used():
    cache = PrefixCache(max_bytes=3 * 2 * 10 * 16, min_tokens=4)  # three 10-token entries
    cache.put([1, 2, 3], *states(3))
    assert len(cache) == 0
    for first in (1, 2, 3):
        cache.put([first] * 10, *states(10))
    assert cache.longest([1] * 11).length == 10  # 1 is used: 2 is now the least recently used
    cache.put([4] * 10, *states(10))
    assert len(cache) == 3 and cache.longest([2] * 11) is None and cache.longest([1] * 11) is not None
    cache.put([5] * 100, *states(100))  # larger than the whole budget: not kept, nothing evicted
    assert len(cache) == 3
    cache.clear()
    assert len(cache) == 0 and cache.longest([1] * 11) is None


def test_entries_that_share_memory_count_it_once_and_free_it_with_the_last():
    """A finished batch's rows copied in one block (views per entry): the block's bytes are counted while any
    entry holds it, so the budget bounds the memory really held."""
    entry = 2 * 10 * 16  # a 10-token entry of its own
    cache = PrefixCache(
        max_bytes=3 * entry + 2 * entry - 1, min_tokens=4
    )  # a 3-row block + one entry + a bit
    block = torch.zeros(3, 1, 10, 4)  # three rows, left-padded to 10 tokens
    rows = [(1, 10), (2, 6), (3, 2)]
    cache.put_shared(
        [
            ([r] * n, [block[i : i + 1, :, 10 - n :]], [block[i : i + 1, :, 10 - n :]], None)
            for i, (r, n) in enumerate(rows)
        ],
        SharedStates(3 * entry),
    )
    assert len(cache) == 2 and cache._bytes == 3 * entry  # (the 2-token row: under min_tokens)
    cache.put([4] * 10, *states(10))
    assert cache.longest([1] * 11).length == 10  # least recently used now: 2, then 4, then 1
    cache.put([5] * 10, *states(10))  # 2 goes (its block stays: 1 holds it), then 4
    assert cache.longest([2] * 7) is None and cache.longest([4] * 11) is None
    assert cache.longest([1] * 11).length == 10 and cache._bytes == 3 * entry + entry
    cache.put([6] * 10, *states(10))  # 5 goes
    cache.put([7] * 10, *states(10))  # 1 goes, the block's last holder: its memory is free again
    assert cache.longest([1] * 11) is None and len(cache) == 2 and cache._bytes == 2 * entry
    cache.clear()
    assert cache._bytes == 0 and len(cache) == 0


def test_the_block_index_finds_the_same_match_as_a_scan_of_every_entry():
    """Many entries sharing starts of every length (one system prompt, then agents and turns): the indexed
    lookup agrees with comparing the prompt against every entry, also after evictions."""
    import random

    rng = random.Random(0)
    system = [rng.randrange(1, 50) for _ in range(40)]
    cache = PrefixCache(max_bytes=100 * 2 * 80 * 16, min_tokens=32)
    kept: list[list[int]] = []
    for agent in range(60):
        ids = system + [agent] + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 60))]
        for _turn in range(3):
            cache.put(ids, *states(len(ids)))
            kept.append(ids)
            ids = ids + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))]
    alive = [ids for ids in kept if (None, tuple(ids)) in cache._entries]
    assert 0 < len(alive) < len(kept)  # the budget evicted some
    for prompt in [*kept[-40:], [*system[:35], 7, 7], [*system, 999, 1, 2], [3] * 50]:
        prompt = [*prompt, 5]
        best = max((_shared(e, prompt) for e in alive), default=0)
        match = cache.longest(prompt)
        assert (match.length if match else 0) == (best if best >= 32 else 0)


def _shared(entry: list[int], prompt: list[int]) -> int:
    n = 0
    while n < min(len(entry), len(prompt) - 1) and entry[n] == prompt[n]:
        n += 1
    return n


def test_stacked_states_left_pad_each_rows_cached_start():
    from artrl.local.engine.hf.kv_cache import left_pad
    from artrl.local.engine.hf.prefix_cache import CachedPrefix, stacked_states

    g = torch.Generator().manual_seed(0)

    def entry(length: int) -> CachedPrefix:
        return CachedPrefix(
            tuple(range(length)),
            [torch.randn(1, 2, length, 4, generator=g) for _ in range(3)],
            [torch.randn(1, 2, length, 4, generator=g) for _ in range(3)],
        )

    a, b = entry(9), entry(5)
    reused = [(a, 7), (None, 0), (b, 5), (a, 3)]  # rows reuse 7, none, 5 and 3 tokens
    got = stacked_states(reused)
    assert len(got) == 3
    for layer, (keys, values) in enumerate(got):
        for states, kind in ((keys, "keys"), (values, "values")):
            expected = torch.cat(
                [
                    left_pad(getattr(e, kind)[layer][:, :, :n], 7, 2)
                    if e is not None
                    else torch.zeros(1, 2, 7, 4)
                    for e, n in reused
                ]
            )  # (R, H, P, D)
            assert torch.equal(states, expected)
    assert stacked_states([(None, 0), (a, 0)]) == []
