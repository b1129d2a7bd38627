"""The running batch's key/value cache: per layer, a buffer with room to grow along time.

transformers' DynamicCache concatenates each new token's keys and values onto the whole cache, copying all
of it at every decode step (O(T) bytes per token, O(T²) per sequence). Here each layer keeps a buffer with
spare columns and spare rows: a decode step writes its column in place and the model attends over a view of
the filled part. The columns grow by an eighth of what they hold, at least MIN_SPARE (a copy of the cache
every 64 steps or more), not by doubling: the fused decode step attends over the buffer's whole width
(`wide`), one contiguous block per row range, where a view of the filled columns is not and a bf16 batched
product copies it first, at every layer of every step; so the unused width stays small. Requests joining
the batch are written into free rows and finished ones leave by moving the rows below them up, so admitting
or dropping a sequence copies only what moves, not the whole batch. Rows are left-padded to one shared
timeline (the attention mask hides the padding).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

MIN_SPARE = 64  # fewest columns of room a buffer gets beyond what it holds


def spare(length: int) -> int:
    """Columns of room beyond `length` held columns: an eighth of them, at least MIN_SPARE."""
    return max(MIN_SPARE, length // 8)


def left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class GrowingLayer(CacheLayerMixin):
    """One layer's keys and values: (B, H, T, D) views of (B_cap, H, T_cap, D) buffers with room for more rows
    and more columns. Rows join (a prefill's) and leave (finished sequences) in place: only the rows that
    move are copied, and all of them only when the shared timeline must widen or the buffers grow. Every
    column a row does not use (its left padding, and the room after the timeline, which `wide` hands out
    too) holds zeros: masked out, they must stay finite, because an attention probability of 0 times a NaN
    is a NaN."""

    is_sliding = False
    is_croppable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        batch, _, length, _ = keys.shape
        self._keys = _room(keys, batch, length + spare(length))
        self._values = _room(values, batch, length + spare(length))
        self._keys[:, :, :length] = keys
        self._values[:, :, :length] = values
        self.rows = batch
        self.length = length
        self.device = keys.device
        self.is_initialized = True
        self._view()

    def _view(self) -> None:
        self.keys = self._keys[: self.rows, :, : self.length]  # (B, H, T, D)
        self.values = self._values[: self.rows, :, : self.length]

    def wide(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held rows' keys and values over the buffers' whole width: (B, H, T_cap, D), contiguous; the
        columns from `length` on are zeros, to be masked."""
        return self._keys[: self.rows], self._values[: self.rows]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Never lazy: a layer is made from the keys and values of a prefill."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, H, q, D) new states in place; return the keys and values up to them."""
        end = self.length + key_states.shape[2]
        if end > self._keys.shape[2]:
            self._reserve(self.rows, end)
        self._keys[: self.rows, :, self.length : end] = key_states
        self._values[: self.rows, :, self.length : end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    @property
    def key_buffer(self) -> torch.Tensor:
        """(B_cap, H, T_cap, D): the buffer itself, for a step that writes its column in place."""
        return self._keys

    @property
    def value_buffer(self) -> torch.Tensor:
        return self._values

    def reserve_column(self) -> None:
        """Room for one more column (before a step writes it into the buffers itself)."""
        if self.length + 1 > self._keys.shape[2]:
            self._reserve(self.rows, self.length + 1)

    def appended(self, count: int) -> None:
        """`count` columns were written after the held ones, into the buffers directly."""
        self.length += count
        self._view()

    def clear_column(self, column: int) -> None:
        """Zeros again in one column of the held rows (a step failed after writing some layers)."""
        self._keys[: self.rows, :, column : column + 1] = 0
        self._values[: self.rows, :, column : column + 1] = 0

    def _reserve(self, rows: int, length: int, shift: int = 0) -> None:
        """Buffers with room for `rows` rows (doubling) and `length` columns (`spare` more); the rows held
        move `shift` columns right (a wider timeline) on the way."""
        capacity = self._keys.shape[:3:2]  # (B_cap, T_cap)
        if rows <= capacity[0] and length <= capacity[1] and not shift:
            return
        b = capacity[0] if rows <= capacity[0] else max(rows, 2 * capacity[0])
        t = capacity[1] if length <= capacity[1] else length + spare(length)
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = old if (b, t) == capacity else _room(old, b, t)
            if shift:  # (source and target overlap in place: through a copy)
                moved = old[: self.rows, :, : self.length].clone()
                new[: self.rows, :, :shift] = 0
                new[: self.rows, :, shift : shift + self.length] = moved
            elif new is not old:
                new[: self.rows, :, : self.length] = old[: self.rows, :, : self.length]
            setattr(self, name, new)
        self.length += shift

    def add_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append rows (B', H, T', D) below the held ones, both left-padded to the longer timeline."""
        added, _, length, _ = keys.shape
        shift = max(0, length - self.length)
        self._reserve(self.rows + added, max(self.length, length) + 1, shift)
        rows = slice(self.rows, self.rows + added)
        for buffer, states in ((self._keys, keys), (self._values, values)):
            buffer[rows, :, : self.length - length] = 0
            buffer[rows, :, self.length - length : self.length] = states
            buffer[rows, :, self.length :] = 0  # (a row that left these slots may have held anything)
        self.rows += added
        self._view()

    def keep_rows(self, kept: list[int], trim: int) -> None:
        """Keep the rows `kept` (ascending), in that order, and drop the first `trim` columns (padding no kept
        row needs). A kept row moves up only into a slot below it, so it is never overwritten before it moved."""
        moved = [(slot, row) for slot, row in enumerate(kept) if slot != row]
        if moved:
            slots = torch.tensor([slot for slot, _ in moved], device=self._keys.device)
            rows = torch.tensor([row for _, row in moved], device=self._keys.device)
            for buffer in (self._keys, self._values):
                buffer[: self.rows, :, : self.length].index_copy_(
                    0, slots, buffer[: self.rows, :, : self.length].index_select(0, rows)
                )
        self.rows = len(kept)
        if trim:
            length = self.length - trim
            # (the columns move through a copy anyway: into tight buffers if these would leave many unused)
            tight = self._keys.shape[2] > length + 2 * spare(length)
            for name in ("_keys", "_values"):
                buffer = getattr(self, name)
                moved = buffer[: self.rows, :, trim : self.length].clone()
                if tight:
                    buffer = _room(buffer, buffer.shape[0], length + spare(length))
                    setattr(self, name, buffer)
                buffer[: self.rows, :, :length] = moved
                if not tight:
                    buffer[: self.rows, :, length : self.length] = 0
            self.length = length
        self._view()

    def truncate(self, length: int) -> None:
        """Forget columns from `length` on (a step that failed half-way wrote some layers and not others)."""
        if length < self.length:
            self._keys[: self.rows, :, length : self.length] = 0
            self._values[: self.rows, :, length : self.length] = 0
            self.length = length
        self._view()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


def _room(like: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """A zeroed (rows, H, columns, D) buffer of like's dtype and device."""
    return like.new_zeros((rows, like.shape[1], columns, like.shape[3]))


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

    def rows_states(self, rows: list[int], start: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of some rows' keys and values from column `start` on, one operation per layer: per layer
        (R, H, T - start, D)."""
        index = torch.tensor(rows, device=self.layers[0].keys.device)
        return (
            [k[:, :, start:].index_select(0, index) for k in self.key_states()],
            [v[:, :, start:].index_select(0, index) for v in self.value_states()],
        )

    def add_rows(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """New rows (per-layer (B', H, T', D) states) under these, both left-padded to the longer timeline."""
        for layer, k, v in zip(self.layers, keys, values, strict=True):
            layer.add_rows(k, v)

    def keep_rows(self, kept: list[int], trim: int) -> None:
        """Only the rows `kept` (ascending indices), without the first `trim` columns (padding)."""
        for layer in self.layers:
            layer.keep_rows(kept, trim)


def cached_token_bytes(model: Any) -> int | None:
    """Bytes of keys and values one token takes in the KV cache, across layers (2 × layers × kv heads ×
    head_dim × dtype size), from the model's config; None where it says not."""
    for module in model.modules():  # (a PEFT or other wrapper holds the transformers model)
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "get_text_config"):
            continue
        text = config.get_text_config()
        layers = getattr(text, "num_hidden_layers", None)
        heads = getattr(text, "num_attention_heads", None)
        if not layers or not heads:
            continue
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        try:  # the hidden states' dtype: the embeddings' (a quantised model's linear weights are not)
            size = module.get_input_embeddings().weight.element_size()
        except Exception:
            size = next(p for p in model.parameters() if p.is_floating_point()).element_size()
        return 2 * layers * kv_heads * head_dim * size
    return None
