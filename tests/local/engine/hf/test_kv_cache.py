"""The running batch's KV cache: rows join and leave in place, the timeline widens and narrows, and every
view equals the rows' own states left-padded with zeros (padding must stay finite under the mask)."""

from __future__ import annotations

import random

import torch

from artrl.local.engine.hf.kv_cache import BatchCache, spare

HEADS, DIM = 2, 4


def states(rows: int, length: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, HEADS, length, DIM, generator=gen)


def expected(held: list[torch.Tensor], length: int) -> torch.Tensor:
    """(B, H, length, D): each row's own states (H, n, D) right-aligned on zeros."""
    out = torch.zeros(len(held), HEADS, length, DIM)
    for i, row in enumerate(held):
        out[i, :, length - row.shape[1] :] = row
    return out


def test_rows_join_decode_and_leave_in_place_like_a_padded_rebuild():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    first = states(3, 5, gen)
    cache = BatchCache.from_states([first], [-first])
    held = [first[i] for i in range(3)]  # each (H, n, D); a row's tokens are its last columns
    for step in range(300):
        action = rng.random()
        if action < 0.15 and len(held) < 40:  # a prefill joins: shorter or longer than the timeline
            added, length = rng.randint(1, 4), rng.randint(1, cache.length + 30)
            new = states(added, length, gen)
            cache.add_rows([new], [-new])
            held += [new[i] for i in range(added)]
        elif action < 0.3 and len(held) > 1:  # some finish
            kept = sorted(rng.sample(range(len(held)), rng.randint(1, len(held) - 1)))
            layer = cache.layers[0]
            for row in sorted(set(range(len(held))) - set(kept)):  # a row that overflowed (fp16 inf/NaN)
                layer._keys[row, :, : cache.length] = float("nan")  # (in the columns the model writes)
                layer._values[row, :, : cache.length] = float("nan")
            held = [held[i] for i in kept]
            longest = max(row.shape[1] for row in held)
            trim = rng.choice([0, cache.length - longest])
            cache.keep_rows(kept, trim)
        else:  # a decode step: one column for every row
            column = states(len(held), 1, gen)
            layer = cache.layers[0]
            keys, _ = layer.update(column, -column)
            held = [torch.cat([row, column[i]], dim=1) for i, row in enumerate(held)]
            assert keys.shape[0] == len(held)
        want = expected(held, cache.length)
        assert torch.equal(cache.key_states()[0], want), step
        assert torch.equal(cache.value_states()[0], -want), step
        # the whole width (what the fused decode step attends over): one block, the view's columns first,
        # zeros after them (whatever rows that left held there), and never many more columns than the timeline
        wide_keys, wide_values = cache.layers[0].wide()
        assert wide_keys.is_contiguous() and wide_values.is_contiguous(), step
        assert torch.equal(wide_keys[:, :, : cache.length], want), step
        assert torch.equal(wide_values[:, :, : cache.length], -want), step
        assert not wide_keys[:, :, cache.length :].any() and not wide_values[:, :, cache.length :].any(), step
        assert cache.length <= wide_keys.shape[2] <= cache.length + 2 * spare(cache.length), step
    assert cache.layers[0].rows == len(held)
