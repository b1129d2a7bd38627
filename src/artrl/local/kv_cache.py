"""The running batch's key/value cache: per layer, a buffer with room to grow along time.

transformers' DynamicCache concatenates each new token's keys and values onto the whole cache, copying all
of it at every decode step (O(T) bytes per token, O(T²) per sequence). Here each layer keeps a buffer with
spare columns: a decode step writes its column in place and the model attends over a view of the filled part;
the buffer grows by doubling, so a sequence's cache is copied O(log T) times instead of T times. Rows are
left-padded to one shared timeline, as before (the attention mask hides the padding).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

MIN_SPARE = 64  # columns of room a buffer gets beyond what it holds


def left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class GrowingLayer(CacheLayerMixin):
    """One layer's keys and values, (B, H, T, D) views of (B, H, capacity, D) buffers."""

    is_sliding = False
    is_croppable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        batch, heads, length, dim = keys.shape
        capacity = length + max(MIN_SPARE, length)
        self._keys = keys.new_empty((batch, heads, capacity, dim))
        self._values = values.new_empty((batch, values.shape[1], capacity, values.shape[3]))
        self._keys[:, :, :length] = keys
        self._values[:, :, :length] = values
        self.length = length
        self.device = keys.device
        self.is_initialized = True
        self._view()

    def _view(self) -> None:
        self.keys = self._keys[:, :, : self.length]  # (B, H, T, D)
        self.values = self._values[:, :, : self.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Never lazy: a layer is made from the keys and values of a prefill."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, H, q, D) new states in place; return the keys and values up to them."""
        end = self.length + key_states.shape[2]
        if end > self._keys.shape[2]:
            self._grow(end)
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def _grow(self, needed: int) -> None:
        capacity = max(needed + MIN_SPARE, 2 * self._keys.shape[2])
        keys = self._keys.new_empty((*self._keys.shape[:2], capacity, self._keys.shape[3]))
        values = self._values.new_empty((*self._values.shape[:2], capacity, self._values.shape[3]))
        keys[:, :, : self.length] = self._keys[:, :, : self.length]
        values[:, :, : self.length] = self._values[:, :, : self.length]
        self._keys, self._values = keys, values

    def truncate(self, length: int) -> None:
        """Forget columns from `length` on (a step that failed half-way wrote some layers and not others)."""
        self.length = min(self.length, length)
        self._view()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


class BatchCache:
    """The keys and values of every layer for the running batch (row i belongs to the batch's sequence i)."""

    def __init__(self, layers: list[GrowingLayer]) -> None:
        self.layers = layers

    @classmethod
    def from_states(cls, keys: list[torch.Tensor], values: list[torch.Tensor]) -> BatchCache:
        """From per-layer (B, H, T, D) states (a prefill's)."""
        return cls([GrowingLayer(k, v) for k, v in zip(keys, values, strict=True)])

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def cache(self) -> Cache:
        """A transformers Cache over these layers: the model's forward appends to them in place."""
        return Cache(layers=self.layers)

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)

    def key_states(self) -> list[torch.Tensor]:
        return [layer.keys for layer in self.layers]

    def value_states(self) -> list[torch.Tensor]:
        return [layer.values for layer in self.layers]

    def row_states(self, row: int, start: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of one row's keys and values from column `start` on: per layer (1, H, n, D)."""
        return (
            [k[row : row + 1, :, start:].clone() for k in self.key_states()],
            [v[row : row + 1, :, start:].clone() for v in self.value_states()],
        )

    def merged(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> BatchCache:
        """A cache with new rows (per-layer (B', H, T', D) states) under these, both left-padded to the longer
        timeline."""
        length = max(self.length, keys[0].shape[2])
        return BatchCache.from_states(
            [
                torch.cat([left_pad(a, length, 2), left_pad(b, length, 2)])
                for a, b in zip(self.key_states(), keys, strict=True)
            ],
            [
                torch.cat([left_pad(a, length, 2), left_pad(b, length, 2)])
                for a, b in zip(self.value_states(), values, strict=True)
            ],
        )

    def selected(self, rows: torch.Tensor, first_column: int) -> BatchCache:
        """The cache of some rows (indices (B',)), from `first_column` on (padding no row needs any more)."""
        return BatchCache.from_states(
            [k.index_select(0, rows)[:, :, first_column:] for k in self.key_states()],
            [v.index_select(0, rows)[:, :, first_column:] for v in self.value_states()],
        )
