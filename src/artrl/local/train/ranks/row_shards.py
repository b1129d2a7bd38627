"""Which rows of a step each trainer rank trains: shares balanced by tokens, packed into micro-batches, and as
many micro-batches on every rank (FSDP's collectives need every rank in every forward and backward)."""

from __future__ import annotations

from artrl.local.train.pack import pack
from artrl.local.train.rows import Row


def shard_rows(lengths: list[int], ranks: int) -> list[list[int]]:
    """Row indices per rank: longest row first to the rank with the fewest tokens so far (ties: the lower
    rank), so each rank's share of the step's tokens is within one row of the others'."""
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        shares[rank].append(i)
        load[rank] += lengths[i]
    return shares


def rank_micro_batches(rows: list[Row], max_tokens: int, ranks: int, rank: int) -> list[list[int]]:
    """This rank's micro-batches (indices into `rows`), padded with [] (a pass that trains nothing) up to
    the largest count of any rank. Every rank computes every rank's packing: no message needed."""
    per_rank = [
        [[share[i] for i in micro] for micro in pack([rows[i] for i in share], max_tokens)]
        for share in shard_rows([len(r.ids) for r in rows], ranks)
    ]
    count = max(len(micros) for micros in per_rank)
    mine = per_rank[rank]
    return mine + [[] for _ in range(count - len(mine))]
