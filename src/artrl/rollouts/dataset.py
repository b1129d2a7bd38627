"""Iterating over training scenarios in steps: a deterministic shuffle per epoch that resumes at any step."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class DatasetBatch(Generic[T]):
    """The items of one training step.

    `step` counts from 0 over the whole run; `epoch` and `epoch_step` (from 0) place it within its epoch.
    """

    items: list[T]
    step: int
    epoch: int
    epoch_step: int

    def __iter__(self) -> Iterator:
        """`for batch, epoch, global_step, epoch_step in iterate_dataset(...)`: the tuple ART's
        `iterate_dataset` yields."""
        return iter((self.items, self.epoch, self.step, self.epoch_step))


def steps_per_epoch(num_items: int, groups_per_step: int) -> int:
    """Batches in one epoch: the last one may be partial, so ``ceil(num_items / groups_per_step)``."""
    return math.ceil(num_items / groups_per_step)


def epoch_order(num_items: int, epoch: int, *, seed: int | str = 0, shuffle: bool = True) -> list[int]:
    """The order of the item indices in `epoch`: shuffled by ``random.Random(f"{seed}-{epoch}")``, which
    depends on nothing but `seed` and `epoch` (the same in every process and Python version)."""
    order = list(range(num_items))
    if shuffle:
        random.Random(f"{seed}-{epoch}").shuffle(order)
    return order


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def iterate_dataset(
    items: Iterable[T],
    groups_per_step: int = 1,
    num_epochs: int = 1,
    initial_step: int = 0,
    *,
    seed: int | str = 0,
    shuffle: bool = True,
) -> Iterator[DatasetBatch[T]]:
    """Yield the batches of a training run: `num_epochs` passes over `items`, `groups_per_step` at a time.

    Each epoch visits every item once, in an order shuffled deterministically from `seed` and the epoch
    number (`shuffle=False` keeps the input order). The last batch of an epoch holds the remainder when
    `groups_per_step` does not divide the number of items (it is kept, not dropped, and batches never span
    two epochs), so an epoch has ``ceil(len(items) / groups_per_step)`` steps.

    `initial_step` resumes a run: the batches yielded are exactly those a run from step 0 would yield from
    that step on (same items, same `step`, `epoch` and `epoch_step`). At or past the last step, nothing is
    yielded. Typically ``initial_step=await model.get_step()``.

    Arguments are checked when the function is called, not at the first batch.
    """
    pool = list(items)
    if not pool:
        raise ValueError("iterate_dataset needs at least one item")
    _check_int("groups_per_step", groups_per_step, 1)
    _check_int("num_epochs", num_epochs, 1)
    _check_int("initial_step", initial_step, 0)
    return _batches(pool, groups_per_step, num_epochs, initial_step, seed, shuffle)


def _batches(
    pool: list[T], groups_per_step: int, num_epochs: int, initial_step: int, seed: int | str, shuffle: bool
) -> Iterator[DatasetBatch[T]]:
    per_epoch = steps_per_epoch(len(pool), groups_per_step)
    first_epoch, first_epoch_step = divmod(initial_step, per_epoch)
    for epoch in range(first_epoch, num_epochs):
        order = epoch_order(len(pool), epoch, seed=seed, shuffle=shuffle)
        start = first_epoch_step if epoch == first_epoch else 0
        for epoch_step in range(start, per_epoch):
            chunk = order[epoch_step * groups_per_step : (epoch_step + 1) * groups_per_step]
            yield DatasetBatch(
                items=[pool[i] for i in chunk],
                step=epoch * per_epoch + epoch_step,
                epoch=epoch,
                epoch_step=epoch_step,
            )
