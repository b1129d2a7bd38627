"""Keys and values of recently finished sequences, reused by a later prompt that starts with their tokens.

An agent's next call is its previous prompt + what it sampled + a tool result; the gateway sends exactly
those ids (token-exact continuation), so the engine can skip re-computing the shared part: the new request
prefills only its suffix on top of the cached keys and values. The same holds for another rollout of the
same scenario (same system prompt and tools). Entries are dropped least-recently-used beyond a byte budget,
and all of them whenever the weights change (a training step).

Lookup is by hashed blocks of tokens (as vLLM's prefix caching): each entry is indexed under the chained
hash of every full block of its ids, so a prompt's longest cached start is found by walking its own block
hashes, then comparing exactly only with the few entries at the deepest block it shares, instead of
scanning every entry (thousands of them for a small model within the byte budget).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from artrl.local.kv_cache import left_pad


@dataclass
class CachedPrefix:
    ids: tuple[int, ...]  # tokens whose keys and values are held (a prompt + its sampled tokens but the last)
    keys: list[torch.Tensor]  # per layer (1, H, P, D)
    values: list[torch.Tensor]  # per layer (1, H, P, D)
    hashes: list[int] = field(default_factory=list)  # its block hashes, once it is in a cache's index

    def __post_init__(self) -> None:
        self.tensor = torch.tensor(self.ids, dtype=torch.long)  # (P,) for comparing with prompts

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass
class PrefixMatch:
    entry: CachedPrefix
    length: int  # how many of its first tokens the prompt shares (its keys/values [:, :, :length] serve)


@dataclass
class PrefixStats:
    hits: int = 0
    tokens_reused: int = 0
    tokens_prefilled: int = 0


BLOCK_TOKENS = 16  # tokens per hashed block (at most min_tokens)


def block_hashes(ids: tuple[int, ...] | list[int], block: int) -> Iterator[int]:
    """The chained hash of each full block of ids, lazily: the i-th stands for ids[: (i + 1) * block]."""
    h = 0
    for start in range(0, len(ids) - block + 1, block):
        h = hash((h, tuple(ids[start : start + block])))
        yield h


class PrefixCache:
    def __init__(self, max_bytes: int, min_tokens: int) -> None:
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.block = max(1, min(BLOCK_TOKENS, min_tokens))
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()
        self._index: dict[int, dict[tuple[int, ...], None]] = {}  # block hash -> entries holding that start
        self._bytes = 0
        self.stats = PrefixStats()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Hold the keys and values (per layer (1, H, len(ids), D), owned by the cache from now on)."""
        if len(ids) < self.min_tokens:
            return
        entry = CachedPrefix(tuple(ids), keys, values)
        size = entry.nbytes
        if size > self.max_bytes:
            return
        if entry.ids in self._entries:
            self._drop(entry.ids)
        while self._entries and self._bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[entry.ids] = entry
        self._bytes += size
        entry.hashes = list(block_hashes(entry.ids, self.block))  # (kept: dropping it needs them again)
        for h in entry.hashes:
            self._index.setdefault(h, {})[entry.ids] = None

    def _drop(self, ids: tuple[int, ...]) -> None:
        entry = self._entries.pop(ids)
        self._bytes -= entry.nbytes
        for h in entry.hashes:
            holders = self._index.get(h)
            if holders is not None:
                holders.pop(ids, None)
                if not holders:
                    del self._index[h]

    def longest(self, prompt: list[int]) -> PrefixMatch | None:
        """The entry sharing the longest start with the prompt (at least min_tokens), leaving at least one
        prompt token to prefill (its logits give the first sampled token)."""
        limit = len(prompt) - 1
        if limit < self.min_tokens or not self._entries:
            return None
        candidates: dict[tuple[int, ...], None] = {}
        for h in block_hashes(prompt[:limit], self.block):  # the deepest block shared with some entry
            holders = self._index.get(h)
            if holders is None:
                break
            candidates = holders
        if not candidates:
            return None
        wanted = torch.tensor(prompt[:limit], dtype=torch.long)  # (limit,)
        best: PrefixMatch | None = None
        for ids in candidates:  # (exact comparison: a hash collision shares nothing)
            entry = self._entries[ids]
            m = min(len(entry.ids), limit)
            if m < self.min_tokens or (best is not None and m <= best.length):
                continue
            differ = (entry.tensor[:m] != wanted[:m]).nonzero()  # (k, 1)
            shared = int(differ[0, 0]) if len(differ) else m
            if shared >= self.min_tokens and (best is None or shared > best.length):
                best = PrefixMatch(entry, shared)
                if shared == limit:  # (one group's rollouts: many entries hold all of it; any will do)
                    break
        if best is not None:
            self._entries.move_to_end(best.entry.ids)
        return best

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self._bytes = 0


def stacked_states(reused: list[tuple[CachedPrefix | None, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (R, H, P, D) keys and values: row i holds the first n_i cached tokens of its entry,
    left-padded to the longest (P); [] when no row reuses anything."""
    width = max(n for _, n in reused)
    if not width:
        return []
    some = next(entry for entry, n in reused if entry is not None and n)  # (shapes for rows without)
    rows = [(entry or some, n) for entry, n in reused]
    return [
        (
            torch.cat([left_pad(entry.keys[layer][:, :, :n], width, 2) for entry, n in rows]),
            torch.cat([left_pad(entry.values[layer][:, :, :n], width, 2) for entry, n in rows]),
        )
        for layer in range(len(some.keys))
    ]


def common_start(prompts: list[list[int]]) -> int:
    """How many first tokens all the prompts share, leaving each at least one to prefill."""
    limit = min(len(p) for p in prompts) - 1
    shared = 0
    while shared < limit and all(p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    return shared
