"""Keys and values of recently finished sequences, reused by a later prompt that starts with their tokens.

An agent's next call is its previous prompt + what it sampled + a tool result; the gateway sends exactly
those ids (token-exact continuation), so the engine can skip re-computing the shared part: the new request
prefills only its suffix on top of the cached keys and values. The same holds for another rollout of the
same scenario (same system prompt and tools). Entries are dropped least-recently-used beyond a byte budget,
and all of them whenever the weights change (a training step). An engine serving several adapters at once
(a training server's models) keeps each adapter's entries apart: a prompt reuses only keys and values that
its own adapter computed, and one adapter's training step drops only its entries.

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

Key = tuple[str | None, tuple[int, ...]]  # an entry's adapter and ids


@dataclass
class SharedStates:
    """Memory that several entries' keys and values are views of (the rows of one finished batch, copied
    with one operation per layer): counted once, while any of them is in the cache."""

    nbytes: int
    holders: int = 0


@dataclass
class CachedPrefix:
    ids: tuple[int, ...]  # tokens whose keys and values are held (a prompt + its sampled tokens but the last)
    keys: list[torch.Tensor]  # per layer (1, H, P, D)
    values: list[torch.Tensor]  # per layer (1, H, P, D)
    hashes: list[int] = field(default_factory=list)  # its block hashes, once it is in a cache's index
    shared: SharedStates | None = None  # None: the tensors are its own
    adapter: str | None = None  # the adapter that computed them (None: the model as it is)

    def __post_init__(self) -> None:
        self.tensor = torch.tensor(self.ids, dtype=torch.long)  # (P,) for comparing with prompts

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def key(self) -> Key:
        return (self.adapter, self.ids)


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


def block_hashes(ids: tuple[int, ...] | list[int], block: int, adapter: str | None = None) -> Iterator[int]:
    """The chained hash of each full block of ids, lazily: the i-th stands for ids[: (i + 1) * block] (as
    computed by `adapter`: another adapter's chain starts elsewhere)."""
    h = 0 if adapter is None else hash(adapter)
    for start in range(0, len(ids) - block + 1, block):
        h = hash((h, tuple(ids[start : start + block])))
        yield h


class PrefixCache:
    def __init__(self, max_bytes: int, min_tokens: int) -> None:
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.block = max(1, min(BLOCK_TOKENS, min_tokens))
        self._entries: OrderedDict[Key, CachedPrefix] = OrderedDict()  # by (adapter, ids)
        self._index: dict[int, dict[Key, None]] = {}  # block hash -> entries holding that start
        self._bytes = 0
        self.stats = PrefixStats()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], adapter: str | None = None
    ) -> None:
        """Hold the keys and values (per layer (1, H, len(ids), D), owned by the cache from now on)."""
        self.put_shared([(ids, keys, values, adapter)], None)

    def put_shared(
        self,
        entries: list[tuple[list[int], list[torch.Tensor], list[torch.Tensor], str | None]],
        shared: SharedStates | None,
    ) -> None:
        """Hold several entries (ids, per-layer (1, H, len(ids), D) keys and values, the adapter that computed
        them); with `shared`, their tensors are views of that memory, counted once (and freed with the last
        of them)."""
        entries = [e for e in entries if len(e[0]) >= self.min_tokens]
        if not entries:
            return
        made = [
            CachedPrefix(tuple(ids), keys, values, shared=shared, adapter=adapter)
            for ids, keys, values, adapter in entries
        ]
        size = shared.nbytes if shared is not None else sum(e.nbytes for e in made)
        if size > self.max_bytes:
            return
        for entry in made:
            if entry.key in self._entries:
                self._drop(entry.key)
        while self._entries and self._bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        for entry in made:
            if entry.key in self._entries:  # (the same ids twice in one batch: the first one stays)
                continue
            self._entries[entry.key] = entry
            self._bytes += self._charge(entry)
            # (kept: dropping it needs them again)
            entry.hashes = list(block_hashes(entry.ids, self.block, entry.adapter))
            for h in entry.hashes:
                self._index.setdefault(h, {})[entry.key] = None

    @staticmethod
    def _charge(entry: CachedPrefix) -> int:
        """Bytes the entry adds to the cache (its shared memory: only as its first holder)."""
        if entry.shared is None:
            return entry.nbytes
        entry.shared.holders += 1
        return entry.shared.nbytes if entry.shared.holders == 1 else 0

    def _drop(self, key: Key) -> None:
        entry = self._entries.pop(key)
        if entry.shared is None:
            self._bytes -= entry.nbytes
        else:
            entry.shared.holders -= 1
            if entry.shared.holders == 0:
                self._bytes -= entry.shared.nbytes
        for h in entry.hashes:
            holders = self._index.get(h)
            if holders is not None:
                holders.pop(key, None)
                if not holders:
                    del self._index[h]

    def longest(self, prompt: list[int], adapter: str | None = None) -> PrefixMatch | None:
        """The entry of `adapter` sharing the longest start with the prompt (at least min_tokens), leaving at
        least one prompt token to prefill (its logits give the first sampled token)."""
        limit = len(prompt) - 1
        if limit < self.min_tokens or not self._entries:
            return None
        candidates: dict[Key, None] = {}
        for h in block_hashes(prompt[:limit], self.block, adapter):  # the deepest block shared with an entry
            holders = self._index.get(h)
            if holders is None:
                break
            candidates = holders
        if not candidates:
            return None
        wanted = torch.tensor(prompt[:limit], dtype=torch.long)  # (limit,)
        best: PrefixMatch | None = None
        for key in candidates:  # (exact comparison: a hash collision shares nothing)
            entry = self._entries[key]
            if entry.adapter != adapter:
                continue
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
            self._entries.move_to_end(best.entry.key)
        return best

    def clear_adapter(self, adapter: str) -> None:
        """Drop the entries that `adapter` computed (its weights changed, or it is gone)."""
        for key in [k for k in self._entries if k[0] == adapter]:
            self._drop(key)

    def clear(self) -> None:
        for entry in self._entries.values():
            if entry.shared is not None:
                entry.shared.holders = 0
        self._entries.clear()
        self._index.clear()
        self._bytes = 0


