"""The prefix cache's bookkeeping: longest match, at least one token left to prefill, LRU within a budget."""

from __future__ import annotations

import torch

from artrl.local.prefix_cache import PrefixCache


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
    alive = [ids for ids in kept if tuple(ids) in cache._entries]
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
