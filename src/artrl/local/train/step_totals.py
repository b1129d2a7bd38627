"""What one training call adds up: the GRPO step's sums (weighted by token weight) and their reduction over
the processes that train the step (one process, or trainer ranks)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch

from artrl.local.train.loss import LossTerms
from artrl.local.train.pack import MicroBatch


@dataclass
class GRPOTotals:
    """Sums over one `Trainer.step` call, weighted by token weight (mask x row weight)."""

    loss: float = 0.0
    clipped: float = 0.0
    kl: float = 0.0
    ratio: float = 0.0
    entropy: float = 0.0
    weight: float = 0.0
    # the train/inference mismatch monitor: trainer vs engine logprobs, before this call changed the weights
    mismatch: float = 0.0
    mismatch_max: float = 0.0
    mismatch_over: float = 0.0
    known: float = 0.0
    grad_norm: float = 0.0
    optimizer_steps: int = 0

    def add(self, terms: LossTerms, entropy: torch.Tensor, mb: MicroBatch, before_any_update: bool) -> None:
        token_weight = mb.mask * mb.weights[:, None]  # (B, T-1)
        self.loss += float(terms.loss.detach())
        self.clipped += terms.clipped_tokens
        self.kl += terms.kl
        self.ratio += terms.ratio
        self.entropy += float((entropy * token_weight).sum())
        self.weight += float(token_weight.sum())
        if before_any_update:
            self.mismatch += terms.mismatch
            self.mismatch_max = max(self.mismatch_max, terms.mismatch_max)
            self.mismatch_over += terms.mismatch_over
            self.known += terms.known

    def reduce(self, across: Reduction) -> None:
        """Sums and maxima over every process's rows (one process: unchanged)."""
        names = [
            f.name for f in fields(self) if f.name not in ("mismatch_max", "grad_norm", "optimizer_steps")
        ]
        for name, value in zip(names, across.sum([getattr(self, n) for n in names]), strict=True):
            setattr(self, name, value)
        (self.mismatch_max,) = across.max([self.mismatch_max])

    def metrics(self, seconds: float) -> dict[str, float]:
        weight, known = self.weight or 1.0, self.known or 1.0
        return {
            "loss": self.loss,
            "clip_fraction": self.clipped / weight,
            "kl": self.kl / weight,
            "ratio_mean": self.ratio / weight,
            "logprob_mismatch_mean": self.mismatch / known,
            "logprob_mismatch_max": self.mismatch_max,
            "logprob_mismatch_fraction": self.mismatch_over / known,
            "entropy": self.entropy / weight,
            "grad_norm": self.grad_norm,
            "optimizer_steps": self.optimizer_steps,
            "train_seconds": seconds,
        }


class Reduction(Protocol):
    """Sums and maxima of per-process values over all the processes that train one step."""

    def sum(self, values: list[float]) -> list[float]: ...
    def max(self, values: list[float]) -> list[float]: ...


class OneProcess:
    """Every row of the step is in this process: nothing to reduce."""

    def sum(self, values: list[float]) -> list[float]:
        return values

    def max(self, values: list[float]) -> list[float]:
        return values
