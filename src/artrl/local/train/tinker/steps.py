"""The Tinker API's training calls on an artrl `Trainer`'s model and optimizer (issue 42): `forward`,
`forward_backward` (a built-in loss of `losses.py` on datums, gradients added to what earlier calls
left) and `optim_step` (AdamW with the parameters the call gives, then the gradients cleared). A datum is
its model input's token ids and, per input position t, its loss inputs: `target_tokens[t]` (the token
position t predicts), `weights`, `logprobs`, `advantages`.

Targets are usually the next input tokens (`target_tokens[:-1] == input_ids[1:]`); any other target is
the token its position's logprob is of (the cookbook's `rl_loop` puts 0 at its prompt positions, whose
advantage is 0). Run on the thread that owns the model (the engine's, see `Trainer.run`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from artrl.local.train.pack import collate, pack
from artrl.local.train.rows import NO_LOGPROB, Row
from artrl.local.train.tinker.losses import INPUTS, tinker_loss

MICRO_BATCH_TOKENS = 4096  # padded tokens of one forward and backward at most (cf. TrainConfig)


@dataclass
class TokenDatum:
    input_ids: list[int]
    inputs: dict[str, list[float]] = field(default_factory=dict)  # each one value per input position

    def row(self) -> Row:
        """Its tokens as a trainer row: the inputs, then the last target."""
        targets = self.inputs.get("target_tokens")
        n = len(self.input_ids)
        if targets is None or len(targets) != n or n == 0:
            raise ValueError(
                f"a datum needs target_tokens, one per model input token ({n} input tokens, "
                f"{'none' if targets is None else len(targets)} targets)"
            )
        for key, values in self.inputs.items():
            if len(values) != n:
                raise ValueError(f"loss_fn_inputs[{key!r}] has {len(values)} values for {n} input tokens")
        targets = [int(t) for t in targets]
        shifted = targets[:-1] == self.input_ids[1:]
        return Row(
            ids=[*self.input_ids, targets[-1]],
            mask=[0] + [1] * n,
            logprobs=[NO_LOGPROB] * (n + 1),
            targets=None if shifted else targets,
        )


class TinkerSteps:
    def __init__(self, trainer: Any, max_context: int | None = None) -> None:
        self.trainer = trainer
        self.max_context = max_context  # tokens of a datum at most (its input and last target)

    def forward_backward(
        self,
        data: list[TokenDatum],
        loss_fn: str,
        config: dict[str, float] | None = None,
        forward_only: bool = False,
    ) -> tuple[list[list[float]], dict[str, float]]:
        """Each datum's logprobs of its targets, and the metrics (`loss:sum`); unless forward_only, the
        loss's gradients are added to the model's."""
        if not data:
            raise ValueError("forward_backward got no data")
        rows = [d.row() for d in data]
        for i, row in enumerate(rows):
            if self.max_context is not None and len(row.ids) > self.max_context:
                raise ValueError(
                    f"datum {i} has {len(row.ids) - 1} input tokens; this model's context is "
                    f"{self.max_context} tokens (input and last target): shorten or split it"
                )
        needed = INPUTS.get(loss_fn, ())
        for i, datum in enumerate(data):
            missing = [key for key in needed if key not in datum.inputs]
            if missing:
                raise ValueError(f"datum {i}: loss_fn {loss_fn!r} needs loss_fn_inputs {list(needed)}")
        trainer, model = self.trainer, self.trainer.model
        trainer.ready()
        logprobs: list[list[float]] = [[] for _ in data]
        total = 0.0
        model.train(not forward_only)  # (a forward alone: eval mode, no dropout: the same numbers each time)
        try:
            for micro in pack(rows, MICRO_BATCH_TOKENS):
                mb = collate([rows[i] for i in micro], trainer.device, trainer.pad_id)
                with torch.set_grad_enabled(not forward_only):
                    lp, _ = trainer.logprobs(mb, None, False)  # (B, T-1): position t, token t + 1
                    inputs = _padded([data[i] for i in micro], needed, lp)
                    loss = tinker_loss(loss_fn, lp, inputs, config)
                if not forward_only:
                    loss.backward()
                total += float(loss.detach())
                values = lp.detach().float().tolist()
                for b, i in enumerate(micro):
                    logprobs[i] = values[b][: len(data[i].input_ids)]
        finally:
            model.eval()
        return logprobs, {"loss:sum": total}

    def optim_step(
        self,
        learning_rate: float,
        beta1: float = 0.9,
        beta2: float = 0.95,
        eps: float = 1e-12,
        weight_decay: float = 0.0,
        grad_clip_norm: float = 0.0,
    ) -> dict[str, float]:
        """One AdamW step on the gradients the forward_backward calls since the last step left (clipped to
        `grad_clip_norm` when > 0), then the gradients cleared. Tinker's defaults."""
        for value, name in ((learning_rate, "learning_rate"), (eps, "eps")):
            if not value > 0:
                raise ValueError(f"adam_params.{name} must be > 0 (got {value})")
        trainer = self.trainer
        for group in trainer.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        limit = grad_clip_norm if grad_clip_norm > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(trainer.parameters, limit))
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": norm}


def _padded(data: list[TokenDatum], keys: tuple[str, ...], lp: torch.Tensor) -> dict[str, torch.Tensor]:
    """The datums' loss inputs as (B, T-1) tensors like lp's, zero past each datum's end."""
    out = {}
    for key in keys:
        tensor = torch.zeros_like(lp, dtype=torch.float32)  # (B, T-1)
        for b, datum in enumerate(data):
            values = datum.inputs[key]
            tensor[b, : len(values)] = torch.tensor(values, dtype=torch.float32)
        out[key] = tensor.to(lp.dtype)
    return out
