"""Which vLLM replica serves a request, from its prompt's token ids alone.

A conversation's next call sends the previous call's prompt + sampled ids + a suffix (the gateway's
token-exact continuation), so the replica that served the previous call holds that prefix in its prefix
cache. The router remembers, per served sequence, a hash of its tokens (prompt + completion) and its length
in a bounded LRU map; a prompt that starts with a remembered sequence goes to the replica that served it.
Any other prompt (a new conversation, a group's other rollouts) goes to the replica with the fewest
sequences in flight, ties taken in turn.

Prefix hashes are polynomial (mod a Mersenne prime, 61 bits): one pass over the prompt gives the hash of
every prefix, and a remembered sequence extends from its prompt's hash. A collision costs a cold prefix
cache, never a wrong answer. Pure: no I/O, no clock, no threads (the engine serialises calls).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

_MOD = (1 << 61) - 1
_BASE = 1_000_003


def _extend(h: int, ids: Sequence[int]) -> int:
    for token in ids:
        h = (h * _BASE + token + 1) % _MOD
    return h


@dataclass
class Route:
    """One request's place: its replica, and what the router needs to remember what it served."""

    replica: int
    sequences: int  # counted in flight on `replica` until `done`
    prompt_hash: int
    prompt_len: int
    affine: bool  # sent where a remembered prefix lives (else: the least loaded)
    epoch: int  # the replica's life when routed: a restart meanwhile empties the cache it filled
    open: bool = True


class ReplicaRouter:
    def __init__(self, replicas: int, max_entries: int) -> None:
        self.replicas = replicas
        self.max_entries = max_entries if replicas > 1 else 0  # (one replica: nothing to choose, remember)
        self.in_flight = [0] * replicas  # sequences being generated, per replica
        self.served = [0] * replicas  # requests sent, per replica
        self._epoch = [0] * replicas  # bumped when a replica restarts: its prefix cache is empty
        # (length, hash of the tokens) -> (replica, its epoch)
        self._owner: OrderedDict[tuple[int, int], tuple[int, int]] = OrderedDict()
        self._lengths: Counter[int] = Counter()  # lengths of the remembered sequences
        self._turn = 0

    def route(self, prompt_ids: Sequence[int], sequences: int, eligible: Collection[int]) -> Route:
        """The replica for a request of `sequences` sequences, among `eligible` (non-empty) replicas."""
        if not eligible:
            raise ValueError("no eligible replica")
        replica, affine, prompt_hash = None, False, 0
        if self.max_entries:  # (remembering nothing, no prefix can be found: no hashing)
            prefix = [0]  # prefix[k] = hash of prompt_ids[:k]
            for token in prompt_ids:
                prefix.append((prefix[-1] * _BASE + token + 1) % _MOD)
            prompt_hash = prefix[-1]
            replica = self._affine(prefix, eligible)
            affine = replica is not None
        if replica is None:
            replica = self._least_loaded(eligible)
        self.in_flight[replica] += sequences
        self.served[replica] += 1
        return Route(replica, sequences, prompt_hash, len(prompt_ids), affine, self._epoch[replica])

    def done(self, route: Route, completions: Sequence[Sequence[int]] = ()) -> None:
        """The request ended (once; later calls are ignored); `completions` are the sampled ids it served
        (nothing for a request that failed)."""
        if not route.open:
            return
        route.open = False
        self.in_flight[route.replica] -= route.sequences
        if self.max_entries == 0:
            return
        for ids in completions:
            length = route.prompt_len + len(ids)
            key = (length, _extend(route.prompt_hash, ids))
            if key in self._owner:
                self._owner.move_to_end(key)
            else:
                self._lengths[length] += 1
            self._owner[key] = (route.replica, route.epoch)
            while len(self._owner) > self.max_entries:
                (old_length, _), _ = self._owner.popitem(last=False)
                self._forget_length(old_length)

    def restarted(self, replica: int) -> None:
        """`replica` came back empty: what it served before is no reason to send a continuation there."""
        self._epoch[replica] += 1

    def __len__(self) -> int:
        return len(self._owner)

    def _affine(self, prefix: list[int], eligible: Collection[int]) -> int | None:
        """The replica that served the longest remembered sequence the prompt starts with (the prompt itself
        included: a retried or repeated call), if it is eligible and its cache is from the same life."""
        if len(self._lengths) < len(prefix):  # whichever is fewer: the remembered lengths, or the positions
            lengths = sorted((n for n in self._lengths if n < len(prefix)), reverse=True)
        else:
            lengths = [n for n in range(len(prefix) - 1, -1, -1) if n in self._lengths]
        for length in lengths:
            key = (length, prefix[length])
            owner = self._owner.get(key)
            if owner is None:
                continue
            replica, epoch = owner
            if epoch != self._epoch[replica]:
                del self._owner[key]  # from before a restart: dropped as met
                self._forget_length(length)
                continue
            if replica in eligible:
                self._owner.move_to_end(key)
                return replica
        return None

    def _least_loaded(self, eligible: Collection[int]) -> int:
        order = sorted(eligible, key=lambda r: (self.in_flight[r], (r - self._turn) % self.replicas))
        self._turn = (order[0] + 1) % self.replicas
        return order[0]

    def _forget_length(self, length: int) -> None:
        self._lengths[length] -= 1
        if self._lengths[length] <= 0:
            del self._lengths[length]
