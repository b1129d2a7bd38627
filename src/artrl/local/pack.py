"""Packing rows into micro-batches under a token budget, and turning a micro-batch into tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from artrl.local.rows import Row


@dataclass
class MicroBatch:
    ids: torch.Tensor  # (B, T) long, right-padded
    attention: torch.Tensor  # (B, T) long, 0 on padding
    mask: torch.Tensor  # (B, T-1) float: 1 where the *target* token was sampled
    behaviour: torch.Tensor  # (B, T-1) float: behaviour logprob of each target token (NaN unknown)
    advantages: torch.Tensor  # (B,)
    weights: torch.Tensor  # (B,)


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


def collate(rows: list[Row], device: torch.device, pad_id: int = 0) -> MicroBatch:
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
    return MicroBatch(
        ids=ids.to(device),
        attention=attention.to(device),
        mask=mask[:, 1:].to(device),  # token t+1 is predicted at position t
        behaviour=behaviour[:, 1:].to(device),
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32, device=device),
        weights=torch.tensor([r.weight for r in rows], dtype=torch.float32, device=device),
    )
