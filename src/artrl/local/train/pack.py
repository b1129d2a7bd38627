"""Packing rows into micro-batches under a token budget, and turning a micro-batch into tensors.

`pack_by_prompt` also puts rows that share a prompt (a group's rollouts of one scenario: the same system
message, tools and question) into micro-batches of their own, and `collate(..., shared=...)` marks how many
first positions every row of one has in common, which the trainer's forward then computes once
(local/train/logprobs.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from artrl.local.train.rows import Row


@dataclass
class MicroBatch:
    ids: torch.Tensor  # (B, T) long, right-padded
    attention: torch.Tensor  # (B, T) long, 0 on padding
    mask: torch.Tensor  # (B, T-1) float: 1 where the *target* token was sampled
    behaviour: torch.Tensor  # (B, T-1) float: behaviour logprob of each target token (NaN unknown)
    advantages: torch.Tensor  # (B,)
    weights: torch.Tensor  # (B,)
    shared: int = 0  # every row's first `shared` ids are the same, and none of ids[1:shared] is a target
    targets: torch.Tensor | None = None  # (B, T-1) long: the token position t predicts (None: ids[:, 1:])


def pack(rows: list[Row], max_tokens: int) -> list[list[int]]:
    """Indices of rows per micro-batch; a batch's padded size (rows x longest) stays within max_tokens
    (a single longer row gets a batch of its own). Longest rows first, so padding stays small."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].ids), reverse=True)
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * len(rows[batches[-1][0]].ids) <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def collate(rows: list[Row], device: torch.device, pad_id: int = 0, shared: int = 0) -> MicroBatch:
    """Right-padded tensors of `rows`; `shared` as `shared_prompt(rows)` gives it, or 0."""
    length = max(len(r.ids) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)  # (B, T)
    attention = torch.zeros((len(rows), length), dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(rows), length), dtype=torch.float32)  # (B, T)
    behaviour = torch.full((len(rows), length), float("nan"))  # (B, T)
    for b, row in enumerate(rows):
        n = len(row.ids)
        ids[b, :n] = torch.tensor(row.ids)
        attention[b, :n] = 1
        mask[b, :n] = torch.tensor(row.mask, dtype=torch.float32)
        behaviour[b, :n] = torch.tensor(row.logprobs, dtype=torch.float32)
    if shared and not (
        shared <= min(len(r.ids) for r in rows)
        and bool((ids[:, :shared] == ids[:1, :shared]).all())
        and not bool(mask[:, 1:shared].any())
    ):
        raise ValueError(
            f"collate(shared={shared}): these rows do not all begin with the same {shared} ids, none of them "
            "trained after the first (shared_prompt(rows) gives what they share)"
        )
    targets = None
    if any(r.targets is not None for r in rows):
        targets = ids[:, 1:].clone()  # (B, T-1)
        for b, row in enumerate(rows):
            if row.targets is not None:
                targets[b, : len(row.targets)] = torch.tensor(row.targets)
        targets = targets.to(device)
    return MicroBatch(
        ids=ids.to(device),
        attention=attention.to(device),
        mask=mask[:, 1:].to(device),  # token t+1 is predicted at position t
        behaviour=behaviour[:, 1:].to(device),
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=device),
        weights=torch.tensor([r.weight for r in rows], dtype=torch.float32, device=device),
        shared=shared,
        targets=targets,
    )


# A shared prompt is computed once when that saves at least this share of the rows' positions, and at least
# MIN_SHARED_SAVING of them: its separate decoder pass, the mask over the cached positions and the repeated
# keys and values cost something (tiny model: 16 SFT rows sharing 15% of their positions trained 6% slower
# that way, a group sharing 46% 1.3x faster).
MIN_SHARED_FRACTION = 0.25
MIN_SHARED_SAVING = 256


def _worth_sharing(shared: int, rows: list[Row]) -> bool:
    saved = shared * (len(rows) - 1)
    return saved >= MIN_SHARED_SAVING and saved >= MIN_SHARED_FRACTION * sum(len(r.ids) for r in rows)


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


def _prompt_length(row: Row) -> int:
    """Positions before the row's first trained target (the first token with mask 1 after position 0)."""
    return next((t for t in range(1, len(row.mask)) if row.mask[t]), len(row.ids))


def shared_prompt(rows: list[Row]) -> int:
    """How many first positions every row has in common, up to its first trained target; 0 when computing
    them once is not worth it (`_worth_sharing`; one row)."""
    if len(rows) < 2:
        return 0
    first = rows[0].ids
    shared = min(min(_common(first, r.ids) for r in rows[1:]), min(_prompt_length(r) for r in rows))
    return shared if _worth_sharing(shared, rows) else 0


def pack_by_prompt(rows: list[Row], max_tokens: int) -> list[list[int]]:
    """Like `pack`, but rows sharing a prompt go into micro-batches of their own, each within max_tokens
    counting the shared positions once (so more rows fit); every other row is packed as by `pack`.

    Rows sorted by their ids lie next to those they share most with. A run of them is one prompt's rows: it
    ends where a row shares too little with the next to be worth sharing at all (a chat template's header
    is not a prompt), and otherwise grows while adding the next row saves more positions than it loses (the
    common part only shrinks). A part of a run that is not worth sharing on its own (`shared_prompt`, as
    the trainer decides) is packed as whole rows."""
    order = sorted(range(len(rows)), key=lambda i: rows[i].ids)
    prompts = [_prompt_length(r) for r in rows]
    runs: list[list[int]] = []
    shared: list[int] = []  # per run
    for k, i in enumerate(order):
        prompt = prompts[i]
        if runs and k > 0:
            run, previous = runs[-1], rows[order[k - 1]]
            adjacent = min(_common(previous.ids, rows[i].ids), prompt, prompts[order[k - 1]])
            with_it = min(shared[-1], _common(rows[run[0]].ids, rows[i].ids), prompt)
            enough = adjacent >= MIN_SHARED_FRACTION * min(len(previous.ids), len(rows[i].ids))
            if enough and with_it > 1 and with_it * len(run) >= shared[-1] * (len(run) - 1):
                run.append(i)
                shared[-1] = with_it
                continue
        runs.append([i])
        shared.append(min(prompt, len(rows[i].ids)))
    batches: list[list[int]] = []
    alone: list[int] = []
    for run, common in zip(runs, shared, strict=True):
        if len(run) < 2 or not _worth_sharing(common, [rows[i] for i in run]):
            alone += run
            continue
        run.sort(key=lambda i: len(rows[i].ids), reverse=True)  # (longest first: little padding)
        parts: list[list[int]] = [[]]
        for i in run:  # the shared positions once, then every row's own (padded to the longest, the first)
            own = len(rows[(parts[-1] or [i])[0]].ids) - common
            if parts[-1] and common + (len(parts[-1]) + 1) * own > max_tokens:
                parts.append([])
            parts[-1].append(i)
        for part in parts:  # (budgeted with the prompt once: only where the trainer will share it)
            if shared_prompt([rows[i] for i in part]):
                batches.append(part)
            else:
                alone += part
    return batches + [[alone[k] for k in micro] for micro in pack([rows[i] for i in alone], max_tokens)]
