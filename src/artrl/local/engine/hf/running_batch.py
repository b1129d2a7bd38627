"""The embedded engine's running batch and its token steps (the engine thread calls them; see engine_hf).

Each iteration the engine (1) admits waiting requests: one batched, left-padded prefill on top of any cached
prefix of their prompts, merged into the running batch's KV cache, then (2) decodes one token for every
running sequence, and drops the finished ones (their keys and values go to the prefix cache). A failing
batched step is retried row by row, so only a sequence whose own step fails ends with an error.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import DynamicCache

from artrl.local.engine.hf.fused_decode import FusedDecode
from artrl.local.engine.hf.kv_cache import BatchCache, cached_token_bytes, left_pad
from artrl.local.engine.hf.prefix_cache import (
    CachedPrefix,
    PrefixCache,
    PrefixMatch,
    SharedStates,
    common_start,
    stacked_states,
)
from artrl.local.engine.hf.sampling import SamplingError, SamplingParams, sample_rows
from artrl.local.engine.hf.sequences import (
    Batch,
    Request,
    RunningSequence,
    fail_sequences,
    one_row_per_prompt,
)

log = logging.getLogger(__name__)

TRIM_COLUMNS = 64  # padding columns (that no running row needs) worth dropping from the batch's cache


class RunningBatch:
    """Waiting requests, the running batch, and the prefill/decode steps over `model` (engine thread only)."""

    def __init__(
        self,
        model: Any,
        *,
        max_context: int,
        max_batch_size: int,
        max_prefill_tokens: int,
        prefix_cache: PrefixCache,
        cache_arg: str,
        kv_cache_budget_bytes: int | None = None,
    ) -> None:
        self.model = model
        self._max_context = max_context
        self._max_batch_size = max_batch_size
        self._max_prefill_tokens = max_prefill_tokens  # padded prompt tokens one prefill may hold
        # the running batch's padded KV cache at most (rows × longest row × token_bytes); None: no limit
        self._kv_budget = kv_cache_budget_bytes
        # keys and values of one cached token across layers: from the config, then measured at a prefill
        self.token_bytes: int | None = cached_token_bytes(model)
        self.prefix_cache = prefix_cache
        self._cache_arg = cache_arg  # the forward's name for the KV cache argument
        self._device = next(model.parameters()).device
        self.pending: list[Request] = []
        self.batch = Batch()
        # decode steps and prefills without the module tree, once built (set and built by the engine)
        self.fused: FusedDecode | None = None
        # rows of several LoRA adapters in one forward (PEFT's mixed batches; set by the engine, no fused path)
        self.adapters = False

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.batch.sequences)

    def fail_all(self, message: str, reason: str = "error") -> None:
        fail_sequences([s for r in self.pending for s in r.sequences], message, reason)
        self.pending = []
        self.fail_running(message, reason)

    def fail_running(self, message: str, reason: str = "error") -> None:
        fail_sequences(self.batch.sequences, message, reason)
        self.batch = Batch()

    def admit(self) -> None:
        """Prefill waiting requests into the batch, in their order: as many as fit in its free rows, in the
        prefill token budget (prompts are left-padded to the longest) and in the KV cache budget (every row is
        padded to the longest: rows × the longest row's prompt + max_tokens × token_bytes); always at least one
        when the batch is empty (an over-budget request, or one with more sequences than max_batch_size, runs
        alone). A request that does not fit waits at the head: the ones behind it do not pass it."""
        room = self._max_batch_size - len(self.batch.sequences)
        rows = len(self.batch.sequences)
        widest = max(
            [self.batch.cache.length if self.batch.cache is not None else 0]
            + [self._final_length(s.position + 1 - s.generated, s.params) for s in self.batch.sequences]
        )
        admitted: list[Request] = []
        longest = 0
        while self.pending:
            request = self.pending[0]
            if all(s.stream.aborted for s in request.sequences):  # (never waits for room it will not use)
                self.pending.pop(0)
                for s in request.sequences:
                    s.finish("abort")
                continue
            # (not any free row: n=4 with one row free would overfill the batch; it waits for an empty one)
            if room < len(request.sequences) and rows > 0:
                break
            padded = max(longest, len(request.prompt_ids)) * (len(admitted) + 1)
            if admitted and padded > self._max_prefill_tokens:
                break
            width = max(
                widest, *(self._final_length(len(request.prompt_ids), s.params) for s in request.sequences)
            )
            if rows and not self._fits_cache(rows + len(request.sequences), width):
                break
            self.pending.pop(0)
            room -= len(request.sequences)
            rows += len(request.sequences)
            widest = width
            admitted.append(request)
            longest = max(longest, len(request.prompt_ids))
        if not admitted:
            return
        try:  # (popped from `pending`: from here on a failure must reach their streams, never lose them)
            admitted = one_row_per_prompt(admitted)
            try:
                matches = self._prefix_matches(admitted)
            except Exception as exc:  # the shared start's forward (out of memory, say): prefill without it
                log.warning(
                    "a shared prompt start failed (%s: %s); prefilling without it", type(exc).__name__, exc
                )
                matches = [None] * len(admitted)
            self._prefill_isolated(admitted, matches)
        except Exception as exc:
            log.exception("admitting requests failed")
            fail_sequences([s for r in admitted for s in r.sequences], f"{type(exc).__name__}: {exc}")

    def _final_length(self, prompt: int, params: SamplingParams) -> int:
        """Tokens a row holds at most: its prompt and max_tokens, within the context."""
        return min(prompt + params.max_tokens, self._max_context)

    def _fits_cache(self, rows: int, width: int) -> bool:
        """Whether `rows` rows padded to `width` columns fit in the KV cache budget."""
        if self._kv_budget is None or self.token_bytes is None:
            return True
        return rows * width * self.token_bytes <= self._kv_budget

    def _prefix_matches(self, requests: list[Request]) -> list[PrefixMatch | None]:
        """Each request's longest cached start; requests without one that start alike (one scenario's
        rollouts, one system prompt and tool list) get their common start computed once and cached."""
        if not self.prefix_cache.enabled:
            return [None] * len(requests)
        matches = [self.prefix_cache.longest(r.prompt_ids, r.adapter) for r in requests]
        for adapter in {r.adapter for r in requests}:  # (one adapter's keys and values serve only its rows)
            # (a joined request counts once per sequence: its prompt, shared by several, is worth caching too)
            unmatched = [
                r.prompt_ids
                for r, m in zip(requests, matches, strict=True)
                if m is None and r.adapter == adapter
                for _ in r.sequences
            ]
            if len(unmatched) < 2:
                continue
            shared = common_start(unmatched)
            if shared < self.prefix_cache.min_tokens:
                continue
            ids = unmatched[0][:shared]
            row = torch.tensor([ids], device=self._device)  # (1, P)
            positions = torch.arange(shared, device=self._device)[None]  # (1, P)
            _, keys, values = self._prefill_forward(
                row, torch.ones_like(row), positions, [(None, 0)], [adapter]
            )
            self.prefix_cache.put(ids, keys, values, adapter)
            common = PrefixMatch(CachedPrefix(tuple(ids), keys, values, adapter=adapter), shared)
            matches = [
                common if m is None and r.adapter == adapter else m
                for r, m in zip(requests, matches, strict=True)
            ]
        return matches

    def _prefill_isolated(self, requests: list[Request], matches: list[PrefixMatch | None]) -> None:
        """Prefill the requests together; if that fails (out of memory on a long prompt, say), each on its
        own, so that only a request whose own prefill fails ends with an error."""
        try:
            self._prefill(requests, matches)
            return
        except Exception as exc:
            if len(requests) == 1:
                log.warning("prefill failed: %s: %s", type(exc).__name__, exc)
                fail_sequences(requests[0].sequences, f"{type(exc).__name__}: {exc}")
                return
            log.warning("a batched prefill failed (%s: %s); prefilling one by one", type(exc).__name__, exc)
        for request in requests:
            self._prefill_isolated([request], [None])

    def _forward(self, input_ids, mask, positions, cache, adapters: list[str | None]) -> torch.Tensor:
        """Logits (B, V) of the last position; the keys and values of input_ids are appended to `cache`.
        `adapters`: each row's LoRA adapter, when the engine serves several."""
        # the last position as an index, not `logits_to_keep=1`: that slices the hidden states to a strided
        # (B, 1, E) view, and torch's bf16 linear on a strided 3-d input takes a slow path (measured: 200 ms
        # instead of 0.3 ms for the 27M model's head at 31 rows); an index gathers a contiguous copy
        last = torch.tensor([input_ids.shape[1] - 1], device=input_ids.device)  # (1,)
        out = self.model(
            input_ids=input_ids,  # (B, L)
            attention_mask=mask,  # (B, T_past + L)
            position_ids=positions,  # (B, L)
            use_cache=True,
            logits_to_keep=last,
            **{self._cache_arg: cache},
            # (PEFT's name for the model without any adapter)
            **({"adapter_names": [a or "__base__" for a in adapters]} if self.adapters else {}),
        )
        return out.logits[:, -1, :]

    def _prefill_forward(
        self,
        input_ids,
        mask,
        positions,
        reused: list[tuple[CachedPrefix | None, int]],
        adapters: list[str | None],
    ):
        """Logits (R, V) and per-layer keys and values (R, H, P + S, D): input_ids (R, S) after each row's
        first n cached tokens of its entry (left-padded to the longest; none: a fresh forward)."""
        past = stacked_states(reused)
        fused = self.fused
        if fused is not None and fused.ready:  # (the same forward without the module tree)
            return fused.prefill(input_ids, positions, mask, past, adapters if self.adapters else None)
        cache = DynamicCache(ddp_cache_data=past) if past else DynamicCache()  # (fresh tensors)
        logits = self._forward(input_ids, mask, positions, cache, adapters)
        return logits, [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]

    def _prefill(self, requests: list[Request], matches: list[PrefixMatch | None]) -> None:
        """The requests' prompts in one forward, left-padded; a row with a cached prefix computes only the
        last S tokens of its prompt (S: what the row with the least cached must compute) on top of the cached
        states of the rest, so every row's tokens stay contiguous (no padding between them, which a
        sliding-window layer would count as tokens)."""
        lengths = [len(r.prompt_ids) for r in requests]
        cached = [m.length if m is not None else 0 for m in matches]
        rest = max(n - c for n, c in zip(lengths, cached, strict=True))  # S
        reuse = [max(0, n - rest) for n in lengths]  # <= cached: each row's rest is exactly S tokens
        width = max(reuse)
        ids = torch.zeros((len(requests), rest), dtype=torch.long)  # (R, S)
        mask = torch.zeros((len(requests), width + rest), dtype=torch.long)  # (R, P + S)
        for row, (r, n) in enumerate(zip(requests, reuse, strict=True)):
            tail = r.prompt_ids[n:]
            ids[row, rest - len(tail) :] = torch.tensor(tail)
            mask[row, width + rest - len(tail) - n :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, width:]  # (R, S)
        reused = [(m.entry if m is not None else None, n) for m, n in zip(matches, reuse, strict=True)]
        logits, keys, values = self._prefill_forward(
            ids.to(self._device),
            mask.to(self._device),
            positions.to(self._device),
            reused,
            [r.adapter for r in requests],
        )
        stats = self.prefix_cache.stats
        stats.hits += sum(1 for n in reuse if n)
        stats.tokens_reused += sum(reuse)
        stats.tokens_prefilled += sum(lengths) - sum(reuse)
        # expand each request's row to its n sequences
        fanout = torch.tensor([len(r.sequences) for r in requests], device=self._device)  # (R,)
        logits = logits.repeat_interleave(fanout, dim=0)  # (S, V)
        keys = [k.repeat_interleave(fanout, dim=0) for k in keys]  # (S, H, L, D)
        values = [v.repeat_interleave(fanout, dim=0) for v in values]
        mask = mask.to(self._device).repeat_interleave(fanout, dim=0)  # (S, L)
        sequences = [s for r in requests for s in r.sequences]
        for r in requests:
            for s in r.sequences:
                s.position = len(r.prompt_ids) - 1  # the first sampled token lands at len(prompt)
                if self.prefix_cache.enabled:
                    s.tokens = list(r.prompt_ids)
        self._merge(sequences, keys, values, mask)
        self._emit(sequences, logits)

    def _merge(self, sequences, keys, values, mask) -> None:
        batch = self.batch
        # (measured: exact where the config's estimate is not, a quantised model's say)
        self.token_bytes = sum(t.shape[1] * t.shape[3] * t.element_size() for t in (*keys, *values))
        if not batch.sequences or batch.cache is None:
            self.batch = Batch(list(sequences), BatchCache.from_states(keys, values), mask)
            return
        length = max(batch.mask.shape[1], mask.shape[1])
        batch.cache.add_rows(keys, values)
        batch.mask = torch.cat([left_pad(batch.mask, length, 1), left_pad(mask, length, 1)])
        batch.sequences.extend(sequences)

    def decode_step(self) -> None:
        batch = self.batch
        assert batch.cache is not None
        ids = torch.tensor([[s.last_token] for s in batch.sequences], device=self._device)  # (B, 1)
        positions = torch.tensor([[s.position] for s in batch.sequences], device=self._device)  # (B, 1)
        mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.sequences), 1))], dim=1)  # (B, T+1)
        before = batch.cache.length
        try:
            fused = self.fused
            if fused is not None and fused.ready:
                rows = [s.adapter for s in batch.sequences] if self.adapters else None
                logits = fused(ids, positions, mask, batch.cache, rows)
            else:
                logits = self._forward(
                    ids, mask, positions, batch.cache.cache(), [s.adapter for s in batch.sequences]
                )
        except Exception as exc:
            batch.cache.truncate(before)  # layers before the failure appended their column
            if len(batch.sequences) == 1:
                raise
            log.warning("a batched decode step failed (%s: %s); decoding row by row", type(exc).__name__, exc)
            self._decode_rows(ids, positions, mask)
            return
        batch.mask = mask
        self._emit(batch.sequences, logits)

    def _decode_rows(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> None:
        """The step again, one sequence at a time: a sequence whose step still fails ends with an error, the
        others keep their place in the batch."""
        batch = self.batch
        assert batch.cache is not None
        kept, logits, keys, values = [], [], [], []
        for row, seq in enumerate(batch.sequences):
            one = slice(row, row + 1)
            past = [
                (k[one], v[one])
                for k, v in zip(batch.cache.key_states(), batch.cache.value_states(), strict=True)
            ]
            cache = DynamicCache(ddp_cache_data=past)  # (a copy of this row's states)
            try:
                logits.append(self._forward(ids[one], mask[one], positions[one], cache, [seq.adapter]))
            except Exception as exc:
                fail_sequences([seq], f"{type(exc).__name__}: {exc}")
                continue
            kept.append(row)
            keys.append([layer.keys for layer in cache.layers])
            values.append([layer.values for layer in cache.layers])
        sequences = [batch.sequences[i] for i in kept]
        if not sequences:
            self.batch = Batch()
            return
        self.batch = Batch(
            sequences,
            BatchCache.from_states(
                [torch.cat(layer) for layer in zip(*keys, strict=True)],  # per layer (B', H, T+1, D)
                [torch.cat(layer) for layer in zip(*values, strict=True)],
            ),
            mask[torch.tensor(kept, device=mask.device)],  # (B', T+1)
        )
        self._emit(sequences, torch.cat(logits))  # (B', V)

    def _emit(self, sequences: list[RunningSequence], logits: torch.Tensor) -> None:
        """Sample one token per sequence from logits (S, V), push it, and mark finished sequences."""
        choices = sample_rows(logits, [s.params for s in sequences], [s.generator for s in sequences])
        for seq, choice in zip(sequences, choices, strict=True):
            if seq.done or seq.stream.aborted:
                continue
            if isinstance(choice, SamplingError):
                fail_sequences([seq], str(choice))
                continue
            seq.stream.push(choice)
            seq.generated += 1
            if self.prefix_cache.enabled:
                seq.tokens.append(choice.token_id)
            seq.last_token = choice.token_id
            seq.position += 1
            if choice.token_id in seq.params.stop_token_ids:
                seq.finish("stop")
            elif seq.generated >= seq.params.max_tokens or seq.position + 1 >= self._max_context:
                seq.finish("length")

    def _remember(self, batch: Batch, rows: list[int]) -> None:
        """Copy finished rows' keys and values into the prefix cache: their prompt + sampled tokens but the
        last sampled one (never fed back, so it has none). A row's tokens are its last columns (rows are
        left-padded), so they are counted, not searched."""
        assert batch.cache is not None and batch.mask is not None
        counts = batch.mask.sum(1).tolist()  # (B,) each row's tokens in the cache
        width = batch.mask.shape[1]
        # (always all: every unmasked column is a token of the sequence)
        rows = [
            r for r in rows if len(batch.sequences[r].tokens) >= counts[r] >= self.prefix_cache.min_tokens
        ]
        if not rows:
            return
        # one copy per layer for all the rows (a copy per row and layer handed the interpreter lock to the
        # agents' threads hundreds of times, just when the finished rows woke them up); each entry a view
        longest = max(counts[r] for r in rows)
        keys, values = batch.cache.rows_states(rows, width - longest)  # per layer (R, H, longest, D)
        shared = SharedStates(sum(t.numel() * t.element_size() for t in (*keys, *values)))
        entries = []
        for i, row in enumerate(rows):
            n = counts[row]
            views = (
                [t[i : i + 1, :, longest - n :] for t in keys],
                [t[i : i + 1, :, longest - n :] for t in values],
            )
            entries.append((batch.sequences[row].tokens[:n], *views, batch.sequences[row].adapter))
        self.prefix_cache.put_shared(entries, shared)

    def drop_finished(self) -> None:
        batch = self.batch
        for s in batch.sequences:
            if s.stream.aborted:
                s.finish("abort")
        keep = [i for i, s in enumerate(batch.sequences) if not s.done]
        if len(keep) == len(batch.sequences):
            return
        if self.prefix_cache.enabled and batch.cache is not None:
            try:  # (an optimisation: when the copy fails, out of memory say, the rows are just not cached)
                self._remember(batch, [i for i, s in enumerate(batch.sequences) if s.done and s.reusable])
            except Exception as exc:
                log.warning("finished rows not cached (%s: %s)", type(exc).__name__, exc)
        if not keep:
            self.batch = Batch()
            return
        index = torch.tensor(keep, device=self._device)
        mask = batch.mask.index_select(0, index)  # (B', T)
        first_used = int((mask.sum(0) > 0).nonzero()[0])  # padding columns no row needs any more
        # dropped only when they are many (dropping them moves every row's keys and values)
        trim = first_used if first_used >= max(TRIM_COLUMNS, mask.shape[1] // 4) else 0
        batch.sequences = [batch.sequences[i] for i in keep]
        batch.mask = mask[:, trim:]
        assert batch.cache is not None
        batch.cache.keep_rows(keep, trim)