def stacked_states(reused: list[tuple[CachedPrefix | None, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (R, H, P, D) keys and values: row i holds the first n_i cached tokens of its entry,
    left-padded to the longest (P); [] when no row reuses anything. A few operations per layer whatever the
    rows (one concatenation, one scattered copy): an operation per row and layer handed the interpreter lock
    to the agents' threads hundreds of times per prefill."""
    width = max(n for _, n in reused)
    if not width:
        return []
    rows = [(i, entry, n) for i, (entry, n) in enumerate(reused) if entry is not None and n]
    first = rows[0][1].keys[0]  # (1, H, P_entry, D)
    heads, dim = first.shape[1], first.shape[3]
    # where each cached token lands among the R·P positions: row i's n tokens in its last n columns
    where = torch.tensor(
        [i * width + width - n + t for i, _, n in rows for t in range(n)], device=first.device
    )  # (N,)
    out = []
    for layer in range(len(rows[0][1].keys)):
        pair = []
        for kind in ("keys", "values"):
            flat = torch.cat(
                [getattr(entry, kind)[layer][0, :, :n] for _, entry, n in rows], dim=1
            )  # (H, N, D)
            padded = flat.new_zeros(heads, len(reused) * width, dim)  # (H, R·P, D)
            padded.index_copy_(1, where, flat)
            pair.append(padded.view(heads, len(reused), width, dim).transpose(0, 1))  # (R, H, P, D)
        out.append((pair[0], pair[1]))
    return out


def common_start(prompts: list[list[int]]) -> int:
    """How many first tokens all the prompts share, leaving each at least one to prefill."""
    limit = min(len(p) for p in prompts) - 1
    shared = 0
    while shared < limit and all(p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    return shared
