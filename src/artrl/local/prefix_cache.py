"""Keys and values of recently finished sequences, reused by a later prompt that starts with their tokens.

An agent's next call is its previous prompt + what it sampled + a tool result; the gateway sends exactly
those ids (token-exact continuation), so the engine can skip re-computing the shared part: the new request
prefills only its suffix on top of the cached keys and values. The same holds for another rollout of the
same scenario (same system prompt and tools). Entries are dropped least-recently-used beyond a byte budget,
and all of them whenever the weights change (a training step).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from artrl.local.kv_cache import left_pad


@dataclass
class CachedPrefix:
    ids: tuple[int, ...]  # tokens whose keys and values are held (a prompt + its sampled tokens but the last)
    keys: list[torch.Tensor]  # per layer (1, H, P, D)
    values: list[torch.Tensor]  # per layer (1, H, P, D)

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


class PrefixCache:
    def __init__(self, max_bytes: int, min_tokens: int) -> None:
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()
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
        old = self._entries.pop(entry.ids, None)
        if old is not None:
            self._bytes -= old.nbytes
        while self._entries and self._bytes + size > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.nbytes
        self._entries[entry.ids] = entry
        self._bytes += size

    def longest(self, prompt: list[int]) -> PrefixMatch | None:
        """The entry sharing the longest start with the prompt (at least min_tokens), leaving at least one
        prompt token to prefill (its logits give the first sampled token)."""
        limit = len(prompt) - 1
        if limit < self.min_tokens or not self._entries:
            return None
        wanted = torch.tensor(prompt[:limit], dtype=torch.long)  # (limit,)
        best: PrefixMatch | None = None
        for entry in self._entries.values():
            m = min(len(entry.ids), limit)
            if m < self.min_tokens or (best is not None and m <= best.length) or entry.ids[0] != prompt[0]:
                continue
            differ = (entry.tensor[:m] != wanted[:m]).nonzero()  # (k, 1)
            shared = int(differ[0, 0]) if len(differ) else m
            if shared >= self.min_tokens and (best is None or shared > best.length):
                best = PrefixMatch(entry, shared)
        if best is not None:
            self._entries.move_to_end(best.entry.ids)
        return best

    def clear(self) -> None:
        self._entries.clear()
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
